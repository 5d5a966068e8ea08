"""The decode worker: reserves KV pages, admits a request when its ImmCounter says every
pushed write landed, and decodes with continuous batching.

Request states: RESERVED (pages held, KV not yet complete) -> RUNNING (in the decode batch)
-> DONE; or FAILED/CANCELLED. A request that ends while a prefiller may still write into
its pages (timeout, cancel) puts them in quarantine: they return to the pool only after
`quarantine_s`, longer than any prefiller engine's transfer deadline, so no late write can
land in a page that a new request already uses.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, AsyncIterator

import numpy as np

from kvxfer.errors import TransferTimeout
from kvxfer.kv.page_allocator import OutOfPagesError, PageAllocator
from kvxfer.kv.protocol import (
    MAILBOX_SLOT_BYTES,
    KVReservation,
    decode_mailbox,
    expected_imm_count,
)
from kvxfer.metrics import DecodeMetrics
from kvxfer.model.tokenizer import ByteTokenizer
from kvxfer.model.transformer import DecodeRequest, FinishReason, finish_reason_after
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.runtime import WorkerCore, WorkerSettings

log = logging.getLogger("kvxfer.decode")


class DecodeSettings(WorkerSettings):
    """Decode worker settings (env prefix KVXFER_)."""

    port: int = 8200
    max_requests: int = 1024
    max_batch: int = 64
    kv_wait_timeout_s: float = 30.0
    quarantine_s: float = 15.0
    reservation_ttl_s: float = 120.0


class RequestState(str, Enum):
    """Where a decode request is in its life."""

    RESERVED = "reserved"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class DecodeJob:
    """One request on this decode worker."""

    request_id: str
    pages: list[int]
    slot: int
    imm: int
    nonce: int
    prompt_tokens: int
    max_tokens: int
    expected_count: int
    created_at: float
    state: RequestState = RequestState.RESERVED
    kept: list[int] = field(default_factory=list)
    last_token: int = 0
    position: int = 0
    finish_reason: str | None = None
    error: str | None = None
    queue: "asyncio.Queue[tuple[str, Any]] | None" = None
    loop: asyncio.AbstractEventLoop | None = None
    admitted_at: float = 0.0


class DecodeRuntime:
    """State and logic of a decode worker, independent of HTTP (tests drive it directly)."""

    def __init__(self, settings: DecodeSettings) -> None:
        self.settings = settings
        self.core = WorkerCore(settings, "decode")
        self.tokenizer = ByteTokenizer()
        self.allocator = PageAllocator(settings.num_pages, self.core.config.block_size)
        self.mailbox = np.zeros(settings.max_requests * MAILBOX_SLOT_BYTES, dtype=np.uint8)
        self.mailbox_region = self.core.engine.register(self.mailbox)
        self.metrics = DecodeMetrics(self.core.metrics_registry)
        self.jobs: dict[str, DecodeJob] = {}
        self._free_slots = list(range(settings.max_requests - 1, -1, -1))
        self._lock = threading.Lock()  # jobs and slots: control path only
        self._admitted: list[DecodeJob] = []
        self._deferred_release: list[DecodeJob] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._batch_thread = threading.Thread(target=self._batch_loop, name="decode-batch", daemon=True)
        self._batch_thread.start()
        self._update_gauges()

    # -- reservation ------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int) -> KVReservation:
        """Reserves pages for prompt + max_tokens and a mailbox slot/immediate."""
        cfg = self.core.config
        if self.core.draining:
            raise RequestRejected(Rejection.DRAINING, "worker is draining", request_id)
        if prompt_tokens <= 0:
            raise RequestRejected(Rejection.BAD_REQUEST, "prompt is empty", request_id)
        if max_tokens <= 0:
            raise RequestRejected(Rejection.BAD_REQUEST, f"max_tokens must be positive, got {max_tokens}", request_id)
        if prompt_tokens + max_tokens > cfg.max_context:
            raise RequestRejected(
                Rejection.BAD_REQUEST,
                f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {cfg.max_context} tokens",
                request_id,
            )
        with self._lock:
            if request_id in self.jobs:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} already exists", request_id)
            if not self._free_slots:
                raise RequestRejected(Rejection.OVERLOADED, "too many requests on this decode worker", request_id)
            try:
                pages = self.allocator.reserve(request_id, prompt_tokens + max_tokens)
            except OutOfPagesError as exc:
                raise RequestRejected(Rejection.OVERLOADED, str(exc), request_id) from None
            slot = self._free_slots.pop()
            job = DecodeJob(
                request_id=request_id,
                pages=pages,
                slot=slot,
                imm=slot + 1,  # imm 0 stays unused so a zeroed CQ word is never a request
                nonce=secrets.randbits(63),
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                expected_count=expected_imm_count(cfg.num_layers, prompt_tokens, cfg.block_size),
                created_at=time.monotonic(),
            )
            self.jobs[request_id] = job
        self._update_gauges()
        return KVReservation(
            request_id=request_id,
            descriptor=self.core.cache_region.descriptor,
            pages=pages,
            num_pages=self.core.cache.num_pages,
            imm=job.imm,
            expected_count=job.expected_count,
            kv_layout=self.core.kv_layout,
            meta_descriptor=self.mailbox_region.descriptor,
            meta_offset=slot * MAILBOX_SLOT_BYTES,
            nonce=job.nonce,
        )

    def job(self, request_id: str) -> DecodeJob:
        """The job of a request id; `Rejection.UNKNOWN_REQUEST` if there is none."""
        job = self.jobs.get(request_id)
        if job is None:
            raise RequestRejected(Rejection.UNKNOWN_REQUEST, f"unknown request id {request_id}", request_id)
        return job

    # -- admission --------------------------------------------------------------------
    async def wait_for_kv(self, job: DecodeJob, timeout_s: float) -> None:
        """Waits on the ImmCounter, reads the mailbox and joins the running batch."""
        start = time.perf_counter()
        try:
            await self.core.engine.wait_imm_async(job.imm, job.expected_count, timeout_s)
        except TransferTimeout:
            self.metrics.admission_timeouts.inc()
            got = self.core.engine.imm_count(job.imm)
            reason = f"KV incomplete after {timeout_s} s ({got} of {job.expected_count} writes landed)"
            self.end(job, RequestState.FAILED, quarantine=True, error=f"request {job.request_id}: {reason}")
            # The engine's own exception names only the immediate: the 504 must name the request.
            raise TransferTimeout(job.request_id, reason) from None
        self.metrics.imm_wait.observe(time.perf_counter() - start)
        if job.state is not RequestState.RESERVED:
            raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} was {job.state.value}", job.request_id)
        offset = job.slot * MAILBOX_SLOT_BYTES
        nonce, first_token, prompt_tokens = decode_mailbox(bytes(self.mailbox[offset : offset + MAILBOX_SLOT_BYTES]))
        if nonce != job.nonce or prompt_tokens != job.prompt_tokens:
            self.end(job, RequestState.FAILED, quarantine=True, error="mailbox record does not match the reservation")
            raise RequestRejected(Rejection.FAILED, f"request {job.request_id}: mailbox record does not match", job.request_id)
        self._admit(job, first_token)

    def _admit(self, job: DecodeJob, first_token: int) -> None:
        job.loop = asyncio.get_running_loop()
        job.queue = asyncio.Queue()
        job.admitted_at = time.monotonic()
        job.position = job.prompt_tokens
        job.last_token = first_token
        # The first token came from the prefiller: apply the stopping rule to it first.
        reason = finish_reason_after(first_token, 0, job.max_tokens)
        if reason is not FinishReason.STOP:
            job.kept.append(first_token)
            job.queue.put_nowait(("token", first_token))
        if reason is not None:
            self.end(job, RequestState.DONE, finish_reason=reason.value)
            return
        with self._lock:
            job.state = RequestState.RUNNING
            self._admitted.append(job)
        self._wake.set()
        self._update_gauges()

    async def prefill_locally(self, job: DecodeJob, prompt: list[int]) -> None:
        """Colocated path: prefill on this worker into the reserved pages, then decode."""
        cfg = self.core.config
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            None,
            lambda: self.core.model.prefill(
                prompt, self.core.cache, job.pages, chunk_size=self.settings.prefill_chunk_tokens
            ),
        )
        del cfg
        self._admit(job, result.first_token)

    # -- batch loop -------------------------------------------------------------------
    def _batch_loop(self) -> None:
        running: list[DecodeJob] = []
        while not self._stop.is_set():
            with self._lock:
                room = self.settings.max_batch - len(running)
                if room > 0 and self._admitted:
                    running.extend(self._admitted[:room])
                    del self._admitted[:room]
            running = [j for j in running if j.state is RequestState.RUNNING]
            with self._lock:
                deferred, self._deferred_release = self._deferred_release, []
            for j in deferred:
                self._release(j)
            if deferred:
                self._update_gauges()
            if not running:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            batch = [DecodeRequest(j.last_token, j.position, j.pages) for j in running]
            try:
                tokens = self.core.model.decode_step(batch, self.core.cache)
            except Exception as exc:  # a model error fails the batch's requests, not the worker
                log.exception("decode step failed")
                for j in running:
                    self._finish_from_thread(j, RequestState.FAILED, error=f"decode step failed: {exc}")
                running = []
                continue
            for j, token in zip(running, tokens):
                if j.state is not RequestState.RUNNING:
                    continue
                j.position += 1
                j.last_token = token
                reason = finish_reason_after(token, len(j.kept), j.max_tokens)
                if reason is not FinishReason.STOP:
                    j.kept.append(token)
                    self._emit(j, ("token", token))
                if reason is not None:
                    self._finish_from_thread(j, RequestState.DONE, finish_reason=reason.value)

    def _emit(self, job: DecodeJob, item: tuple[str, Any]) -> None:
        if job.loop is not None and job.queue is not None:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, item)

    def _finish_from_thread(self, job: DecodeJob, state: RequestState, **kw: Any) -> None:
        self.end(job, state, **kw)

    # -- ending -----------------------------------------------------------------------
    def end(
        self,
        job: DecodeJob,
        state: RequestState,
        *,
        quarantine: bool = False,
        finish_reason: str | None = None,
        error: str | None = None,
    ) -> None:
        """Ends a job once; frees or quarantines its pages and mailbox slot."""
        with self._lock:
            if job.state in (RequestState.DONE, RequestState.FAILED, RequestState.CANCELLED):
                return
            in_batch = job.state is RequestState.RUNNING and job not in self._admitted
            job.state = state
            job.finish_reason = finish_reason
            job.error = error
            if job in self._admitted:
                self._admitted.remove(job)
            # The batch thread may be writing this job's K/V right now: it frees the pages
            # itself after its current step.
            defer = in_batch and threading.current_thread() is not self._batch_thread
            if defer:
                self._deferred_release.append(job)
        if defer:
            pass
        elif quarantine:
            self.allocator.release_after_quiesce(job.request_id)
            threading.Timer(self.settings.quarantine_s, self._release_quarantine, args=(job,)).start()
        else:
            self._release(job)
        self._emit(job, ("end", state))
        self._update_gauges()

    def _release_quarantine(self, job: DecodeJob) -> None:
        # No prefiller write can still be in flight: its engine deadline has passed.
        self.allocator.confirm_quiesced(job.request_id)
        self._release(job, quarantined=True)
        self._update_gauges()

    def _release(self, job: DecodeJob, quarantined: bool = False) -> None:
        if not quarantined:
            self.allocator.free(job.request_id)
        # Whatever this slot's immediate counted (all of its KV, or part of it from a push
        # that was cut off) is forgotten: no write for this job can arrive any more, and the
        # next request on the slot must start from zero.
        self.core.engine.reset_imm(job.imm)
        with self._lock:
            self.jobs.pop(job.request_id, None)
            self._free_slots.append(job.slot)

    def cancel(self, request_id: str) -> dict[str, Any]:
        """Cancels a request; its pages wait in quarantine unless it never got KV writes."""
        job = self.job(request_id)
        was_reserved = job.state is RequestState.RESERVED
        self.end(job, RequestState.CANCELLED, quarantine=was_reserved)
        return {"request_id": request_id, "state": job.state.value, "quarantined": was_reserved}

    # -- load -------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        """Load fields published in etcd and /info."""
        with self._lock:
            running = sum(1 for j in self.jobs.values() if j.state is RequestState.RUNNING)
            waiting = sum(1 for j in self.jobs.values() if j.state is RequestState.RESERVED)
        return {
            "total_pages": self.allocator.total_pages,
            "free_pages": self.allocator.free_pages,
            "running": running,
            "queue_depth": waiting,
        }

    def in_flight(self) -> int:
        """Requests not yet finished."""
        with self._lock:
            return len(self.jobs) - sum(1 for j in self.jobs.values() if j.state is RequestState.CANCELLED)

    def _update_gauges(self) -> None:
        load = self.load()
        self.metrics.set_pages(self.allocator.total_pages, self.allocator.free_pages)
        self.metrics.pages_reserved.set(self.allocator.reserved_pages)
        self.metrics.requests_running.set(load["running"])
        self.metrics.requests_waiting_for_kv.set(load["queue_depth"])
        self.core.update_load(**load)

    def stop_batch_loop(self) -> None:
        """Asks the batch loop to end after its current step."""
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Stops the batch loop and the engine."""
        self.stop_batch_loop()
        self._batch_thread.join(timeout=5)
        self.core.close()


async def token_events(job: DecodeJob) -> AsyncIterator[dict[str, Any]]:
    """An admitted job's tokens as they come, then one `done` event with the usage."""
    assert job.queue is not None
    # Byte tokens of one UTF-8 character arrive one by one: decode incrementally so a
    # multi-byte character is emitted whole with its last byte, not as U+FFFD per byte.
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        kind, value = await job.queue.get()
        if kind == "token":
            piece = text.decode(bytes([value])) if 0 <= value < 256 else ""
            yield {"token": value, "text": piece}
        else:
            break
    # Bytes of an unfinished character at the very end become U+FFFD, as in
    # ByteTokenizer.decode (the non-streaming answer): the done line carries that rest, so
    # the text lines plus the done line's text always equal decode(tokens).
    rest = text.decode(b"", final=True)
    usage = {"prompt_tokens": job.prompt_tokens, "completion_tokens": len(job.kept)}
    if job.state is RequestState.DONE:
        yield {"done": True, "finish_reason": job.finish_reason, "text": rest, "usage": usage}
    else:
        yield {"done": True, "finish_reason": "error", "error": job.error or job.state.value, "usage": usage}
