"""The prefill worker: computes a prompt layer by layer and pushes each layer's KV pages
into a decode worker's reserved pages as soon as they are final.

Compute runs on one thread (the model is CPU-bound and each request uses every core);
callers (the HTTP handlers of `http.py`) queue requests for it. That thread only computes
and posts writes: it never waits for a decoder. The `PushMonitor` (handoff/push_monitor.py)
watches the writes of every push per destination and resolves each push's outcome, so a
frozen or dead decoder fails its own pushes within `destination_stall_timeout_s` and slows
no other destination, and a slow one delays only its own requests. A push's local pages are
freed once none of its writes is in flight any more. A cancel stops a request's
further writes and answers only once none of its writes is still in flight; the id is remembered for
`cancel_memory_s`, so a /prefill that arrives after its cancel is refused (the decoder
may have reused the pages on the strength of that answer). A push that cannot complete
(cancelled, a failed write, a local error) ends with an abort message to the decoder,
sent once none of its writes is in flight, so the decoder fails the request at once and
frees its pages.

Every push gets the runtime's `PushHooks` (handoff.push_hooks), given at construction: the
no-op in production; tests and failure drills name their own with `push_hooks`.

With `prefix_cache` on (the default) the prefiller keeps the full prompt pages it computed
(kv.prefix_cache): a prompt whose leading blocks it holds is computed from the first block
it lacks (`Transformer.prefill(start_pos=...)`), and the pages the decoder holds (the
reservation's `first_page`) are not pushed; pages the decoder lacks but this worker holds
are pushed from its cache before compute starts. A cached page stays referenced (never
evicted, never rewritten) until every write that reads it completed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from typing import Any

import numpy as np
from pydantic import Field

from kvxfer.errors import EngineError, KvxferError, TransferError, TransferTimeout
from kvxfer.kv.page_allocator import OutOfPagesError, PageAllocator
from kvxfer.kv.prefix_cache import PrefixCache
from kvxfer.kv.prefix_hash import block_hashes, reusable_blocks
from kvxfer.kv.protocol import (
    CHECKSUM_BYTES,
    MAILBOX_SLOT_BYTES,
    KVReservation,
    ReservationError,
    encode_abort,
    mailbox_slot_bytes,
    pages_for_tokens,
)
from kvxfer.handoff.push_session import PushSession
from kvxfer.handoff.push_hooks import NO_PUSH_HOOKS, PushHooks
from kvxfer.handoff.push_monitor import DestinationDown, PushMonitor, WatchedPush
from kvxfer.metrics import PrefillMetrics
from kvxfer.registry.signing import checksum_table_key_of
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore, WorkerSettings

log = logging.getLogger("kvxfer.prefill")


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
    """State and logic of a prefill worker, independent of HTTP. `hooks` go to every push
    (handoff.push_hooks): tests and drills give their own, production none."""

    def __init__(self, settings: PrefillSettings, hooks: PushHooks = NO_PUSH_HOOKS) -> None:
        self.settings = settings
        self.hooks = hooks
        self.core = WorkerCore(settings, "prefill")
        self.allocator = PageAllocator(settings.num_pages, self.core.config.block_size,
                                       prefix_cache=PrefixCache() if settings.prefix_cache else None)
        cfg = self.core.config
        # Room per slot for the record and one checksum per (layer, page) of the longest prompt.
        max_prompt_pages = min(pages_for_tokens(cfg.max_context, cfg.block_size), settings.num_pages)
        self.mailbox_slot_stride = mailbox_slot_bytes(cfg.num_layers, max_prompt_pages)
        self.mailbox = np.zeros(settings.mailbox_slots * self.mailbox_slot_stride, dtype=np.uint8)
        self.mailbox_region = self.core.engine.register(self.mailbox)
        # Tags checksum tables for decoders that ask (a reservation's checksum_tag).
        self._table_key = checksum_table_key_of(settings.cluster_key_file)
        self.metrics = PrefillMetrics(self.core.metrics_registry)
        # One compute thread: requests queue here; queue depth is what routers balance on.
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self.sessions: dict[str, PushSession] = {}
        self._owners: dict[str, str] = {}  # request id -> the caller that sent its /prefill
        self._queued = 0
        self._slot = 0
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()
        self._cancelled: dict[str, float] = {}  # request id -> monotonic expiry of the memory
        self._aborts: list[Any] = []  # abort sends not yet completed (kept referenced)
        self.pushes = PushMonitor(settings.destination_stall_timeout_s, settings.destination_min_rate_bytes_per_s)
        self.core.closers.append(self.pushes.close)

    def queue_depth(self) -> int:
        """Requests waiting for or in compute."""
        return self._queued

    def load(self) -> dict[str, Any]:
        """Load fields published in etcd and /info."""
        return {
            "total_pages": self.allocator.total_pages,
            "free_pages": self.allocator.free_pages,
            "queue_depth": self._queued,
            "running": len(self.sessions),
        }

    def in_flight(self) -> int:
        """Requests queued, computing or pushing (writes still in flight included)."""
        with self._lock:
            return max(self._queued, len(self.sessions))

    async def prefill(self, request_id: str, prompt: list[int], reservation: KVReservation,
                      caller: str = "anonymous") -> dict[str, Any]:
        """Computes the prompt, pushes its KV, waits until every write completed; only
        `caller` may cancel it."""
        cfg = self.core.config
        if self.core.draining:
            raise RequestRejected(Rejection.DRAINING, "worker is draining", request_id)
        if not prompt:
            raise RequestRejected(Rejection.BAD_REQUEST, "prompt is empty", request_id)
        if len(prompt) > cfg.max_context:
            raise RequestRejected(Rejection.BAD_REQUEST, f"prompt of {len(prompt)} tokens exceeds the context of {cfg.max_context}", request_id)
        if reservation.kv_layout != self.core.kv_layout:
            self.metrics.count_transfer_failure("layout_mismatch")
            raise RequestRejected(
                Rejection.CONFLICT,
                f"KV layout mismatch: decoder {reservation.kv_layout}, prefiller {self.core.kv_layout}",
                request_id,
            )
        if self._queued >= self.settings.max_queue:
            raise RequestRejected(Rejection.OVERLOADED, "prefill queue is full", request_id,
                                  retry_after_s=self.settings.retry_after_s)
        try:
            self.pushes.check(reservation.descriptor)
        except DestinationDown as exc:
            self.metrics.count_transfer_failure("peer_unreachable")
            raise RequestRejected(Rejection.DESTINATION_DOWN, f"request {request_id}: {exc}", request_id) from None
        if reservation.fence_timeout_s <= self.core.engine.transfer_timeout_s:
            raise RequestRejected(
                Rejection.CONFLICT,
                f"the decoder fences its pages for {reservation.fence_timeout_s} s, not longer than this "
                f"prefiller's transfer_timeout_s={self.core.engine.transfer_timeout_s} s: a late write "
                "could land in reused pages",
                request_id,
            )
        prompt_pages = pages_for_tokens(len(prompt), cfg.block_size)
        if reservation.first_page and reservation.first_page + len(reservation.pages) != prompt_pages:
            raise RequestRejected(
                Rejection.CONFLICT,
                f"the decoder holds {reservation.first_page} prompt pages and reserved {len(reservation.pages)} more; "
                f"the prompt has {prompt_pages}",
                request_id,
            )
        hashes = block_hashes(prompt, cfg.block_size, cfg.name) if self.allocator.prefix_cache_enabled else []
        reusable = hashes[:reusable_blocks(len(prompt), cfg.block_size)]
        with self._lock:
            self._forget_cancelled()
            if request_id in self._cancelled:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled before it arrived", request_id)
            if request_id in self.sessions:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} is already being prefilled", request_id)
            try:
                local_pages = self.allocator.reserve(request_id, len(prompt), reusable)
                held = self.allocator.held_pages(request_id)
            except OutOfPagesError as exc:
                raise RequestRejected(Rejection.OVERLOADED, str(exc), request_id,
                                      retry_after_s=self.settings.retry_after_s) from None
            slot = self._slot
            self._slot = (self._slot + 1) % self.settings.mailbox_slots
            try:
                session = PushSession(
                    self.core.engine, self.core.cache, self.core.cache_region, self.mailbox,
                    self.mailbox_region, slot, self.mailbox_slot_stride, reservation, local_pages,
                    # A stall longer than this between two writes could outlast the decoder's
                    # fence (which outlasts a write's deadline by this much): see PushStalled.
                    max_stall_s=reservation.fence_timeout_s - self.core.engine.transfer_timeout_s,
                    hooks=self.hooks,
                    table_key=self._table_key,
                )
            except TransferError as exc:
                self.allocator.free(request_id)
                raise RequestRejected(Rejection.CONFLICT, str(exc), request_id) from None
            self.sessions[request_id] = session
            self._owners[request_id] = caller
            self._queued += 1
        self._update_gauges()
        loop = asyncio.get_running_loop()
        push = self.pushes.watch(session, reservation.descriptor, loop, self._release)
        # Retrieved even when nobody awaits it (the handler was cancelled, compute failed first).
        push.outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
        computing = True
        try:
            result = await loop.run_in_executor(self._compute, self._run, request_id, prompt, session, local_pages,
                                                push, held, hashes)
            with self._lock:
                self._queued -= 1
            computing = False
            self._update_gauges()
            # The compute thread is on to the next request; this push completes (or its
            # destination is found down) on the monitor's watch.
            stats = await push.outcome
            if session.cancelled:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled", request_id)
            return self._push_result(result, stats)
        except DestinationDown as exc:
            self.metrics.count_transfer_failure("peer_unreachable")
            raise RequestRejected(Rejection.DESTINATION_DOWN, f"request {request_id}: KV push failed: {exc}",
                                  request_id) from None
        except (TransferError, EngineError) as exc:
            self.metrics.count_transfer_failure(transfer_failure_reason(exc, session.cancelled))
            raise RequestRejected(Rejection.PUSH_FAILED, f"request {request_id}: KV push failed: {exc}", request_id) from None
        finally:
            if computing:
                with self._lock:
                    self._queued -= 1
                self._update_gauges()

    def _release(self, push: WatchedPush) -> None:
        """None of the push's writes is in flight any more (the monitor's thread): a failed
        push tells its decoder now, and the local pages are free."""
        session = push.session
        request_id = session.reservation.request_id
        if push.error is not None:
            self._send_abort(session, f"{type(push.error).__name__}: {push.error}")
        with self._lock:
            self.sessions.pop(request_id, None)
            self._owners.pop(request_id, None)
            self.allocator.free(request_id)
        self._update_gauges()

    def accept_reservation(self, request_id: str, decode: dict[str, Any]) -> KVReservation:
        """Parses a decoder's reservation (`KVReservation.from_json`, which names any bad
        field) and checks it against the decoder's regions.

        Out-of-range pages, offsets or immediates are the caller's error, found before any
        compute, not a failed push half-way through the writes. `from_json` already checks
        the fields against each other (page ids below `num_pages`, the immediate's form);
        here they are checked against the regions the descriptors name.
        """
        try:
            reservation = KVReservation.from_json(decode, request_id=request_id)
        except ReservationError as exc:
            raise RequestRejected(Rejection.INVALID, str(exc), request_id) from None
        regions = []
        for name in ("descriptor", "meta_descriptor"):
            try:
                regions.append(self.core.engine._remote(getattr(reservation, name)))
            except (KvxferError, ValueError, TypeError) as exc:
                raise RequestRejected(Rejection.INVALID, f"malformed decode reservation: {name}: {exc}", request_id) from None
        kv_region, meta_region = regions
        layer_bytes = reservation.num_pages * self.core.cache.page_bytes
        record_bytes = MAILBOX_SLOT_BYTES
        if reservation.checksums:
            record_bytes += CHECKSUM_BYTES * reservation.num_layers * reservation.prompt_pages
        if (
            self.core.config.num_layers * layer_bytes > kv_region.length
            or not reservation.meta_offset <= meta_region.length - record_bytes
            or record_bytes > self.mailbox_slot_stride
        ):
            raise RequestRejected(
                Rejection.INVALID,
                "malformed decode reservation: pages or meta_offset outside the decoder's regions",
                request_id,
            )
        return reservation

    def _run(self, request_id: str, prompt: list[int], session: PushSession, local_pages: list[int],
             push: WatchedPush, held: int, hashes: list[bytes]) -> dict[str, Any]:
        """Compute and post every write (the compute thread); never waits for the decoder.

        A push that cannot complete is ended here; the monitor sends the abort once none of
        its writes is in flight (the decoder then fails the request and reuses the pages at once).
        """
        try:
            self.pushes.check(push.destination)
            result = self._compute_and_push(request_id, prompt, session, local_pages, push, held, hashes)
        except BaseException as exc:
            self.pushes.end(push, exc)
            raise
        self.pushes.posted(push)
        return result

    def _send_abort(self, session: PushSession, why: str) -> None:
        reservation = session.reservation
        try:
            transfer = self.core.engine.send(reservation.descriptor, encode_abort(reservation.imm, reservation.nonce, why))
        except (KvxferError, ValueError) as exc:  # the decoder falls back to its fence deadline
            log.warning("request %s: abort not sent: %s", reservation.request_id, exc)
            return
        with self._lock:
            # Not waited for here (the compute thread moves on); kept referenced until done.
            self._aborts = [t for t in self._aborts if not t.done()] + [transfer]

    def _forget_cancelled(self) -> None:
        now = time.monotonic()
        for rid in [r for r, expiry in self._cancelled.items() if expiry <= now]:
            del self._cancelled[rid]

    def _compute_and_push(
        self, request_id: str, prompt: list[int], session: PushSession, local_pages: list[int], push: WatchedPush,
        held: int, hashes: list[bytes],
    ) -> dict[str, Any]:
        """Pushes the cached pages the decoder lacks, computes from the first block this
        worker lacks (`held` blocks came from its prefix cache) and pushes each layer's new
        pages; then caches the prompt's full pages (`hashes`)."""
        if session.cancelled:
            raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled before compute", request_id)
        t0 = time.perf_counter()
        peer = session.reservation.descriptor
        self._peers.add(peer[:64])
        extra_s = self.settings.emulated_layer_compute_ms / 1e3
        session.mark_progress()
        block_size = self.core.config.block_size
        if held > session.first_page:
            # Final already (this worker's prefix cache), and the decoder lacks them.
            for layer in range(self.core.config.num_layers):
                session.on_layer_done(layer, session.first_page, held)

        def on_layer_done(layer: int, chunk: Any) -> None:
            if push.error is not None:  # its destination is down: stop computing for it
                raise push.error
            if extra_s:
                time.sleep(extra_s)  # the layer "computes" longer, then its pages go out
            session.on_layer_done(layer, chunk.first_block, chunk.end_block)

        result = self.core.model.prefill(
            prompt,
            self.core.cache,
            local_pages,
            chunk_size=self.settings.prefill_chunk_tokens,
            on_layer_done=on_layer_done,
            start_pos=held * block_size,
        )
        session.finish(result.first_token, len(prompt))
        compute_s = time.perf_counter() - t0
        if session.cancelled:
            raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled", request_id)
        with self._lock:
            if self.sessions.get(request_id) is session:
                # Computed: the full prompt pages are final; referenced until the push's
                # writes that read them completed (_release).
                self.allocator.publish(request_id, hashes)
        self.metrics.compute.observe(compute_s)
        if hashes:
            self.metrics.prefix.observe(len(prompt), held * block_size)
        if self.metrics.prefix.pages_skipped is not None:
            self.metrics.prefix.pages_skipped.inc(session.first_page)
        # The push is one write per (layer, chunk): per-layer compute is the compute time
        # spread over those steps.
        chunk_tokens = self.settings.prefill_chunk_tokens
        chunks = math.ceil(len(prompt) / chunk_tokens) - (held * block_size) // chunk_tokens
        steps = self.core.config.num_layers * chunks
        return {
            "request_id": request_id,
            "first_token": result.first_token,
            "prefill_ms": compute_s * 1e3,
            "chunks": chunks,
            "layer_compute_ms_mean": compute_s * 1e3 / steps,
            # Prompt tokens this worker had cached (not computed), blocks the decoder held
            # (not pushed) and blocks pushed (each block is one page per layer).
            "prefix_hit_tokens": held * block_size,
            "computed_tokens": len(prompt) - held * block_size,
            "pages_skipped": session.first_page,
            "pages_pushed": len(local_pages) - session.first_page,
        }

    def _push_result(self, result: dict[str, Any], stats: Any) -> dict[str, Any]:
        """The /prefill answer: the compute's figures and the completed push's."""
        self.metrics.observe_transfer(stats.kv_bytes, max(stats.transfer_s, 1e-9), stats.wire_s)
        self.metrics.peers_connected.set(len(self._peers))
        return {
            **result,
            "transfer_tail_ms": stats.tail_s * 1e3,
            "transfer_ms": stats.transfer_s * 1e3,
            "kv_bytes": stats.kv_bytes,
            "writes": stats.writes,
            "layer_transfer_ms_mean": stats.layer_transfer_s_mean * 1e3,
            "layer_transfer_ms_max": stats.layer_transfer_s_max * 1e3,
            "layer_submit_ms_mean": sum(stats.layer_push_s) * 1e3 / max(1, len(stats.layer_push_s)),
            "mailbox_write_ms": stats.mailbox_write_s * 1e3,
            "transfer_tail_engine_ms": stats.engine_tail_s * 1e3,
        }

    async def cancel(self, request_id: str, caller: str = "anonymous") -> dict[str, Any]:
        """Stops a request's writes; returns once none of them is in flight. Another
        caller's request is unknown to this one."""
        with self._lock:
            if request_id in self._owners and self._owners[request_id] != caller:
                raise RequestRejected(Rejection.UNKNOWN_REQUEST, f"unknown request id {request_id}", request_id)
            self._forget_cancelled()
            # Remembered even when unknown: its /prefill may still be on its way.
            self._cancelled[request_id] = time.monotonic() + self.settings.cancel_memory_s
            session = self.sessions.get(request_id)
        if session is None:
            return {"request_id": request_id, "in_flight": False, "known": False}
        session.cancel()
        deadline = time.monotonic() + self.core.engine.transfer_timeout_s + 1.0
        while session.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return {"request_id": request_id, "in_flight": session.in_flight(), "known": True}

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self._queued)
        counters = self.allocator.prefix_counters()
        if counters is not None:
            self.metrics.prefix.update(counters.held_pages, counters.evictions)
        self.core.update_load(**self.load())
