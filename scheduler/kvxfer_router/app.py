"""The router's HTTP app: ``create_app(settings, directory, ...)`` builds it.

Routes: ``POST /v1/completions`` (OpenAI-compatible, streaming as server-sent events or
not), ``GET /v1/models``, ``GET /health``, ``GET /ready``, ``GET /metrics``. The worker
inventory (``GET /workers``, engine addresses) is internal: it is served on the admin port
(``kvxfer_router.admin``), never on this public app.
Nothing happens at import time; the outgoing HTTP client is opened when the app starts
(lifespan) and closed, after in-flight clean-up, when it stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from kvxfer.metrics import metrics_response

from .admission import AdmissionController
from .directory import WorkerDirectory
from .dispatch import Dispatcher, ErrorEvent, Event, FinishEvent, RequestLifecycle, TokenEvent
from .engine_legs import relays_client_body, reports_prefix_index
from .kv_index import PrefixIndexPoller
from .legs import CompletionJob
from .loop_work import LoopOffload, sample_loop_lag
from .openai_api import (
    REQUEST_ID_PATTERN,
    SSE_DONE,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    PromptEncoder,
    RelayedRequest,
    RouterError,
    StreamOptions,
    chat_chunk_body,
    chat_completion_body,
    check_media_type,
    check_sampling,
    default_prompt_encoder,
    models_list,
    now_s,
    render_chat,
    response_id,
    sse_event,
    validation_error,
)
from .policies import PairPolicy, has_pair
from .policy_registry import make_policy
from .settings import RouterSettings
from .telemetry import RouterTelemetry, default_router_metrics
from .vllm_legs import RESERVED_FIELDS, RelayedAnswer, RelayedChunk, RelayedEnd, disaggregates
from .worker_auth import WorkerCallSigner

log = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
#: A JSON escape of a UTF-16 surrogate (\ud800 to \udfff), the way a lone one gets into ASCII JSON.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_body_limited(request: Request, limit_bytes: int, timeout_s: float, rid: str | None) -> bytes:
    """The request body, counted as it streams in: 413 as soon as it passes `limit_bytes`
    (a chunked body has no Content-Length to check first, and buffering it whole let one
    request hold gigabytes), 408 if it has not all arrived within `timeout_s`."""
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit_bytes:
                raise RouterError(413, f"request body exceeds {limit_bytes} bytes", request_id=rid,
                                  code="request_too_large")
            chunks.append(chunk)

    try:
        # A deadline on this task, not wait_for's task per call: the body is nearly always
        # in the first message already, on the way to the first token.
        async with asyncio.timeout(timeout_s):
            await read()
    except asyncio.TimeoutError:
        raise RouterError(408, f"request body not received within {timeout_s} s", request_id=rid,
                          code="request_timeout") from None
    return b"".join(chunks)


def parse_json_body(raw: bytes, rid: str | None) -> Any:
    """Decodes a JSON body; every way it can be bad is a 400 in OpenAI's error shape.

    Deep nesting raises RecursionError rather than ValueError in the json module, and a
    lone UTF-16 surrogate (``"\\ud800"``) is valid JSON that no UTF-8 encoder can write
    back: both once reached the client as a plain-text 500.
    """
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise RouterError(400, "request body is nested too deeply", request_id=rid, code="invalid_json") from None
    except ValueError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}", request_id=rid, code="invalid_json") from None
    if raw.isascii() and not _SURROGATE_ESCAPE.search(raw):
        # An ASCII body gets a lone surrogate only from a \ud800-\udfff escape: without one,
        # the check below, which took 0.4 ms for a 1,024-token-id prompt, is not needed.
        return obj
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode("ascii")
        raise RouterError(400, f"request body holds a string that is not valid Unicode (lone surrogate {bad})",
                          request_id=rid, code="invalid_value") from None
    return obj


class RouterService:
    """Everything one router app holds: settings, directory, policy, admission, dispatcher.

    Reachable as ``app.state.router`` (tests and the CLI use it to inspect in-flight work).
    """

    def __init__(
        self,
        settings: RouterSettings,
        directory: WorkerDirectory,
        *,
        policy: PairPolicy,
        telemetry: RouterTelemetry,
        metrics_registry: CollectorRegistry,
        http_client: httpx.AsyncClient | None,
        prompt_encoder: PromptEncoder,
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.policy = policy
        self.telemetry = telemetry
        self.metrics_registry = metrics_registry
        self.encode_prompt = prompt_encoder
        self.admission = AdmissionController(settings, directory, telemetry)
        self._client = http_client
        self._owns_client = http_client is None
        self._dispatcher: Dispatcher | None = None
        self.signer = WorkerCallSigner.from_settings(settings)
        self.offload = LoopOffload(settings.offload_threads, settings.offload_max_queued, settings.retry_after_s)
        self._lag_sampler: asyncio.Task[None] | None = None
        self._index_poller: asyncio.Task[None] | None = None

    @property
    def dispatcher(self) -> Dispatcher:
        """The dispatcher; created on first use if the app was run without lifespan."""
        if self._dispatcher is None:
            if self._client is None:
                s = self.settings
                self._client = httpx.AsyncClient(
                    timeout=httpx.Timeout(s.control_timeout_s, connect=s.connect_timeout_s),
                    limits=httpx.Limits(max_connections=s.http_max_connections,
                                        max_keepalive_connections=s.http_max_connections),
                    # Workers are reached directly; an HTTP(S)_PROXY in the environment
                    # must not reroute loopback or pod-to-pod calls.
                    trust_env=False,
                )
            self._dispatcher = Dispatcher(self.settings, self.directory, self.policy, self._client, self.telemetry,
                                          self.signer)
        return self._dispatcher

    async def start(self) -> None:
        """Open the outgoing HTTP client; start sampling the event loop's lag."""
        _ = self.dispatcher
        self._lag_sampler = asyncio.ensure_future(sample_loop_lag(self.settings.loop_lag_interval_s, self._loop_lag))
        if self.policy.kv_index is not None:
            # kv_aware's index: workers' reports polled, and entries of departed workers dropped.
            poller = PrefixIndexPoller(self.settings, self.policy.kv_index, self.directory,
                                       lambda: self.dispatcher.client, self.signer, reports_prefix_index)
            self._index_poller = asyncio.ensure_future(poller.run())

    def _loop_lag(self, timer_late_s: float, own_lag_s: float) -> None:
        self.telemetry.loop_lag(timer_late_s)
        self.admission.loop_lag_s = own_lag_s

    async def stop(self) -> None:
        """Cancel in-flight requests (bounded by ``shutdown_timeout_s``), close the client."""
        for task in (self._lag_sampler, self._index_poller):
            if task is not None:
                task.cancel()
        self._lag_sampler = self._index_poller = None
        self.offload.close()
        if self._dispatcher is not None:
            await self._dispatcher.aclose()
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None
            self._dispatcher = None

    def known_models(self) -> set[str]:
        """Models served by at least one registered worker (draining ones included)."""
        return {w.model for w in self.directory.workers()}

    def _check_common(self, obj: dict[str, Any], model: str, max_tokens: int | None, request_id: str) -> int:
        """Checks every endpoint makes: fields only the router sets, the model, max_tokens."""
        for name in RESERVED_FIELDS:
            if name in obj:
                raise RouterError(400, f"{name} is set by the router for each worker, not by clients",
                                  request_id=request_id, param=name, code="invalid_value")
        if model not in self.known_models():
            raise RouterError(404, f"model {model!r} is not served by any registered worker",
                              request_id=request_id, param="model", code="model_not_found")
        value = max_tokens if max_tokens is not None else self.settings.default_max_tokens
        if value > self.settings.max_tokens_limit:
            raise RouterError(400, f"max_tokens is {value}, the limit is {self.settings.max_tokens_limit}",
                              request_id=request_id, param="max_tokens", code="invalid_value")
        return value

    def _vllm_job(self, obj: dict[str, Any], rid: str | None, kind: str) -> tuple[CompletionJob, RelayedRequest]:
        # vLLM validates, tokenizes, templates and checks the context itself, with its own
        # defaults (max_tokens...): the router relays the body, minus its own request_id,
        # and vLLM's refusals reach the client as vLLM wrote them.
        try:
            req = RelayedRequest.model_validate(obj)
        except ValidationError as exc:
            raise validation_error(exc, rid) from None
        request_id = rid or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        for name in RESERVED_FIELDS:
            if name in obj:
                raise RouterError(400, f"{name} is set by the router for each worker, not by clients",
                                  request_id=request_id, param=name, code="invalid_value")
        body = {k: v for k, v in obj.items() if k != "request_id"}
        job = CompletionJob(request_id=request_id, model=req.model, prompt_tokens=[], max_tokens=0,
                            needs_prefill=disaggregates(body, kind), kind=kind, body=body)
        return job, req

    async def _read_object(self, request: Request) -> tuple[dict[str, Any], str | None]:
        header_rid = request.headers.get("x-request-id")
        rid: str | None = header_rid if header_rid and _REQUEST_ID_RE.match(header_rid) else None
        check_media_type(request.headers.get("content-type"), rid)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.settings.max_request_bytes:
            raise RouterError(413, f"request body exceeds {self.settings.max_request_bytes} bytes",
                              request_id=rid, code="request_too_large")
        raw = await read_body_limited(request, self.settings.max_request_bytes,
                                      self.settings.request_body_timeout_s, rid)
        if len(raw) >= self.settings.offload_min_bytes:
            obj = await self.offload.run(rid, parse_json_body, raw, rid)
        else:
            obj = parse_json_body(raw, rid)
        if not isinstance(obj, dict):
            raise RouterError(400, "request body must be a JSON object", request_id=rid, code="invalid_json")
        if isinstance(obj.get("request_id"), str) and _REQUEST_ID_RE.match(obj["request_id"]):
            rid = obj["request_id"]
        return obj, rid

    def _relays(self, obj: dict[str, Any]) -> bool:
        """Whether the body goes to the model's workers as it is (their leg type relays it:
        vLLM instances), not through the router's own schema for kvxfer's workers."""
        model = obj.get("model")
        if not isinstance(model, str):
            return False
        engines = {w.engine for w in self.directory.workers() if w.model == model}
        return relays_client_body(engines)

    async def parse_chat(self, request: Request) -> tuple[CompletionJob, ChatCompletionRequest]:
        """Validate a ``/v1/chat/completions`` request into a job, or raise a 4xx."""
        obj, rid = await self._read_object(request)
        if self._relays(obj):
            return self._vllm_job(obj, rid, "chat")  # type: ignore[return-value]
        try:
            req = ChatCompletionRequest.model_validate(obj)
        except ValidationError as exc:
            raise validation_error(exc, rid) from None
        request_id = rid or f"chatcmpl-{uuid.uuid4().hex}"
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._check_common(obj, req.model, asked, request_id)
        check_sampling(obj, request_id)
        return await self._kvxfer_job(request_id, req.model, render_chat(req.messages), max_tokens, "chat"), req

    async def parse_completion(self, request: Request) -> tuple[CompletionJob, CompletionRequest]:
        """Validate a ``/v1/completions`` request into a job, or raise a 4xx
        :class:`RouterError`. Nothing is reserved or sent anywhere before this passes."""
        obj, rid = await self._read_object(request)
        if self._relays(obj):
            return self._vllm_job(obj, rid, "completion")  # type: ignore[return-value]
        try:
            req = CompletionRequest.model_validate(obj)
        except ValidationError as exc:
            raise validation_error(exc, rid) from None
        request_id = rid or f"cmpl-{uuid.uuid4().hex}"
        max_tokens = self._check_common(obj, req.model, req.max_tokens, request_id)
        check_sampling(obj, request_id)
        return await self._kvxfer_job(request_id, req.model, req.prompt, max_tokens, "completion"), req

    async def _kvxfer_job(self, request_id: str, model: str, text: str, max_tokens: int, kind: str) -> CompletionJob:
        # kvxfer's own workers: the router tokenizes (chat: the rendered messages) and checks
        # the model's context; the prompt's length decides whether it is disaggregated.
        param, subject = ("prompt", "prompt is") if kind == "completion" else ("messages", "messages are")
        if len(text) >= self.settings.offload_min_bytes:
            tokens = await self.offload.run(request_id, self.encode_prompt, text)
        else:
            tokens = self.encode_prompt(text)
        if not tokens:
            raise RouterError(400, f"{param} is empty", request_id=request_id, param=param, code="invalid_value")
        limit = self.settings.prompt_limit(model)
        if len(tokens) > limit:
            raise RouterError(400, f"{subject} {len(tokens)} tokens, model {model!r} accepts at most {limit}",
                              request_id=request_id, param=param, code="context_length_exceeded")
        return CompletionJob(request_id=request_id, model=model, prompt_tokens=tokens, max_tokens=max_tokens,
                             needs_prefill=len(tokens) >= self.settings.disaggregation_min_prompt_tokens, kind=kind)


def create_app(
    settings: RouterSettings | None = None,
    directory: WorkerDirectory | None = None,
    *,
    metrics: Any | None = None,
    metrics_registry: CollectorRegistry | None = None,
    http_client: httpx.AsyncClient | None = None,
    prompt_encoder: PromptEncoder | None = None,
) -> FastAPI:
    """Build the router app.

    ``settings`` default to ``RouterSettings()`` (environment); ``directory`` is required
    (an :class:`~kvxfer_router.directory.EtcdWorkerDirectory` in production, a
    :class:`~kvxfer_router.directory.StaticWorkerDirectory` in tests). ``metrics`` is a
    ``kvxfer.metrics.RouterMetrics`` (or same-shaped object) registered on
    ``metrics_registry``, which ``GET /metrics`` serves; when both are left out a fresh
    registry with a ``RouterMetrics`` is made. ``http_client`` replaces the router's own
    client towards workers (it is then not closed by the app). ``prompt_encoder`` maps a
    prompt to token ids; by default the model's byte tokenizer (with BOS).
    Raises ``ValueError`` for an unknown ``settings.policy``.
    """
    settings = settings or RouterSettings()
    if directory is None:
        raise ValueError("create_app needs a WorkerDirectory (EtcdWorkerDirectory or StaticWorkerDirectory)")
    policy = make_policy(settings.policy, settings)
    if metrics_registry is None:
        metrics_registry = CollectorRegistry()
        if metrics is None:
            metrics = default_router_metrics(metrics_registry)
    service = RouterService(
        settings, directory, policy=policy, telemetry=RouterTelemetry(metrics),
        metrics_registry=metrics_registry, http_client=http_client,
        prompt_encoder=prompt_encoder or default_prompt_encoder(),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="kvxfer router", lifespan=lifespan)
    app.state.router = service

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 once the router can serve: some compatible prefill+decode pair is registered,
        or with `colocated_fallback` a decode worker alone; else 503."""
        if has_pair(directory, needs_prefill=not settings.colocated_fallback):
            return JSONResponse({"ready": True})
        what = "decode worker" if settings.colocated_fallback else "compatible prefill+decode worker pair"
        return JSONResponse({"ready": False, "detail": f"no {what} registered"}, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        """Prometheus exposition of ``metrics_registry``."""
        service.telemetry.workers(directory.workers())
        service.telemetry.registry_rejections(directory.rejected_records())
        if service.policy.kv_index is not None:
            service.telemetry.kv_index(service.policy.kv_index.sizes())
        body, content_type = _render_metrics(metrics_registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """Models served by registered workers, in OpenAI's list shape."""
        return models_list(list(service.known_models()))

    @app.post("/v1/completions", openapi_extra=_COMPLETIONS_OPENAPI,
              responses={200: {"description": "A completion, or server-sent events of completion chunks "
                                              "when `stream` is true",
                               "content": {"application/json": {"schema": _ref(Completion)},
                                           "text/event-stream": {"schema": {"type": "string"}}}},
                         **{code: {"description": what, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
                            for code, what in _ERROR_STATUSES.items()}})
    async def completions(request: Request) -> Response:
        """OpenAI-compatible completion; see the module docs of ``dispatch``."""
        return await serve(request, service.parse_completion)

    @app.post("/v1/chat/completions",
              responses={200: {"description": "A chat completion, or server-sent events of chunks when `stream` is true"},
                         **{code: {"description": what, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
                            for code, what in _ERROR_STATUSES.items()}})
    async def chat_completions(request: Request) -> Response:
        """OpenAI-compatible chat completion (text messages)."""
        return await serve(request, service.parse_chat)

    async def serve(request: Request, parse: Any) -> Response:
        # Both endpoints: parse and admit (4xx/429/503 before anything is sent), then run.
        try:
            job, req = await parse(request)
            ticket = service.admission.admit(job.request_id, job.model, needs_prefill=job.needs_prefill)
        except RouterError as exc:
            return exc.to_response()
        lifecycle = service.dispatcher.start(job, ticket, buffered=not req.stream)
        include_usage = bool(isinstance(req.stream_options, StreamOptions) and req.stream_options.include_usage)
        if req.stream:
            return await _stream_response(request, lifecycle, include_usage)
        return await _full_response(request, lifecycle)

    app.add_middleware(CompletionPostsFirst, parsers={
        "/v1/completions": service.parse_completion, "/v1/chat/completions": service.parse_chat}, serve=serve)
    app.openapi = lambda: _openapi_with_models(app)  # type: ignore[method-assign]
    return app


class CompletionPostsFirst:
    """ASGI middleware that serves ``POST /v1/completions`` and ``POST /v1/chat/completions``
    straight from the app's entry, ahead of Starlette's exception middleware, its routing
    and FastAPI's per-call dependency solving, which a vLLM user otherwise pays on the way
    to every first token. The same ``serve`` answers as the registered routes would (those
    stay, for the OpenAPI schema); everything else goes on to the app."""

    def __init__(self, app: ASGIApp, *, parsers: dict[str, Any], serve: Any) -> None:
        self.app = app
        self._parsers = parsers
        self._serve = serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            parse = self._parsers.get(scope["path"])
            if parse is not None:
                response = await self._serve(Request(scope, receive, send), parse)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


#: The body is read and validated by hand (streamed against its size limit, errors in
#: OpenAI's shape), so FastAPI cannot infer its schema: it is declared here instead.
_COMPLETIONS_OPENAPI: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(CompletionRequest)}}},
}
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_STATUSES: dict[int, str] = {
    400: "Invalid request (bad JSON, bad value, prompt too long)", 404: "Model not served",
    408: "Request body not received in time", 409: "Request id already in flight",
    413: "Request body too large", 422: "Request does not match the schema",
    429: "Overloaded; retry after Retry-After seconds", 502: "A worker failed",
    503: "No worker pair available", 504: "Deadline passed",
}


def _openapi_with_models(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request and response models the completions route names."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, Completion):
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def _render_metrics(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    return metrics_response(registry, accept)


async def _until_disconnect(receive: Receive) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _first_or_disconnect(request: Request, lifecycle: RequestLifecycle, waiter: Any) -> Any | None:
    """Await ``waiter`` (a coroutine on the lifecycle) unless the client leaves first, in
    which case the request is abandoned (both legs cancelled) and ``None`` returned."""
    work = asyncio.ensure_future(waiter)
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        log.info("request %s: client disconnected before the response started", lifecycle.request_id)
        lifecycle.abandon()
        return None
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            lifecycle.abandon()


def _headers(lifecycle: RequestLifecycle) -> dict[str, str]:
    return {"X-Request-Id": lifecycle.request_id, "X-Kvxfer-Serving-Mode": lifecycle.serving_mode.value}


async def _full_response(request: Request, lifecycle: RequestLifecycle) -> Response:
    async def collect() -> tuple[list[TokenEvent], Event]:
        tokens: list[TokenEvent] = []
        while True:
            ev = await lifecycle.next_event()
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            else:
                return tokens, ev

    result = await _first_or_disconnect(request, lifecycle, collect())
    if result is None:
        return Response(status_code=499)  # nobody is listening; the status is for logs only
    tokens, end = result
    if isinstance(end, ErrorEvent):
        return end.error.to_response()
    if isinstance(end, RelayedAnswer):
        return Response(end.body, status_code=end.status, media_type="application/json", headers=_headers(lifecycle))
    assert isinstance(end, FinishEvent)
    text = "".join(t.text for t in tokens) + end.text
    if lifecycle.job.kind == "chat":
        return JSONResponse(chat_completion_body(response_id("chat", lifecycle.request_id), now_s(),
                                                 lifecycle.job.model, text, end.finish_reason, end.usage),
                            headers=_headers(lifecycle))
    body = Completion(
        id=response_id("completion", lifecycle.request_id), created=now_s(), model=lifecycle.job.model,
        choices=[CompletionChoice(text="".join(t.text for t in tokens) + end.text, finish_reason=end.finish_reason)],
        usage=end.usage,
    )
    return Response(body.model_dump_json(), media_type="application/json", headers=_headers(lifecycle))


async def _stream_response(request: Request, lifecycle: RequestLifecycle, include_usage: bool) -> Response:
    # The status line waits for the first event so that a request failing before its first
    # token (after the retry) still gets a proper 5xx instead of a 200 with an error event.
    first = await _first_or_disconnect(request, lifecycle, lifecycle.next_event())
    if first is None:
        return Response(status_code=499)
    if isinstance(first, ErrorEvent):
        return first.error.to_response()
    return CompletionEventStream(lifecycle, first, include_usage)


class CompletionEventStream(StreamingResponse):
    """Server-sent events of one completion: a chunk per token, a final chunk with
    ``finish_reason`` (and usage if asked), then ``data: [DONE]``. An error after the first
    token becomes a ``data: {"error": ...}`` event and the stream ends without ``[DONE]``.

    Unlike a plain ``StreamingResponse`` it guarantees that a client going away abandons the
    request (so both legs are cancelled) however the stream ends.
    """

    def __init__(self, lifecycle: RequestLifecycle, first: Event, include_usage: bool) -> None:
        self._lifecycle = lifecycle
        self._first = first
        self._include_usage = include_usage
        self._cid = response_id(lifecycle.job.kind, lifecycle.request_id)
        self._created = now_s()
        super().__init__(
            self._events(), media_type="text/event-stream",
            headers={**_headers(lifecycle), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _chunk(self, text: str, finish_reason: str | None) -> bytes:
        if self._lifecycle.job.kind == "chat":
            return sse_event(chat_chunk_body(self._cid, self._created, self._lifecycle.job.model, text, finish_reason))
        return sse_event(Completion(
            id=self._cid, created=self._created, model=self._lifecycle.job.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
        ))

    async def _events(self) -> AsyncIterator[bytes]:
        ev = self._first
        while True:
            if isinstance(ev, RelayedChunk):  # a vLLM instance's own event, as it is
                yield ev.data
            elif isinstance(ev, RelayedEnd):
                yield SSE_DONE
                return
            elif isinstance(ev, TokenEvent):
                yield self._chunk(ev.text, None)
            elif isinstance(ev, FinishEvent):
                yield self._chunk(ev.text, ev.finish_reason)
                if self._include_usage and self._lifecycle.job.kind == "chat":
                    yield sse_event(chat_chunk_body(self._cid, self._created, self._lifecycle.job.model, None, None,
                                                    ev.usage))
                elif self._include_usage:
                    yield sse_event(Completion(
                        id=self._cid, created=self._created, model=self._lifecycle.job.model,
                        choices=[], usage=ev.usage,
                    ))
                yield SSE_DONE
                return
            else:
                yield sse_event(ev.error.body())
                return
            ev = await self._lifecycle.next_event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            await _until_disconnect(receive)
            log.info("request %s: client disconnected mid-stream", self._lifecycle.request_id)
            self._lifecycle.abandon()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except OSError:
            pass  # ASGI 2.4 servers raise on send once the client is gone
        finally:
            watcher.cancel()
            self._lifecycle.abandon()  # no-op when the outcome was delivered
