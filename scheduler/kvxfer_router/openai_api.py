"""The OpenAI-compatible surface: request and response models, error bodies, prompt encoding.

For kvxfer's own workers ``/v1/completions`` takes a string prompt and chat text messages.
Unknown extra fields (top_p, ...) are accepted and ignored, as the workers sample greedily;
fields the router does read are validated strictly, and ``n`` and ``temperature`` as vLLM
validates them (``check_sampling``), so that a bad request gets a clear 4xx instead of a
surprise. Models served by vLLM instances take vLLM's whole schema: the body is relayed
(``vllm_legs``), and only ``RelayedRequest`` is read here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from typing import Any, Callable, Literal, Mapping

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvxfer.model.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

# Request ids travel to workers, into logs and metrics: keep them short and printable.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"

PromptEncoder = Callable[[str], list[int]]


class RouterError(Exception):
    """An error answered to the client in OpenAI's shape, carrying the request id.

    ``status`` is the HTTP status; ``type``/``code``/``param`` fill OpenAI's error object;
    ``headers`` are added to the response (``Retry-After`` on a 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        request_id: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        raw_body: bytes | None = None,
    ) -> None:
        prefix = f"request {request_id}: " if request_id else ""
        super().__init__(prefix + message)
        #: A vLLM instance's own error body (``{"error": {...}}``), answered as it is.
        self.raw_body = raw_body
        self.status = status
        self.message = message
        self.request_id = request_id
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """OpenAI error body: ``{"error": {message, type, param, code, request_id}}``, or
        the vLLM instance's own body when the error is its refusal."""
        if self.raw_body is not None:
            with contextlib.suppress(ValueError):
                parsed = json.loads(self.raw_body)
                if isinstance(parsed, dict):
                    return parsed
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
                "request_id": self.request_id,
            }
        }

    def to_response(self) -> JSONResponse:
        """This error as a JSON response with its status and headers."""
        headers = dict(self.headers)
        if self.request_id:
            headers.setdefault("X-Request-Id", self.request_id)
        if self.raw_body is not None:
            return Response(self.raw_body, status_code=self.status, headers=headers, media_type="application/json")
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` adds a final chunk with usage."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(False, strict=True)


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions``. ``request_id`` is a kvxfer extension: the client's
    own id, used towards the workers and echoed in ``X-Request-Id``."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    prompt: str = Field(strict=True)
    max_tokens: int | None = Field(None, strict=True, gt=0)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)


def validation_error(exc: ValidationError, request_id: str | None) -> RouterError:
    """A 400 naming the first offending field of a request body."""
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "body"
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        msg = "is required"
    return RouterError(400, f"{loc}: {msg}", request_id=request_id, param=loc, code="invalid_value")


class Usage(BaseModel):
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    """One choice of a completion or chunk (the router always has exactly one)."""

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A non-streaming completion, and (with ``object`` unchanged, as OpenAI does) one
    streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def completion_id(request_id: str) -> str:
    """The ``id`` OpenAI clients see for ``request_id`` on ``/v1/completions``."""
    return request_id if request_id.startswith("cmpl-") else f"cmpl-{request_id}"


def response_id(kind: str, request_id: str) -> str:
    """The ``id`` of an answer of endpoint ``kind`` ("completion" or "chat"), as vLLM forms
    it: ``cmpl-...`` or ``chatcmpl-...`` (never both prefixes)."""
    if kind != "chat":
        return completion_id(request_id)
    return request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id}"


#: The one media type vLLM's OpenAI server accepts for a body (vLLM refuses others with 400).
JSON_MEDIA_TYPE = "application/json"


def check_media_type(content_type: str | None, request_id: str | None) -> None:
    """400 unless the body is declared JSON, with vLLM's message (vLLM refuses a
    ``text/plain`` or undeclared body the same way)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise RouterError(400, f"Unsupported Media Type: Only '{JSON_MEDIA_TYPE}' is allowed",
                          request_id=request_id, code="unsupported_media_type")


def check_sampling(obj: Mapping[str, Any], request_id: str | None) -> None:
    """``n`` and ``temperature`` as vLLM checks them (vllm.sampling_params), with its
    messages, for kvxfer's own workers: they sample greedily, so ``n`` is 1, as vLLM
    requires of greedy sampling. A NaN (Python's JSON reader accepts it) is refused."""
    n = obj.get("n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise RouterError(400, f"n must be an int, but is of type {type(n)}", request_id=request_id,
                              param="n", code="invalid_value")
        if n < 1:
            raise RouterError(400, f"n must be at least 1, got {n}.", request_id=request_id, param="n",
                              code="invalid_value")
        if n > 1:
            raise RouterError(400, f"n must be 1 when using greedy sampling, got {n}.", request_id=request_id,
                              param="n", code="invalid_value")
    t = obj.get("temperature")
    if t is None:
        return
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise RouterError(400, "temperature must be a number", request_id=request_id, param="temperature",
                          code="invalid_value")
    if not math.isfinite(t):
        problem = f"temperature must be a finite number, got {t}."
    elif t < 0.0:
        problem = f"temperature must be non-negative, got {t}."
    elif t > 2.0:
        problem = f"temperature must be in [0, 2], got {t}."
    else:
        return
    raise RouterError(400, problem, request_id=request_id, param="temperature", code="invalid_value")


def now_s() -> int:
    """Unix time in whole seconds, for ``created``."""
    return int(time.time())


def usage_from(worker_usage: Mapping[str, Any] | None, prompt_tokens: int, completion_tokens: int) -> Usage:
    """Usage from the decode worker's figures when it gave them, else from the router's count."""
    u = dict(worker_usage or {})
    p = int(u.get("prompt_tokens", prompt_tokens))
    c = int(u.get("completion_tokens", completion_tokens))
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=int(u.get("total_tokens", p + c)))


def models_list(models: list[str]) -> dict[str, Any]:
    """Body of ``GET /v1/models``."""
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": 0, "owned_by": "kvxfer"} for m in sorted(models)],
    }


def sse_event(payload: BaseModel | Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, str):
        data = payload
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def default_prompt_encoder() -> PromptEncoder:
    """The workers' own tokenizer (BOS first), so the router counts and sends exactly the
    tokens the model expects. Imported directly: a failure to import is a broken install,
    and must not silently change what the model sees."""
    encode = ByteTokenizer().encode
    return lambda prompt: list(encode(prompt))


class RelayedRequest(BaseModel):
    """What the router reads of a body relayed to vLLM instances (the rest is vLLM's to
    validate): the model, whether to stream, and the kvxfer request id."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, strict=True)
    stream: bool | None = Field(False, strict=True)
    stream_options: dict[str, Any] | None = None
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)


# ---- chat completions -------------------------------------------------------------------

class ChatMessage(BaseModel):
    """One message of a chat: a role and text content."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=64, strict=True)
    content: str = Field(strict=True)


class ChatCompletionRequest(BaseModel):
    """Body of ``POST /v1/chat/completions`` (text messages). vLLM workers apply the model's
    chat template themselves; kvxfer's own workers get ``render_chat`` of the messages."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, strict=True, gt=0)
    max_completion_tokens: int | None = Field(None, strict=True, gt=0)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)


def render_chat(messages: list[ChatMessage]) -> str:
    """The plain template kvxfer's own model uses: one ``role: content`` line per message,
    then ``assistant: `` (the same template the generated test checkpoints carry)."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant: "


def chat_completion_body(cid: str, created: int, model: str, text: str, finish_reason: str,
                         usage: Usage) -> dict[str, Any]:
    """A non-streaming chat completion."""
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
            "usage": usage.model_dump()}


def chat_chunk_body(cid: str, created: int, model: str, text: str | None, finish_reason: str | None,
                    usage: Usage | None = None) -> dict[str, Any]:
    """One streamed chat chunk; with ``usage`` and no text, the final usage chunk."""
    choices = [] if usage is not None and text is None else [
        {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}]
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": choices}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body
