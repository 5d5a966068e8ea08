"""The prefill worker: computes a prompt layer by layer and pushes each layer's KV pages
into a decode worker's reserved pages as soon as they are final.

Compute runs on one thread (the model is CPU-bound and each request uses every core);
HTTP handlers queue requests for it. A cancel stops a request's further writes and
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
from fastapi import FastAPI, HTTPException, Request
from pydantic import Field

from kvxfer.errors import EngineError, TransferError
from kvxfer.kv_push import MAILBOX_SLOT_BYTES, KVReservation, PushSession
from kvxfer.metrics import PrefillMetrics
from kvxfer.page_allocator import OutOfPagesError, PageAllocator
from kvxfer.worker_runtime import WorkerCore, WorkerSettings, add_common_routes, serve

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
            raise HTTPException(503, "worker is draining")
        if not prompt:
            raise HTTPException(400, "prompt is empty")
        if len(prompt) > cfg.max_context:
            raise HTTPException(400, f"prompt of {len(prompt)} tokens exceeds the context of {cfg.max_context}")
        if reservation.kv_layout != self.core.kv_layout:
            raise HTTPException(
                409, f"KV layout mismatch: decoder {reservation.kv_layout}, prefiller {self.core.kv_layout}"
            )
        if self._queued >= self.settings.max_queue:
            raise HTTPException(429, "prefill queue is full")
        with self._lock:
            if request_id in self.sessions:
                raise HTTPException(409, f"request {request_id} is already being prefilled")
            try:
                local_pages = self.allocator.reserve(request_id, len(prompt))
            except OutOfPagesError as exc:
                raise HTTPException(429, str(exc)) from None
            slot = self._slot
            self._slot = (self._slot + 1) % self.settings.mailbox_slots
            try:
                session = PushSession(
                    self.core.engine, self.core.cache, self.core.cache_region, self.mailbox,
                    self.mailbox_region, slot, reservation, local_pages,
                )
            except TransferError as exc:
                self.allocator.free(request_id)
                raise HTTPException(409, str(exc)) from None
            self.sessions[request_id] = session
            self._queued += 1
        self._update_gauges()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._compute, self._run, request_id, prompt, session, local_pages)
        except (TransferError, EngineError) as exc:
            self.metrics.transfer_failures.labels(reason=type(exc).__name__).inc()
            raise HTTPException(502, f"request {request_id}: KV push failed: {exc}") from None
        finally:
            with self._lock:
                self.sessions.pop(request_id, None)
                self._queued -= 1
                # Every write completed or failed by its deadline: the local pages are free.
                self.allocator.free(request_id)
            self._update_gauges()

    def _run(self, request_id: str, prompt: list[int], session: PushSession, local_pages: list[int]) -> dict[str, Any]:
        if session.cancelled:
            raise HTTPException(409, f"request {request_id} was cancelled before compute")
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
            raise HTTPException(409, f"request {request_id} was cancelled")
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


def create_prefill_app(runtime: PrefillRuntime) -> FastAPI:
    """The prefill worker's HTTP API (docs/architecture.md)."""
    app = FastAPI(title="kvxfer prefill worker")
    add_common_routes(app, runtime.core, lambda: {**runtime.core.base_info(), **runtime.load()})

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise HTTPException(400, "malformed JSON body") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "JSON body must be an object")
        return body

    @app.post("/prefill")
    async def prefill(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        request_id = body.get("request_id")
        prompt = body.get("prompt_tokens")
        decode = body.get("decode")
        if not isinstance(request_id, str) or not isinstance(prompt, list) or not isinstance(decode, dict):
            raise HTTPException(422, "need request_id (str), prompt_tokens (list) and decode (object)")
        vocab = runtime.core.config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise HTTPException(422, f"prompt_tokens must be integers in [0, {vocab})")
        try:
            reservation = KVReservation.from_json({"request_id": request_id, **decode})
            kv_region = runtime.core.engine._remote(reservation.descriptor)
            meta_region = runtime.core.engine._remote(reservation.meta_descriptor)
        except (KeyError, ValueError, TypeError) as exc:
            raise HTTPException(422, f"malformed decode reservation: {exc}") from None
        # Out-of-range pages, offsets or immediates are the caller's error (422), found
        # before any compute, not a failed push (502) half-way through the writes.
        layer_bytes = reservation.num_pages * runtime.core.cache.page_bytes
        if (
            reservation.num_pages <= 0
            or runtime.core.config.num_layers * layer_bytes > kv_region.length
            or not all(0 <= p < reservation.num_pages for p in reservation.pages)
            or not 0 <= reservation.meta_offset <= meta_region.length - MAILBOX_SLOT_BYTES
            or not 0 <= reservation.imm < 2**32
        ):
            raise HTTPException(422, "malformed decode reservation: pages, meta_offset or imm outside the decoder's regions")
        return await runtime.prefill(request_id, prompt, reservation)

    @app.post("/cancel")
    async def cancel(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        request_id = body.get("request_id")
        if not isinstance(request_id, str):
            raise HTTPException(422, "need request_id (str)")
        return await runtime.cancel(request_id)

    return app


def run_prefill_worker(settings: PrefillSettings) -> None:
    """Starts a prefill worker process: engine, model, HTTP API, etcd registration."""
    runtime = PrefillRuntime(settings)
    serve(create_prefill_app(runtime), runtime.core, runtime.load, runtime.in_flight)
