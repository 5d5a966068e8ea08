"""One request's lifecycle: pick a pair, reserve, run both legs, stream tokens, clean up.

Disaggregated path (prompt of at least ``disaggregation_min_prompt_tokens`` tokens)::

    decode POST /reserve  ->  concurrently: prefill POST /prefill (with the reservation)
                                            decode  POST /generate (stream, NDJSON lines)

Short prompts go to decode ``POST /generate_local`` alone. Either leg failing cancels the
other and sends ``POST /cancel`` to every worker contacted (which also frees the decode
reservation); a client going away does the same. A failure before the first token reached
the client is retried (``max_retries``, default once) on another pair that excludes the
failed worker; after the first token the client gets an error event instead, since tokens
already sent cannot be taken back. A non-streamed answer reaches the client only whole, so
its tokens are held and any failure before the finish is retried.

Overload is a 429 with Retry-After, never a 5xx: a worker answering 429, a ``/reserve``
that timed out (the decoder too starved to answer; the router still cancels the attempt,
and the decoder frees a reservation that completes after the cancel), or a deadline that
passed before any worker reserved.

Each request runs in its own asyncio task that hands events (tokens, finish, error) to the
HTTP side through a queue. That keeps cancellation plain: the HTTP side cancels the task
once, and the task's own ``finally`` blocks run the clean-up, which no outer cancel scope
can interrupt because it runs shielded in a separate task.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import httpx

from kvxfer.kv.protocol import KVReservation, ReservationError

from .admission import AdmissionTicket
from .directory import WorkerDirectory, WorkerView, layout_key
from .kv_index import PromptBlocks
from .openai_api import RouterError, Usage, usage_from
from .policies import LocalLoad, PairPolicy, WorkerPair, select_pair
from .settings import RouterSettings
from .telemetry import RouterTelemetry
from .vllm_http import VllmLegClient
from .vllm_legs import run_vllm_legs
from .worker_auth import WorkerCallSigner, mint_worker_request_id

log = logging.getLogger(__name__)

# Only the first bytes of a worker's error body go into our error message: enough for
# FastAPI's {"detail": ...}, and a misbehaving worker cannot blow up our logs.
_MAX_DETAIL_CHARS = 300

# Statuses with which a worker refuses the request's own content (prompt too long for the
# model's context, max_tokens out of range...) on the calls that carry it: decode POST
# /reserve and POST /generate_local. Every worker would answer the same, so such a refusal
# is the client's 400, never retried; other 4xx (409, 429), 5xx and connection errors are
# the worker's trouble and go to another pair.
_REQUEST_REJECTED_STATUSES = (400, 422)
# A stream's last line is followed only by the end of the chunked body, at once; a worker
# that sends more than this many lines after it, or keeps the stream open longer than this
# (seconds, per line), is not waited for: the connection is closed instead of reused.
_LINES_AFTER_LAST_READ = 8
_REST_OF_STREAM_WAIT_S = 0.5


class RequestState(enum.Enum):
    """Where a request is in its lifecycle."""

    ADMITTED = "admitted"
    RESERVING = "reserving"          # decode POST /reserve in flight
    TRANSFERRING = "transferring"    # prefill and decode legs both running, no token yet
    GENERATING = "generating"        # short prompt on decode alone, no token yet
    STREAMING = "streaming"          # tokens are reaching the client: no retry any more
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ServingMode(str, enum.Enum):
    """How a request was served; the router's answer says it in ``X-Kvxfer-Serving-Mode``."""

    DISAGGREGATED = "disaggregated"            # prefill worker pushed the KV to the decode worker
    DECODE_ONLY = "decode_only"                # a short prompt: decode worker alone by design
    COLOCATED_FALLBACK = "colocated_fallback"  # needed prefill, but no prefill worker could take it
    PREFIX_CACHED = "prefix_cached"            # kv_aware: the decode worker held nearly all the prompt's KV


@dataclass(frozen=True)
class CompletionJob:
    """What the router was asked to do, already validated and tokenized."""

    request_id: str
    model: str
    prompt_tokens: list[int]
    max_tokens: int
    needs_prefill: bool
    #: "completion" or "chat": which OpenAI endpoint the client called.
    kind: str = "completion"
    #: The client's body, for vLLM workers (they tokenize and template it themselves);
    #: None for kvxfer's own workers, which get `prompt_tokens`.
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as the decode worker streamed it."""

    token: int
    text: str


@dataclass(frozen=True)
class FinishEvent:
    """The generation ended normally. ``text`` is what the decode worker's done line still
    carried (the rest of an unfinished UTF-8 character, as U+FFFD); usually empty."""

    finish_reason: str
    usage: Usage
    text: str = ""


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed; ``error`` says how, for the client."""

    error: RouterError


Event = Union[TokenEvent, FinishEvent, ErrorEvent]


class LegFailure(Exception):
    """One leg (a call to one worker) failed. ``stage`` is ``reserve``, ``prefill`` or
    ``generate`` (``kvxfer.metrics.RETRY_STAGES``); ``timed_out`` marks a timeout;
    ``rejected`` marks a worker refusing the request's own content (a client error: no retry);
    ``never_sent`` that the connection was never made, so the worker never saw the call;
    ``status`` is the worker's HTTP status (None without an answer), ``worker_reason`` the
    ``reason`` of its error body and ``retry_after_s`` its Retry-After, when it sent them."""

    def __init__(self, request_id: str, worker: WorkerView, stage: str, reason: str, *, timed_out: bool = False,
                 rejected: bool = False, never_sent: bool = False, status: int | None = None,
                 worker_reason: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(f"request {request_id}: {worker.role} worker {worker.worker_id} failed at {stage}: {reason}")
        self.request_id = request_id
        self.worker = worker
        self.stage = stage
        self.reason = reason
        self.timed_out = timed_out
        self.rejected = rejected
        self.never_sent = never_sent
        self.status = status
        self.worker_reason = worker_reason
        self.retry_after_s = retry_after_s

    @classmethod
    def from_answer(cls, request_id: str, worker: WorkerView, stage: str, path: str, status: int, text: str,
                    headers: Mapping[str, str], *, rejected: bool) -> LegFailure:
        """The failure a worker's error answer (status >= 400) stands for."""
        return cls(request_id, worker, stage, f"POST {path} answered {status}: {_detail(text)}", rejected=rejected,
                   status=status, worker_reason=_reason(text), retry_after_s=_retry_after(headers))


class Dispatcher:
    """Runs requests against workers; owns the HTTP client use, the local load count and
    the background clean-up tasks. One per router app."""

    def __init__(
        self,
        settings: RouterSettings,
        directory: WorkerDirectory,
        policy: PairPolicy,
        client: httpx.AsyncClient,
        telemetry: RouterTelemetry,
        signer: WorkerCallSigner | None = None,
    ) -> None:
        self.settings = settings
        self.signer = signer or WorkerCallSigner(None)
        self.directory = directory
        self.policy = policy
        self.client = client
        #: The vLLM legs' own client (aiohttp): on the way to a vLLM user's first token.
        self.vllm_http = VllmLegClient(settings.http_max_connections, settings.connect_timeout_s)
        self.telemetry = telemetry
        self.load = LocalLoad()
        self._live: set[RequestLifecycle] = set()
        self._background: set[asyncio.Task[Any]] = set()

    def start(self, job: CompletionJob, ticket: AdmissionTicket, *, buffered: bool = False) -> RequestLifecycle:
        """Start ``job`` in its own task; the ticket is released when the task ends.
        ``buffered``: the client gets the whole answer at once (not streamed), so tokens are
        held until the finish and a failure mid-generation can still be retried."""
        lifecycle = RequestLifecycle(self, job, ticket, buffered=buffered)
        self._live.add(lifecycle)
        lifecycle._task.add_done_callback(lambda _t: self._live.discard(lifecycle))
        return lifecycle

    @property
    def live(self) -> int:
        """Requests whose task has not finished (including clean-up still running)."""
        return len(self._live)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a tracked background task (kept referenced until it ends)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def aclose(self) -> None:
        """Cancel live requests and wait (at most ``shutdown_timeout_s``) for their clean-up."""
        for lifecycle in list(self._live):
            lifecycle.abandon()
        pending = [lc._task for lc in self._live] + list(self._background)
        if pending:
            await asyncio.wait(pending, timeout=self.settings.shutdown_timeout_s)
        await self.vllm_http.aclose()

    # --- worker calls, shared by all lifecycles -------------------------------------------

    async def post_json(
        self, worker: WorkerView, path: str, body: dict[str, Any], *, stage: str, request_id: str, total_timeout_s: float
    ) -> dict[str, Any]:
        """POST ``body`` to ``worker``; the JSON object it answers, or :class:`LegFailure`.

        Bounded twice: httpx's per-operation timeouts and ``total_timeout_s`` for the whole
        call, because a worker trickling bytes would otherwise reset the read timeout.
        """
        timeout = httpx.Timeout(total_timeout_s, connect=self.settings.connect_timeout_s)
        try:
            resp = await asyncio.wait_for(
                self.client.post(timeout=timeout, **self.signer.request(worker, path, body)),
                total_timeout_s
            )
        except (httpx.TimeoutException, asyncio.TimeoutError) as exc:
            # Say which limit hit: a connect timeout is not the whole call's.
            limit = (f"connecting took over {self.settings.connect_timeout_s}s" if isinstance(exc, httpx.ConnectTimeout)
                     else f"after {total_timeout_s}s")
            raise LegFailure(request_id, worker, stage, f"POST {path} timed out ({limit})", timed_out=True,
                             never_sent=isinstance(exc, httpx.ConnectTimeout)) from None
        except httpx.ConnectError as exc:  # refused or unroutable: not one byte of the call went out
            raise LegFailure(request_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}",
                             never_sent=True) from exc
        except httpx.HTTPError as exc:
            raise LegFailure(request_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            raise LegFailure.from_answer(request_id, worker, stage, path, resp.status_code, resp.text, resp.headers,
                                         rejected=path == "/reserve" and resp.status_code in _REQUEST_REJECTED_STATUSES)
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise LegFailure(request_id, worker, stage, f"POST {path} answered a non-object body: {_detail(resp.text)}")
        return data

    async def stream_lines(
        self, worker: WorkerView, path: str, body: dict[str, Any], *, stage: str, request_id: str,
        rejected_statuses: tuple[int, ...], end_marker: str, is_last: Callable[[str], bool],
    ) -> AsyncIterator[str]:
        """The lines of a streamed POST to ``worker``, each within its deadline, or :class:`LegFailure`.

        The first line may take ``first_token_timeout_s`` (prefill and admission come first),
        every later one ``token_idle_timeout_s``. A status of 400 or more fails the leg, as a
        client error when it is in ``rejected_statuses``; so does a stream that ends before
        the caller stopped reading at ``end_marker`` (its protocol's last line, which
        ``is_last`` recognises). Use it with ``contextlib.aclosing``, so that an early return
        closes the connection.

        The line ``is_last`` recognises is yielded only once the rest of the body is read,
        so that the connection goes back to the client's pool when the caller stops there.
        A stream left unfinished makes httpx close its connection: every request opened a
        new one to its decoder, and the router's side of each waited a minute in TIME-WAIT
        (1,500 sockets at 25 requests/s; about 470 requests/s to one worker would use up
        the ephemeral ports).
        """
        s = self.settings
        timeout = httpx.Timeout(s.first_token_timeout_s, connect=s.connect_timeout_s, write=s.control_timeout_s)
        try:
            async with self.client.stream("POST", timeout=timeout, **self.signer.request(worker, path, body)) as resp:
                if resp.status_code >= 400:
                    text = (await asyncio.wait_for(resp.aread(), s.control_timeout_s)).decode(errors="replace")
                    raise LegFailure.from_answer(request_id, worker, stage, path, resp.status_code, text, resp.headers,
                                                 rejected=resp.status_code in rejected_statuses)
                async with contextlib.aclosing(timed_lines(resp, s, request_id, worker, stage, end_marker,
                                                           is_last)) as lines:
                    async for line in lines:
                        yield line
        except (httpx.TimeoutException, asyncio.TimeoutError) as exc:
            raise LegFailure(request_id, worker, stage, f"POST {path} timed out: {type(exc).__name__}",
                             timed_out=True) from exc
        except httpx.HTTPError as exc:
            raise LegFailure(request_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}") from exc

    async def cancel_legs(self, request_id: str, workers: list[WorkerView], *,
                          prefill_never_sent: bool = False) -> None:
        """``POST /cancel`` to each of ``workers`` concurrently; failures are logged only,
        since clean-up must never turn into a second error for the client.

        A prefiller answers ``in_flight: false`` only once none of its writes for the
        request can land (and it refuses the id from then on): the decoder is told so
        (``prefill_stopped``) and reuses the pages at once instead of at its fence deadline.
        ``prefill_never_sent``: the connection for ``/prefill`` was never made, so the
        prefiller never had the reservation and nothing of it can land; the decoder is told
        so at once. (A dead prefiller refuses connections: without this every request sent
        its way until its lease expires would hold its pages for the whole fence.)
        """
        if prefill_never_sent:
            await asyncio.gather(*(self._cancel_one(request_id, w, {"request_id": request_id, "prefill_stopped": True})
                                   for w in workers if w.role == "decode"))
            return

        replies = await asyncio.gather(*(self._cancel_one(request_id, w, {"request_id": request_id}) for w in workers))
        stopped = any(w.role == "prefill" and r is not None and r.get("in_flight") is False
                      for w, r in zip(workers, replies))
        if stopped:
            await asyncio.gather(*(self._cancel_one(request_id, w, {"request_id": request_id, "prefill_stopped": True})
                                   for w in workers if w.role == "decode"))

    async def _cancel_one(self, request_id: str, worker: WorkerView, body: dict[str, Any],
                          attempt: int = 0) -> dict[str, Any] | None:
        try:
            return await self.post_json(
                worker, "/cancel", body, stage="cancel",
                request_id=request_id, total_timeout_s=self.settings.cancel_timeout_s,
            )
        except LegFailure as exc:
            log.warning("cancel not confirmed: %s", exc)
            if exc.status is None and attempt < self.settings.cancel_retries:
                # No answer (a starved or restarting worker): the reservation may still be
                # held, and only a cancel frees it before reservation_ttl_s. Sent again in
                # the background, so the client's answer does not wait for it.
                self.spawn(self._cancel_later(request_id, worker, body, attempt + 1))
            return None

    async def _cancel_later(self, request_id: str, worker: WorkerView, body: dict[str, Any], attempt: int) -> None:
        await asyncio.sleep(self.settings.cancel_timeout_s * attempt)
        await self._cancel_one(request_id, worker, body, attempt)


class RequestLifecycle:
    """One admitted request, running in its own task.

    The HTTP side reads events with :meth:`next_event` until a :class:`FinishEvent` or
    :class:`ErrorEvent`, and calls :meth:`abandon` if the client goes away. A ``buffered``
    lifecycle (a non-streamed answer) holds each attempt's tokens until its finish: no byte
    has reached the client before then, so a decoder dying mid-generation is retried on
    another pair like a failure before the first token.
    """

    def __init__(self, dispatcher: Dispatcher, job: CompletionJob, ticket: AdmissionTicket, *,
                 buffered: bool = False) -> None:
        self.job = job
        self.state = RequestState.ADMITTED
        self.buffered = buffered
        #: Tokens handed to the HTTP side (that the client may have seen): none before the
        #: finish when buffered.
        self.tokens_sent = 0
        self._held: list[TokenEvent] = []  # this attempt's tokens, when buffered
        self.attempts: list[WorkerPair] = []
        self.serving_mode = ServingMode.DISAGGREGATED if job.needs_prefill else ServingMode.DECODE_ONLY
        self._d = dispatcher
        self._s = dispatcher.settings
        self._ticket = ticket
        # Unbounded on purpose: at most max_tokens + 2 small events, and the producer must
        # never block on a consumer that stopped reading.
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._terminal_sent = False
        self._last_token_at: float | None = None
        self._prompt: PromptBlocks | None = None
        self._task = asyncio.ensure_future(self._run())

    @property
    def request_id(self) -> str:
        """The client-facing request id."""
        return self.job.request_id

    @property
    def finished(self) -> bool:
        """Whether the task (including clean-up) has ended."""
        return self._task.done()

    async def next_event(self) -> Event:
        """The next event; after a finish or error event there are no more."""
        return await self._events.get()

    async def wait(self) -> None:
        """Wait until the task, including its clean-up, has ended."""
        await asyncio.wait({self._task})

    def abandon(self) -> None:
        """The client is gone: cancel both legs, unless the outcome was already delivered
        (then the task only waits for the prefill reply and ends by itself)."""
        if not self._terminal_sent and not self._task.done():
            self._task.cancel()

    # --- the lifecycle ---------------------------------------------------------------------

    async def _run(self) -> None:
        status = "error"
        deadline = self._ticket.deadline
        try:
            await asyncio.wait_for(self._attempts(), deadline.remaining())
            status = "ok"
            self.state = RequestState.DONE
        except asyncio.TimeoutError:
            if self.state in (RequestState.ADMITTED, RequestState.RESERVING):
                # The whole deadline went by without a worker taking the request: overload.
                status = "rejected"
                self._d.telemetry.rejected_after_admission(429)
                self._fail(self._overloaded(f"no reservation within the deadline of {self._s.request_deadline_s}s "
                                            "(request_deadline_s)", None))
            else:
                status = "timeout"
                self._fail(RouterError(
                    504, f"deadline of {self._s.request_deadline_s}s exceeded (request_deadline_s)",
                    request_id=self.request_id, type="timeout", code="deadline_exceeded",
                ))
        except RouterError as exc:
            if exc.status == 429:
                # Shedding, not a failure: every worker was full or too slow to reserve.
                status = "rejected"
                self._d.telemetry.rejected_after_admission(429)
            self._fail(exc)
        except asyncio.CancelledError:
            # Only abandon() or shutdown cancel this task; the legs were cancelled by the
            # finally blocks below us. Not re-raised: this is our own top-level task.
            status = "cancelled"
            self.state = RequestState.CANCELLED
            self._fail(RouterError(499, "cancelled: client went away", request_id=self.request_id, code="client_closed"))
        except Exception as exc:  # a bug; the client still gets an answer
            log.exception("request %s: unexpected error", self.request_id)
            self._fail(RouterError(500, f"internal router error: {exc!r}", request_id=self.request_id, type="server_error"))
        finally:
            self._ticket.release()
            self._d.telemetry.request_finished(status, deadline.elapsed())

    def _prompt_blocks(self) -> PromptBlocks | None:
        """The prompt as the policy's KV index names it; None for policies without one."""
        if self._d.policy.kv_index is None:
            return None
        return PromptBlocks.for_request(self.job.model, self.job.prompt_tokens, self.job.body, self.job.kind)

    async def _attempts(self) -> None:
        exclude: set[str] = set()
        last: LegFailure | None = None
        prompt = self._prompt = self._prompt_blocks()
        for attempt in range(self._s.max_retries + 1):
            pair = select_pair(
                self._d.directory, self.job.model, needs_prefill=self.job.needs_prefill,
                policy=self._d.policy, load=self._d.load, exclude=exclude,
                max_per_worker=self._s.max_in_flight_per_worker, prompt=prompt,
            )
            if pair is not None and self.job.needs_prefill:
                # kv_aware may send a request that needs prefill to a decode worker that
                # already holds nearly all of its KV.
                self.serving_mode = ServingMode.DISAGGREGATED if pair.prefill else ServingMode.PREFIX_CACHED
            if pair is None and self.job.needs_prefill and self._s.colocated_fallback:
                pair = self._colocated_fallback(exclude, last, prompt)
            if pair is None and select_pair(
                self._d.directory, self.job.model, needs_prefill=self.job.needs_prefill,
                policy=self._d.policy, load=self._d.load, exclude=exclude,
            ) is not None:
                # Workers exist but each has max_in_flight_per_worker of ours: overload.
                raise RouterError(
                    429, f"every worker for model {self.job.model!r} has {self._s.max_in_flight_per_worker} "
                    "requests of this router in flight; retry later",
                    request_id=self.request_id, type="rate_limit_error", code="workers_overloaded",
                    headers={"Retry-After": str(self._s.retry_after_s)},
                )
            if pair is None:
                if last is None:
                    raise RouterError(503, f"no compatible worker pair for model {self.job.model!r}",
                                      request_id=self.request_id, type="service_unavailable", code="no_worker_pair")
                break
            if last is not None:
                self._d.telemetry.retry(last.stage)
                log.info("request %s: retrying on %s after: %s", self.request_id, pair.worker_ids, last)
            # Each attempt has its own id towards the workers, minted here (never the
            # client's): the failed pair may still hold state under the previous one.
            worker_rid = mint_worker_request_id()
            log.debug("request %s: attempt %d is %s on the workers", self.request_id, attempt, worker_rid)
            self.attempts.append(pair)
            self._held.clear()  # a failed attempt's tokens never reach the client
            self._d.load.acquire(pair)
            if pair.estimate is not None and self.job.needs_prefill \
                    and self.serving_mode is not ServingMode.COLOCATED_FALLBACK:
                self._d.telemetry.pair_decision(self._d.policy.name, pair.estimate)
            try:
                if pair.decode.engine == "vllm":
                    await run_vllm_legs(self, pair.decode, pair.prefill, worker_rid)
                elif pair.prefill is None:
                    await self._local(pair.decode, worker_rid)
                else:
                    await self._disaggregated(pair.decode, pair.prefill, worker_rid)
                return
            except LegFailure as failure:
                log.warning("%s", failure)
                last = failure
                if failure.rejected:
                    raise RouterError(
                        400, f"{failure.worker.role} worker {failure.worker.worker_id} rejected the request at "
                        f"{failure.stage}: {failure.reason}",
                        request_id=self.request_id, code="rejected_by_worker",
                    ) from failure
                if self.tokens_sent:
                    raise self._upstream_error(failure, "after streaming had started") from failure
                if failure.worker_reason == "destination_down" and pair.prefill is not None:
                    # The prefiller is fine; the decoder it pushed to stopped taking writes.
                    exclude.add(pair.decode.worker_id)
                else:
                    exclude.add(failure.worker.worker_id)
            finally:
                self._d.load.release(pair)
        assert last is not None
        suffix = "after a retry" if len(self.attempts) > 1 else "and no other worker pair was available"
        raise self._upstream_error(last, suffix)

    def _colocated_fallback(self, exclude: set[str], last: LegFailure | None,
                            prompt: PromptBlocks | None) -> WorkerPair | None:
        """A decode worker alone for a request that needed prefill: no compatible prefill
        worker is eligible (none registered, or the one tried failed and is excluded)."""
        pair = select_pair(self._d.directory, self.job.model, needs_prefill=False,
                           policy=self._d.policy, load=self._d.load, exclude=exclude,
                           max_per_worker=self._s.max_in_flight_per_worker, prompt=prompt)
        if pair is not None:
            reason = "prefill_failed" if last is not None and last.worker.role == "prefill" else "no_prefiller"
            log.info("request %s: serving colocated on %s (%s)", self.request_id, pair.decode.worker_id, reason)
            self._d.telemetry.colocated_fallback(reason)
            self.serving_mode = ServingMode.COLOCATED_FALLBACK
        return pair

    async def _disaggregated(self, decode: WorkerView, prefill: WorkerView, wrid: str) -> None:
        contacted = [decode]
        completed = False
        # Until /prefill is sent, the reservation never left the router: whatever ends the
        # attempt (a /reserve that timed out and completes late included), the decoder
        # may free its pages at once instead of fencing them.
        prefill_never_sent = True
        try:
            self.state = RequestState.RESERVING
            try:
                reservation = await self._reserve(decode, prefill, wrid)
            except LegFailure as failure:
                if failure.status is not None:
                    # The decoder answered with a refusal: it holds nothing for this id
                    # (a /reserve either returns a reservation or takes nothing). Under
                    # overload most attempts end here; a cancel each doubled its load.
                    contacted.clear()
                raise
            self.state = RequestState.TRANSFERRING
            prefill_never_sent = False
            contacted.append(prefill)
            prefill_leg = asyncio.ensure_future(self._prefill(prefill, decode, reservation, wrid))
            generate_leg = asyncio.ensure_future(self._stream(
                decode, "/generate", {"request_id": wrid, "stream": True, "timeout_s": self._s.kv_wait_timeout_s}, wrid,
            ))
            try:
                await asyncio.wait({prefill_leg, generate_leg}, return_when=asyncio.FIRST_EXCEPTION)
                if generate_leg.done() and generate_leg.exception() is None:
                    # The client has its answer; a late prefill error cannot change it (its
                    # KV had all landed, or decode could not have produced tokens).
                    if prefill_leg.exception() is not None:
                        log.warning("request %s: prefill reply failed after decode finished: %s",
                                    self.request_id, prefill_leg.exception())
                    else:
                        self._d.telemetry.prefill_reply(prefill_leg.result())
                    completed = True
                    return
                # Blame the leg that failed first; the other's error is usually a consequence.
                failed = prefill_leg if prefill_leg.done() and prefill_leg.exception() else generate_leg
                raise failed.exception()  # type: ignore[misc]
            finally:
                for leg in (prefill_leg, generate_leg):
                    leg.cancel()
                outcome = (await asyncio.gather(prefill_leg, generate_leg, return_exceptions=True))[0]
                prefill_never_sent = isinstance(outcome, LegFailure) and outcome.never_sent
        finally:
            if not completed:
                await self._cleanup(wrid, contacted, prefill_never_sent=prefill_never_sent)

    async def _local(self, decode: WorkerView, wrid: str) -> None:
        completed = False
        try:
            self.state = RequestState.GENERATING
            await self._stream(decode, "/generate_local", {
                "request_id": wrid, "prompt_tokens": self.job.prompt_tokens,
                "max_tokens": self.job.max_tokens, "stream": True,
            }, wrid)
            completed = True
        finally:
            if not completed:
                await self._cleanup(wrid, [decode])

    async def _cleanup(self, wrid: str, workers: list[WorkerView], *, prefill_never_sent: bool = False) -> None:
        # A separate task, awaited through shield: a second cancel of this task (shutdown
        # racing a disconnect) must not cut the cancels short and leak decode pages. That
        # cancel still propagates, so a cancelled request never goes on to a retry.
        await asyncio.shield(self._d.spawn(self._d.cancel_legs(wrid, workers, prefill_never_sent=prefill_never_sent)))

    # --- legs ------------------------------------------------------------------------------

    async def _reserve(self, decode: WorkerView, prefill: WorkerView, wrid: str) -> dict[str, Any]:
        reply = await self._d.post_json(
            decode, "/reserve",
            # prefill_engine_address: the decoder credits this request's immediates only
            # from that engine (where its provider can tell who sent them).
            {"request_id": wrid, "prompt_tokens": self.job.prompt_tokens, "max_tokens": self.job.max_tokens,
             "prefill_engine_address": prefill.engine_address},
            stage="reserve", request_id=wrid, total_timeout_s=self._s.control_timeout_s,
        )
        try:
            # The one contract check (kvxfer.kv.protocol): version, every field's type and range.
            reservation = KVReservation.from_json(reply, request_id=wrid)
        except ReservationError as exc:
            raise LegFailure(wrid, decode, "reserve", str(exc)) from None
        if layout_key(reservation.kv_layout) != prefill.layout_key:
            # The registry said compatible, the live reservation disagrees: never push KV
            # in a layout the decoder would misread.
            raise LegFailure(wrid, decode, "reserve", f"reserved kv_layout {reservation.kv_layout!r} "
                             f"does not match prefill worker {prefill.worker_id}'s {prefill.kv_layout!r}")
        return reservation.to_json()

    async def _prefill(self, prefill: WorkerView, decode: WorkerView, reservation: dict[str, Any], wrid: str) -> dict[str, Any]:
        # The contract: the reservation goes to the prefiller whole (as parsed and checked by
        # kvxfer.kv.protocol; the mailbox slot, nonce and fence only the two workers
        # interpret); the router adds only the decode engine address from the registry.
        return await self._d.post_json(prefill, "/prefill", {
            "request_id": wrid,
            "prompt_tokens": self.job.prompt_tokens,
            "decode": {"engine_address": decode.engine_address, **reservation},
        }, stage="prefill", request_id=wrid, total_timeout_s=self._s.prefill_timeout_s)

    async def _stream(self, decode: WorkerView, path: str, body: dict[str, Any], wrid: str) -> None:
        """Read a decode NDJSON stream, emitting tokens and the finish event."""
        stage = "generate"
        rejected = _REQUEST_REJECTED_STATUSES if path == "/generate_local" else ()
        stream = self._d.stream_lines(decode, path, body, stage=stage, request_id=wrid,
                                      rejected_statuses=rejected, end_marker="its done line", is_last=is_done_line)
        async with contextlib.aclosing(stream) as lines:
            async for line in lines:
                if not line.strip():
                    continue
                msg = stream_object(line, wrid, decode, stage, "stream line")
                if msg.get("done"):
                    if msg.get("finish_reason") == "error" or msg.get("error"):
                        # Decode ends a failed generation with an error done line, not
                        # a broken stream; it is a leg failure like any other.
                        raise LegFailure(wrid, decode, stage, f"generation failed: {_detail(str(msg.get('error')))}")
                    self._finish(msg)
                    return
                if "token" not in msg:
                    raise LegFailure(wrid, decode, stage, f"unexpected stream line {_detail(line)!r}")
                self._token(int(msg["token"]), str(msg.get("text", "")))

    # --- events ----------------------------------------------------------------------------

    def _output_arrived(self, *, timed: bool) -> None:
        """Bookkeeping of one piece of output from the decoder: the first moves the request
        to STREAMING; with ``timed``, it is observed as time to first token or between tokens."""
        now = time.monotonic()
        if self._last_token_at is None:
            self.state = RequestState.STREAMING
            if timed:
                self._d.telemetry.first_token(self._ticket.deadline.elapsed())
        elif timed:
            self._d.telemetry.inter_token(now - self._last_token_at)
        self._last_token_at = now

    def _token(self, token: int, text: str) -> None:
        self._output_arrived(timed=True)
        if self.buffered:
            self._held.append(TokenEvent(token, text))
            return
        self.tokens_sent += 1
        self._events.put_nowait(TokenEvent(token, text))

    def _finish(self, msg: dict[str, Any]) -> None:
        for held in self._held:
            self.tokens_sent += 1
            self._events.put_nowait(held)
        self._held.clear()
        usage = usage_from(msg.get("usage"), len(self.job.prompt_tokens), self.tokens_sent)
        self._served()
        self._terminal_sent = True
        self._ticket.release_id()  # answered: the client may reuse the id at once
        rest = msg.get("text")
        self._events.put_nowait(FinishEvent(str(msg.get("finish_reason") or "stop"), usage,
                                            rest if isinstance(rest, str) else ""))

    def relay(self, event: Any, *, last: bool) -> None:
        """Hand the client a piece of a worker's own answer as it is (vLLM legs: one event
        of its stream, or its whole answer); ``last`` ends the request like a finish. Once
        one is handed over, the request is no longer retried."""
        # A whole answer (or the stream's end) says nothing of when a token came.
        self._output_arrived(timed=not last)
        self.tokens_sent += 1
        if last:
            self._served()
            self._terminal_sent = True
            self._ticket.release_id()  # answered: the client may reuse the id at once
        self._events.put_nowait(event)

    def _served(self) -> None:
        """The attempt's pair answered: the policy learns where the prompt's KV now is, before
        the client has the answer (a client's next turn must find it)."""
        if self.attempts:
            self._d.policy.served(self.attempts[-1], self._prompt)

    def _fail(self, error: RouterError) -> None:
        if self.state is not RequestState.CANCELLED:
            self.state = RequestState.FAILED
        if not self._terminal_sent:
            self._terminal_sent = True
            self._ticket.release_id()
            self._events.put_nowait(ErrorEvent(error))

    def _overloaded(self, message: str, retry_after_s: int | None) -> RouterError:
        """The 429 of a request no worker could take now (with Retry-After, never a 5xx)."""
        return RouterError(429, message, request_id=self.request_id, type="rate_limit_error",
                           code="workers_overloaded",
                           headers={"Retry-After": str(self._s.retry_after_s if retry_after_s is None else retry_after_s)})

    def _upstream_error(self, failure: LegFailure, context: str) -> RouterError:
        if failure.status == 429 or (failure.stage == "reserve" and failure.timed_out):
            # Every worker tried was full (pages, slots, queue), or too slow to even reserve
            # (its HTTP side starved under load): overload, never a 5xx. A late reservation
            # was cancelled (freed at once: it never reached a prefiller).
            return self._overloaded(f"{failure.worker.role} worker {failure.worker.worker_id} is overloaded at "
                                    f"{failure.stage} ({failure.reason}) {context}", failure.retry_after_s)
        status, code = (504, "worker_timeout") if failure.timed_out else (502, "worker_failed")
        return RouterError(
            status, f"{failure.worker.role} worker {failure.worker.worker_id} failed at {failure.stage} "
            f"({failure.reason}) {context}",
            request_id=self.request_id, type="server_error", code=code,
        )


def _reason(text: str) -> str | None:
    """The ``reason`` of a kvxfer worker's error body, if it has one."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    reason = parsed.get("reason") if isinstance(parsed, dict) else None
    return reason if isinstance(reason, str) else None


def _retry_after(headers: Mapping[str, str]) -> int | None:
    """A worker's Retry-After in whole seconds (None when absent or not a number)."""
    value = headers.get("retry-after")
    return int(value) if value is not None and value.strip().isdigit() else None


async def timed_lines(resp: httpx.Response, settings: RouterSettings, request_id: str, worker: WorkerView, stage: str,
                      end_marker: str, is_last: Callable[[str], bool]) -> AsyncIterator[str]:
    """The lines of a streamed answer, each within its deadline (the first
    ``first_token_timeout_s``, later ones ``token_idle_timeout_s``), or :class:`LegFailure`;
    so is a stream that ends before the caller stopped reading at ``end_marker``. The line
    ``is_last`` recognises is yielded only once the rest of the body is read, so that the
    connection goes back to the client's pool (see :meth:`Dispatcher.stream_lines`)."""
    lines = resp.aiter_lines()
    wait_s = settings.first_token_timeout_s
    while True:
        try:
            line = await asyncio.wait_for(lines.__anext__(), wait_s)
        except StopAsyncIteration:
            raise LegFailure(request_id, worker, stage, f"stream ended before {end_marker}") from None
        except asyncio.TimeoutError:
            raise LegFailure(request_id, worker, stage, f"no stream line within {wait_s}s", timed_out=True) from None
        wait_s = settings.token_idle_timeout_s
        if is_last(line):
            await _read_to_end(lines, _REST_OF_STREAM_WAIT_S)
        yield line


async def _read_to_end(lines: AsyncIterator[str], timeout_s: float) -> None:
    """Reads what follows a stream's last line (normally nothing but the end of the body),
    at most _LINES_AFTER_LAST_READ lines, each within ``timeout_s``; gives up silently (the
    connection is then closed rather than reused)."""
    with contextlib.suppress(StopAsyncIteration, asyncio.TimeoutError):
        for _ in range(_LINES_AFTER_LAST_READ):
            await asyncio.wait_for(lines.__anext__(), timeout_s)


def is_done_line(line: str) -> bool:
    """Whether an NDJSON line of a decode worker's stream is its last (``"done": true``);
    a line that does not parse is not (the reader reports it)."""
    if '"done"' not in line:  # every token line is parsed once more otherwise
        return False
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and bool(obj.get("done"))


def stream_object(text: str, wrid: str, decode: WorkerView, stage: str, what: str) -> dict[str, Any]:
    """One JSON object of a decode stream (an NDJSON line or an SSE event's data); anything
    else fails the leg with LegFailure naming `what` it was."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise LegFailure(wrid, decode, stage, f"unreadable {what} {_detail(text)!r}") from None
    if not isinstance(obj, dict):
        raise LegFailure(wrid, decode, stage, f"unexpected {what} {_detail(text)!r}")
    return obj


def _detail(text: str) -> str:
    """A worker's error body, shortened; FastAPI's ``{"detail": ...}`` is unwrapped."""
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict) and "detail" in parsed:
            text = str(parsed["detail"])
    except ValueError:
        pass
    return text[:_MAX_DETAIL_CHARS]
