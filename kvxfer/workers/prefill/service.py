"""The prefill worker: computes a prompt layer by layer and pushes each layer's KV pages
into a decode worker's reserved pages as soon as they are final.

Compute runs on one thread (the model is CPU-bound and each request uses every core);
callers (the HTTP handlers of `http.py`) queue requests for it. A cancel stops a request's further writes and
answers only once none of its writes is still in flight.
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

from kvxfer.errors import EngineError, TransferError, TransferTimeout
from kvxfer.kv.page_allocator import OutOfPagesError, PageAllocator
from kvxfer.kv.protocol import MAILBOX_SLOT_BYTES, KVReservation
from kvxfer.kv.push import PushSession
from kvxfer.metrics import PrefillMetrics
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.runtime import WorkerCore, WorkerSettings

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


def transfer_failure_reason(exc: Exception, cancelled: bool) -> str:
    """The `reason` label (metrics.TRANSFER_FAILURE_REASONS) of a failed push.

    The engine types its deadline (`TransferTimeout`); the rest it reports as text, so a
    failure to reach the peer is told from a fabric error completion by what it names.
    """
    if cancelled:
        return "cancelled"
    if isinstance(exc, TransferTimeout):
        return "timeout"
    text = str(exc).lower()
    if any(word in text for word in ("address", "unreachable", "resolve", "connect", "refused")):
        return "peer_unreachable"
    return "completion_error"


class PrefillRuntime:
    """State and logic of a prefill worker, independent of HTTP."""

    def __init__(self, settings: PrefillSettings) -> None:
        self.settings = settings
        self.core = WorkerCore(settings, "prefill")
        self.allocator = PageAllocator(settings.num_pages, self.core.config.block_size)
        self.mailbox = np.zeros(settings.mailbox_slots * MAILBOX_SLOT_BYTES, dtype=np.uint8)
        self.mailbox_region = self.core.engine.register(self.mailbox)
        self.metrics = PrefillMetrics(self.core.metrics_registry)
        # One compute thread: requests queue here; queue depth is what routers balance on.
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self.sessions: dict[str, PushSession] = {}
        self._queued = 0
        self._slot = 0
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()

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
        """Requests queued, computing or pushing."""
        return self._queued

    async def prefill(self, request_id: str, prompt: list[int], reservation: KVReservation) -> dict[str, Any]:
        """Computes the prompt, pushes its KV, waits until every write completed."""
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
            raise RequestRejected(Rejection.OVERLOADED, "prefill queue is full", request_id)
        with self._lock:
            if request_id in self.sessions:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} is already being prefilled", request_id)
            try:
                local_pages = self.allocator.reserve(request_id, len(prompt))
            except OutOfPagesError as exc:
                raise RequestRejected(Rejection.OVERLOADED, str(exc), request_id) from None
            slot = self._slot
            self._slot = (self._slot + 1) % self.settings.mailbox_slots
            try:
                session = PushSession(
                    self.core.engine, self.core.cache, self.core.cache_region, self.mailbox,
                    self.mailbox_region, slot, reservation, local_pages,
                )
            except TransferError as exc:
                self.allocator.free(request_id)
                raise RequestRejected(Rejection.CONFLICT, str(exc), request_id) from None
            self.sessions[request_id] = session
            self._queued += 1
        self._update_gauges()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._compute, self._run, request_id, prompt, session, local_pages)
        except (TransferError, EngineError) as exc:
            self.metrics.count_transfer_failure(transfer_failure_reason(exc, session.cancelled))
            raise RequestRejected(Rejection.PUSH_FAILED, f"request {request_id}: KV push failed: {exc}", request_id) from None
        finally:
            with self._lock:
                self.sessions.pop(request_id, None)
                self._queued -= 1
                # Every write completed or failed by its deadline: the local pages are free.
                self.allocator.free(request_id)
            self._update_gauges()

    def accept_reservation(self, request_id: str, decode: dict[str, Any]) -> KVReservation:
        """Parses a decoder's reservation and checks it against the decoder's regions.

        Out-of-range pages, offsets or immediates are the caller's error, found before any
        compute, not a failed push half-way through the writes.
        """
        try:
            reservation = KVReservation.from_json({"request_id": request_id, **decode})
            kv_region = self.core.engine._remote(reservation.descriptor)
            meta_region = self.core.engine._remote(reservation.meta_descriptor)
        except (KeyError, ValueError, TypeError) as exc:
            raise RequestRejected(Rejection.INVALID, f"malformed decode reservation: {exc}", request_id) from None
        layer_bytes = reservation.num_pages * self.core.cache.page_bytes
        if (
            reservation.num_pages <= 0
            or self.core.config.num_layers * layer_bytes > kv_region.length
            or not all(0 <= p < reservation.num_pages for p in reservation.pages)
            or not 0 <= reservation.meta_offset <= meta_region.length - MAILBOX_SLOT_BYTES
            or not 0 <= reservation.imm < 2**32
        ):
            raise RequestRejected(
                Rejection.INVALID,
                "malformed decode reservation: pages, meta_offset or imm outside the decoder's regions",
                request_id,
            )
        return reservation

    def _run(self, request_id: str, prompt: list[int], session: PushSession, local_pages: list[int]) -> dict[str, Any]:
        if session.cancelled:
            raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled before compute", request_id)
        t0 = time.perf_counter()
        peer = session.reservation.descriptor
        self._peers.add(peer[:64])
        extra_s = self.settings.emulated_layer_compute_ms / 1e3

        def on_layer_done(layer: int, chunk: Any) -> None:
            if extra_s:
                time.sleep(extra_s)  # the layer "computes" longer, then its pages go out
            session.on_layer_done(layer, chunk.first_block, chunk.end_block)

        result = self.core.model.prefill(
            prompt,
            self.core.cache,
            local_pages,
            chunk_size=self.settings.prefill_chunk_tokens,
            on_layer_done=on_layer_done,
        )
        session.finish(result.first_token, len(prompt))
        compute_s = time.perf_counter() - t0
        stats = session.wait(self.core.engine.transfer_timeout_s)
        if session.cancelled:
            raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled", request_id)
        self.metrics.compute.observe(compute_s)
        self.metrics.observe_transfer(stats.kv_bytes, max(stats.transfer_s, 1e-9), stats.wire_s)
        self.metrics.peers_connected.set(len(self._peers))
        # The push is one write per (layer, chunk): per-layer compute is the compute time
        # spread over those steps, per-layer transfer the engine's duration of those writes.
        chunks = math.ceil(len(prompt) / self.settings.prefill_chunk_tokens)
        steps = self.core.config.num_layers * chunks
        return {
            "request_id": request_id,
            "first_token": result.first_token,
            "prefill_ms": compute_s * 1e3,
            "transfer_tail_ms": stats.tail_s * 1e3,
            "transfer_ms": stats.transfer_s * 1e3,
            "kv_bytes": stats.kv_bytes,
            "writes": stats.writes,
            "chunks": chunks,
            "layer_compute_ms_mean": compute_s * 1e3 / steps,
            "layer_transfer_ms_mean": stats.layer_transfer_s_mean * 1e3,
            "layer_transfer_ms_max": stats.layer_transfer_s_max * 1e3,
            "layer_submit_ms_mean": sum(stats.layer_push_s) * 1e3 / max(1, len(stats.layer_push_s)),
            "mailbox_write_ms": stats.mailbox_write_s * 1e3,
            "transfer_tail_engine_ms": stats.engine_tail_s * 1e3,
        }

    async def cancel(self, request_id: str) -> dict[str, Any]:
        """Stops a request's writes; returns once none of them is in flight."""
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
        self.core.update_load(**self.load())
