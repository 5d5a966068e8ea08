"""The prefill worker: computes a prompt layer by layer and pushes each layer's KV pages
into a decode worker's reserved pages as soon as they are final.

`PrefillService` is the glue: it queues requests for one compute thread (the model is
CPU-bound and each request uses every core; queue depth is what routers balance on),
keeps each accepted request's `PrefillJob` and turns every failure into a typed
`RequestRejected` for the HTTP layer (`http.py`). The parts it glues:

- `request_checks`: a request is checked against this worker before any compute;
- `prompt_push`: the compute and KV push of one request, over the hand-off's
  `PushSession`; the compute thread never waits for a decoder. The `PushMonitor`
  (handoff/push_monitor.py) watches the writes of every push per destination and resolves
  each push's outcome, so a frozen or dead decoder fails its own pushes within
  `destination_stall_timeout_s` and slows no other destination;
- the hand-off's `AbortSender` (handoff/push_abort.py): a push that cannot complete
  (cancelled, a failed write, a local error) ends with an abort message to its decoder,
  sent once none of its writes is in flight, so the decoder fails the request at once and
  frees its pages; a push's local pages are freed at that same point;
- `cancel_memory`: a cancel stops a request's further writes and answers only once none of
  them is in flight; the id is remembered for `cancel_memory_s`, so a /prefill that
  arrives after its cancel is refused (the decoder may have reused the pages on the
  strength of that answer).

Every push gets the service's `PushHooks` (handoff.push_hooks), given at construction: the
no-op in production; tests and failure drills name their own with `push_hooks`.

With `prefix_cache` on (the default) the prefiller keeps the full prompt pages it computed
(kv.prefix_cache) and computes a prompt from the first block it lacks (prompt_push.py). A
cached page stays referenced (never evicted, never rewritten) until every write that reads
it completed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

from pydantic import Field

from kvxfer.errors import EngineError, TransferError, TransferTimeout
from kvxfer.handoff.push_abort import AbortSender, AbortWords
from kvxfer.handoff.push_hooks import NO_PUSH_HOOKS, PushHooks
from kvxfer.handoff.push_monitor import DestinationDown, PushMonitor, WatchedPush
from kvxfer.kv.page_allocator import OutOfPagesError, PageAllocator
from kvxfer.kv.prefix_cache import PrefixCache
from kvxfer.kv.prefix_hash import block_hashes, reusable_blocks
from kvxfer.kv.protocol import KVReservation
from kvxfer.metrics import PrefillMetrics
from kvxfer.registry.signing import checksum_table_key_of
from kvxfer.workers.prefill.cancel_memory import CancelMemory
from kvxfer.workers.prefill.prompt_push import PrefillJob, PromptPusher
from kvxfer.workers.prefill.request_checks import PrefillRequestChecks
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore, WorkerSettings

#: A /cancel looks this often whether the request's writes are still in flight: a write
#: completes in milliseconds, and the answer frees the decoder's pages.
CANCEL_POLL_S = 0.01
#: A /cancel waits for the writes in flight at most the engine's write deadline plus this
#: (every write ends by its deadline; the margin covers the completion's report).
CANCEL_WAIT_MARGIN_S = 1.0
#: The prefill worker's words for an abort it could not send (no log line for one it sent).
ABORT_WORDS = AbortWords(logging.getLogger("kvxfer.prefill"), "request %s: abort not sent: %s")


class PrefillSettings(WorkerSettings):
    """Prefill worker settings (env prefix KVXFER_)."""

    port: int = 8100
    max_queue: int = 256
    mailbox_slots: int = 256
    emulated_layer_compute_ms: float = Field(
        0.0,
        ge=0.0,
        description="extra time spent after each layer of each chunk, to emulate a larger "
        "model's compute on a small one (overlap benchmarks, failure drills); 0: off",
    )
    cancel_memory_s: float = Field(
        600.0, gt=0, description="how long a cancelled request id is remembered (a late /prefill for it is refused)"
    )
    destination_stall_timeout_s: float = Field(
        0.5, gt=0, description="a decode destination with writes in flight and none completing for this long is "
        "down: its pushes fail at once and new ones are refused until it takes writes again (a frozen or dead "
        "decoder; the engine's transfer_timeout_s would notice only at its deadline)",
    )
    destination_min_rate_bytes_per_s: float = Field(
        50e6, gt=0, description="a destination's writes in flight get destination_stall_timeout_s plus their "
        "bytes at this rate before it counts as down: a big layer write to a slow but healthy decoder is not a stall",
    )
    push_hooks: str = Field(
        "", description="'module:callable' making the handoff.push_hooks.PushHooks every push of this worker calls "
        "(tests and failure drills plug in here, docs/architecture.md); empty: none"
    )


def transfer_failure_reason(exc: Exception, cancelled: bool) -> str:
    """The `reason` label (metrics.TRANSFER_FAILURE_REASONS) of a failed push.

    The engine types its deadline (`TransferTimeout`); the rest it reports as text, so a
    failure to reach the peer is told from a fabric error completion by what it names.
    """
    if cancelled and not isinstance(exc, DestinationDown):
        return "cancelled"
    if isinstance(exc, DestinationDown):
        return "peer_unreachable"
    if isinstance(exc, TransferTimeout):
        return "timeout"
    text = str(exc).lower()
    if any(word in text for word in ("address", "unreachable", "resolve", "connect", "refused")):
        return "peer_unreachable"
    return "completion_error"


class PrefillService:
    """State and logic of a prefill worker, independent of HTTP: queues requests for the
    compute thread, keeps one `PrefillJob` per accepted request until none of its writes is
    in flight, and raises `RequestRejected` for every refusal or failure. `hooks` go to
    every push (handoff.push_hooks): tests and drills give their own, production none."""

    def __init__(self, settings: PrefillSettings, hooks: PushHooks = NO_PUSH_HOOKS) -> None:
        self.settings = settings
        self.core = WorkerCore(settings, "prefill")
        cfg = self.core.config
        self.allocator = PageAllocator(settings.num_pages, cfg.block_size,
                                       prefix_cache=PrefixCache() if settings.prefix_cache else None)
        self.metrics = PrefillMetrics(self.core.metrics_registry)
        self.pushes = PushMonitor(settings.destination_stall_timeout_s, settings.destination_min_rate_bytes_per_s)
        self.core.closers.append(self.pushes.close)
        self.pusher = PromptPusher(
            self.core, self.pushes, self.metrics, num_pages=settings.num_pages, mailbox_slots=settings.mailbox_slots,
            chunk_tokens=settings.prefill_chunk_tokens,
            emulated_layer_compute_s=settings.emulated_layer_compute_ms / 1e3, hooks=hooks,
            table_key=checksum_table_key_of(settings.cluster_key_file),
        )
        self.checks = PrefillRequestChecks(
            self.core.engine, self.core.kv_layout, cfg.num_layers, cfg.block_size, cfg.max_context,
            self.core.cache.page_bytes, self.pusher.mailbox_slot_stride, self.metrics,
        )
        self.aborts = AbortSender(self.core.engine, ABORT_WORDS)
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self._lock = threading.Lock()  # guards jobs, the cancel memory, the allocator and the queue count
        self.jobs: dict[str, PrefillJob] = {}
        self._cancels = CancelMemory(settings.cancel_memory_s)
        self._queued = 0

    def queue_depth(self) -> int:
        """Requests waiting for or in compute."""
        return self._queued

    def load(self) -> dict[str, Any]:
        """Load fields published in etcd and /info."""
        return {
            "total_pages": self.allocator.total_pages,
            "free_pages": self.allocator.free_pages,
            "queue_depth": self._queued,
            "running": len(self.jobs),
        }

    def in_flight(self) -> int:
        """Requests queued, computing or pushing (writes still in flight included)."""
        with self._lock:
            return max(self._queued, len(self.jobs))

    def accept_reservation(self, request_id: str, decode: dict[str, Any]) -> KVReservation:
        """A decoder's reservation parsed and checked against its regions
        (`PrefillRequestChecks.parse_reservation`)."""
        return self.checks.parse_reservation(request_id, decode)

    async def prefill(self, request_id: str, prompt: list[int], reservation: KVReservation,
                      caller: str = "anonymous") -> dict[str, Any]:
        """Computes the prompt, pushes its KV, waits until every write completed; only
        `caller` may cancel it."""
        if self.core.draining:
            raise RequestRejected(Rejection.DRAINING, "worker is draining", request_id)
        self.checks.check_prompt(request_id, prompt)
        self.checks.check_layout(request_id, reservation)
        if self._queued >= self.settings.max_queue:
            raise RequestRejected(Rejection.OVERLOADED, "prefill queue is full", request_id,
                                  retry_after_s=self.settings.retry_after_s)
        try:
            self.pushes.check(reservation.descriptor)
        except DestinationDown as exc:
            self.metrics.count_transfer_failure("peer_unreachable")
            raise RequestRejected(Rejection.DESTINATION_DOWN, f"request {request_id}: {exc}", request_id) from None
        self.checks.check_fence(request_id, reservation)
        self.checks.check_prefix_pages(request_id, prompt, reservation)
        job = self._accept(request_id, prompt, reservation, caller)
        self._update_gauges()
        loop = asyncio.get_running_loop()
        push = self.pushes.watch(job.session, reservation.descriptor, loop, lambda p: self._release(job, p))
        # Retrieved even when nobody awaits it (the handler was cancelled, compute failed first).
        push.outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
        computing = True
        try:
            result = await loop.run_in_executor(self._compute, self.pusher.run, job, push, self._publish)
            with self._lock:
                self._queued -= 1
            computing = False
            self._update_gauges()
            # The compute thread is on to the next request; this push completes (or its
            # destination is found down) on the monitor's watch.
            stats = await push.outcome
            if job.session.cancelled:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled", request_id)
            return self.pusher.answer(result, stats)
        except DestinationDown as exc:
            self.metrics.count_transfer_failure("peer_unreachable")
            raise RequestRejected(Rejection.DESTINATION_DOWN, f"request {request_id}: KV push failed: {exc}",
                                  request_id) from None
        except (TransferError, EngineError) as exc:
            self.metrics.count_transfer_failure(transfer_failure_reason(exc, job.session.cancelled))
            raise RequestRejected(Rejection.PUSH_FAILED, f"request {request_id}: KV push failed: {exc}",
                                  request_id) from None
        finally:
            if computing:
                with self._lock:
                    self._queued -= 1
                self._update_gauges()

    def _accept(self, request_id: str, prompt: list[int], reservation: KVReservation, caller: str) -> PrefillJob:
        """Reserves the local pages (reusing this worker's cached prefix blocks) and opens
        the push; the request is queued from here on."""
        cfg = self.core.config
        hashes = block_hashes(prompt, cfg.block_size, cfg.name) if self.allocator.prefix_cache_enabled else []
        reusable = hashes[:reusable_blocks(len(prompt), cfg.block_size)]
        with self._lock:
            if self._cancels.was_cancelled(request_id):
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled before it arrived",
                                      request_id)
            if request_id in self.jobs:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} is already being prefilled",
                                      request_id)
            try:
                local_pages = self.allocator.reserve(request_id, len(prompt), reusable)
                held = self.allocator.held_pages(request_id)
            except OutOfPagesError as exc:
                raise RequestRejected(Rejection.OVERLOADED, str(exc), request_id,
                                      retry_after_s=self.settings.retry_after_s) from None
            try:
                session = self.pusher.open(reservation, local_pages)
            except TransferError as exc:
                self.allocator.free(request_id)
                raise RequestRejected(Rejection.CONFLICT, str(exc), request_id) from None
            job = PrefillJob(request_id, caller, prompt, reservation, local_pages, held, hashes, session)
            self.jobs[request_id] = job
            self._queued += 1
        return job

    def _publish(self, job: PrefillJob) -> None:
        """The job's full prompt pages are final (the compute thread): the prefix cache
        serves them from now on; referenced until the writes that read them completed."""
        with self._lock:
            if self.jobs.get(job.request_id) is job:
                self.allocator.publish(job.request_id, job.block_hashes)

    def _release(self, job: PrefillJob, push: WatchedPush) -> None:
        """None of the push's writes is in flight any more (the monitor's thread): a failed
        push tells its decoder now, and the local pages are free."""
        if push.error is not None:
            self.aborts.abort(job.abort, job.reservation, job.session.state, job.session.in_flight(),
                              f"{type(push.error).__name__}: {push.error}")
        with self._lock:
            self.jobs.pop(job.request_id, None)
            self.allocator.free(job.request_id)
        self._update_gauges()

    async def cancel(self, request_id: str, caller: str = "anonymous") -> dict[str, Any]:
        """Stops a request's writes; returns once none of them is in flight. Another
        caller's request is unknown to this one."""
        with self._lock:
            job = self.jobs.get(request_id)
            if job is not None and job.caller != caller:
                raise RequestRejected(Rejection.UNKNOWN_REQUEST, f"unknown request id {request_id}", request_id)
            # Remembered even when unknown: its /prefill may still be on its way.
            self._cancels.remember(request_id)
        if job is None:
            return {"request_id": request_id, "in_flight": False, "known": False}
        job.session.cancel()
        deadline = time.monotonic() + self.core.engine.transfer_timeout_s + CANCEL_WAIT_MARGIN_S
        while job.session.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(CANCEL_POLL_S)
        return {"request_id": request_id, "in_flight": job.session.in_flight(), "known": True}

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self._queued)
        counters = self.allocator.prefix_counters()
        if counters is not None:
            self.metrics.prefix.update(counters.held_pages, counters.evictions)
        self.core.update_load(**self.load())
