"""One request's lifecycle: pick a pair, run its legs, hand the client the output, clean up.

A request needs prefill when its prompt has at least ``disaggregation_min_prompt_tokens``
tokens (vLLM: ``vllm_legs.disaggregates``). The pair's engine picks the leg type that runs
each attempt (``engine_legs``: ``builtin_legs`` for kvxfer's workers, ``vllm_legs`` for vLLM
instances); the lifecycle itself knows no worker API. Either leg failing cancels the other
and frees what the workers hold; a client going away does the same. A failure before the
first token reached the client is retried (``max_retries``, default once) on another pair that excludes the
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
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Union

import httpx

from .admission import AdmissionTicket
from .directory import WorkerDirectory
from .engine_legs import UnknownEngine, legs_for
from .kv_index import PromptBlocks
from .leg_failure import LegFailure
from .legs import CompletionJob, LegServices, RequestState
from .openai_api import RouterError, Usage, usage_from
from .policies import LocalLoad, PairPolicy, WorkerPair, select_pair
from .settings import RouterSettings
from .telemetry import RouterTelemetry
from .load_report_fetch import LoadReportFetcher
from .vllm_http import VllmLegClient
from .worker_auth import WorkerCallSigner, mint_worker_request_id
from .worker_calls import WorkerCalls

log = logging.getLogger(__name__)


class ServingMode(str, enum.Enum):
    """How a request was served; the router's answer says it in ``X-Kvxfer-Serving-Mode``."""

    DISAGGREGATED = "disaggregated"            # prefill worker pushed the KV to the decode worker
    DECODE_ONLY = "decode_only"                # a short prompt: decode worker alone by design
    COLOCATED_FALLBACK = "colocated_fallback"  # needed prefill, but no prefill worker could take it
    PREFIX_CACHED = "prefix_cached"            # kv_aware: the decode worker held nearly all the prompt's KV


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


class Dispatcher:
    """Runs requests against workers; owns the services every leg type uses (the HTTP
    clients, the background clean-up tasks) and the local load count. One per router app."""

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
        self.worker_calls = WorkerCalls(settings, client, self.signer)
        self.telemetry = telemetry
        self.services = LegServices(settings, telemetry, self.signer, self.worker_calls, self.vllm_http,
                                    LoadReportFetcher(settings, telemetry, self.signer, self.vllm_http))
        self.load = LocalLoad()
        self._live: set[RequestLifecycle] = set()

    def start(self, job: CompletionJob, ticket: AdmissionTicket, *, buffered: bool = False) -> RequestLifecycle:
        """Start ``job`` in its own task; the ticket is released when the task ends.
        ``buffered``: the client gets the whole answer at once (not streamed), so tokens are
        held until the finish and a failure mid-generation can still be retried."""
        lifecycle = RequestLifecycle(self, job, ticket, buffered=buffered)
        self._live.add(lifecycle)
        lifecycle.task.add_done_callback(lambda _t: self._live.discard(lifecycle))
        return lifecycle

    @property
    def live(self) -> int:
        """Requests whose task has not finished (including clean-up still running)."""
        return len(self._live)

    async def aclose(self) -> None:
        """Cancel live requests and wait (at most ``shutdown_timeout_s``) for their clean-up."""
        for lifecycle in list(self._live):
            lifecycle.abandon()
        pending = [lc.task for lc in self._live] + self.worker_calls.pending()
        if pending:
            await asyncio.wait(pending, timeout=self.settings.shutdown_timeout_s)
        if self.services.load_reports is not None:
            await self.services.load_reports.aclose()
        await self.vllm_http.aclose()


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
    def task(self) -> asyncio.Task[None]:
        """The task that runs the request (its clean-up included)."""
        return self._task

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
            try:
                # The pair's engine says which leg type runs the attempt (a pair never mixes
                # engines: policies.compatible).
                legs = legs_for(pair.decode.engine)
            except UnknownEngine as exc:
                raise RouterError(502, f"decode worker {pair.decode.worker_id}: {exc}", request_id=self.request_id,
                                  type="server_error", code="unknown_engine") from None
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
                await legs.run(self, self._d.services, pair, worker_rid)
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

    def token(self, token: int, text: str) -> None:
        """One generated token, for the client; held until the finish when ``buffered``."""
        self._output_arrived(timed=True)
        if self.buffered:
            self._held.append(TokenEvent(token, text))
            return
        self.tokens_sent += 1
        self._events.put_nowait(TokenEvent(token, text))

    def finish(self, finish_reason: str, reported_usage: Any, text: str) -> None:
        """The generation ended normally: the held tokens and the finish go to the client.
        ``reported_usage`` is the decoder's (counted here when it is not well-formed)."""
        for held in self._held:
            self.tokens_sent += 1
            self._events.put_nowait(held)
        self._held.clear()
        usage = usage_from(reported_usage, len(self.job.prompt_tokens), self.tokens_sent)
        self._served()
        self._terminal_sent = True
        self._ticket.release_id()  # answered: the client may reuse the id at once
        self._events.put_nowait(FinishEvent(finish_reason, usage, text))

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
