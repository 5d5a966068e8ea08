"""The decode worker's requests by id, their hand-over to the batch loop, and the one way
a request ends.

Who owns what (one lock, `JobTable.lock`, held for bookkeeping only: no model step, no
wait for KV, no new registration under it):
- `jobs`, the memory of early cancels, and the two hand-over lists (`_admitted`: jobs
  admitted but not yet taken by the batch loop; `_deferred_release`: jobs that ended while
  the batch thread may be writing their K/V) are guarded by the lock, whatever the thread.
- A job's ledger entry moves under the lock too, whenever the move depends on the job
  (the reaper's RECEIVING, admission, an end), so a check and its move see one state. A
  move out of waiting revokes the reservation's registration (the ledger's `close_writes`)
  there and then, before its pages can be reused, unless the prefiller may still be
  writing (`end` without `writer_stopped`): then it stays open, the pages fenced, until
  the prefiller's word (`writer_stopped`, which revokes just before FREE) or
  `cancel_confirm_timeout_s` (`confirm_bound_passed`, the reaper): revoking under one of
  its writes still queued would make the net provider drop the whole connection to that
  prefiller, failing other requests' writes queued behind it. The revoke is the one
  engine call under the lock, with the counter resets the ledger asks for (`forget_imm`)
  and the stray-immediate check of a new reservation.
- The batch thread owns the running batch: once it took a job, only it frees its pages
  (`release_after_step`), after the step that may be writing them.
- The reaper thread owns the waiting (reaper.py); the event loop and its executor own a
  job until it is handed over (/reserve, admission, local prefill).
- The fabric's hot path (writes landing, ImmCounter increments) takes no lock of ours.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from kvxfer.handoff.decode_ledger import DeadlineSetting, ReservationLedger
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.page_allocator import PageAllocator
from kvxfer.kv.prefix_hash import block_hashes
from kvxfer.model.transformer import FinishReason, finish_reason_after
from kvxfer.workers.decode.job import DecodeJob, DecodePhase
from kvxfer.workers.rejection import Rejection, RequestRejected

log = logging.getLogger("kvxfer.decode")


class JobTable:
    """Requests by id, the admitted ones waiting for the batch loop, and `end`: the one
    place a request ends, moving its reservation on (FREE, or FENCED while a write may land)."""

    def __init__(
        self,
        ledger: ReservationLedger,
        allocator: PageAllocator,
        *,
        model_name: str,
        max_requests: int,
        reservation_ttl_s: float,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.ledger = ledger
        self.allocator = allocator
        self._model_name = model_name
        self._max_requests = max_requests
        self._reservation_ttl_s = reservation_ttl_s
        #: Called after a change the load gauges show (outside the lock).
        self.on_change = on_change
        self.lock = threading.Lock()
        self.jobs: dict[str, DecodeJob] = {}
        # (caller, request id) -> monotonic expiry of a cancel that found no reservation:
        # the router cancels a /reserve it gave up waiting for, and that reservation may
        # still complete afterwards (it was queued behind others); it is then refused.
        self.cancelled_unreserved: dict[tuple[str, str], float] = {}
        self._admitted: list[DecodeJob] = []
        self._deferred_release: list[DecodeJob] = []
        #: Set when a job is handed to the batch loop (or the loop should stop).
        self.wake = threading.Event()
        #: The batch loop's thread (set by it): a job it runs is freed by it alone.
        self.batch_thread: threading.Thread | None = None

    # -- lookups -------------------------------------------------------------------------
    def job(self, request_id: str, caller: str = "anonymous") -> DecodeJob:
        """The job of a request id reserved by `caller`; `Rejection.UNKNOWN_REQUEST` if there is
        none (another caller's id is unknown to this one: no oracle for what others hold)."""
        job = self.jobs.get(request_id)
        if job is None or job.owner != caller:
            raise RequestRejected(Rejection.UNKNOWN_REQUEST, f"unknown request id {request_id}", request_id)
        return job

    def running_count(self) -> int:
        """Jobs in (or handed to) the decode batch."""
        with self.lock:
            return sum(1 for j in self.jobs.values() if j.phase is DecodePhase.RUNNING)

    # -- the hand-over to the batch loop -------------------------------------------------
    def start_decoding(self, job: DecodeJob, first_token: int) -> None:
        """Starts decoding an admitted job from its first token (in the event loop of the
        /generate that reads it): hands it to the batch loop, or ends it at once when the
        first token already finishes it."""
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
            self.end(job, DecodePhase.DONE, finish_reason=reason.value)
            return
        with self.lock:
            job.phase = DecodePhase.RUNNING
            self._admitted.append(job)
        self.wake.set()
        self.on_change()

    def take_for_batch(self, room: int) -> list[DecodeJob]:
        """Up to `room` handed-over jobs, oldest first (the batch thread)."""
        if room <= 0:
            return []
        with self.lock:
            taken = self._admitted[:room]
            del self._admitted[:room]
        return taken

    def take_deferred_releases(self) -> list[DecodeJob]:
        """Jobs that ended while in the batch (the batch thread frees them after its step)."""
        with self.lock:
            deferred, self._deferred_release = self._deferred_release, []
        return deferred

    def release_after_step(self, job: DecodeJob) -> None:
        """Frees an ended job's pages once no step writes them (the batch thread)."""
        with self.lock:
            self.ledger.end(job.request_id, Res.FAILED, writer_stopped=True)
            self.jobs.pop(job.request_id, None)

    # -- ending ----------------------------------------------------------------------------
    def end(
        self,
        job: DecodeJob,
        phase: DecodePhase,
        *,
        writer_stopped: bool = False,
        finish_reason: str | None = None,
        error: str | None = None,
        reason: Rejection = Rejection.FAILED,
    ) -> None:
        """Ends a job once and moves its reservation on: FREE when no write can land (KV
        all arrived, or `writer_stopped`: the prefiller said so), else FENCED with its
        registration kept open for the prefiller's word (the module; the ledger's
        `keep_writes_open`).

        A /generate still waiting for the KV is woken and fails with `reason`.
        """
        with self.lock:
            if job.phase.ended:
                return
            in_batch = job.phase is DecodePhase.RUNNING and job not in self._admitted
            job.phase = phase
            job.finish_reason = finish_reason
            job.error = error
            job.end_reason = reason
            if job in self._admitted:
                self._admitted.remove(job)
            # The batch thread may be writing this job's K/V right now: it frees the pages
            # itself after its current step.
            if in_batch and threading.current_thread() is not self.batch_thread:
                self._deferred_release.append(job)
            else:
                if phase is DecodePhase.DONE:
                    self._cache_generated(job)
                outcome = Res.CANCELLED if phase is DecodePhase.CANCELLED else Res.FAILED
                entry = self.ledger.end(job.request_id, outcome, writer_stopped=writer_stopped, reason=error or "",
                                        keep_writes_open=not writer_stopped)
                if entry.state is Res.FREE:
                    self.jobs.pop(job.request_id, None)
            signal = job.end_signal
        if signal is not None and job.loop is not None:
            job.loop.call_soon_threadsafe(lambda: signal.done() or signal.set_result(None))
        job.emit(("end", phase))
        self.on_change()

    def _cache_generated(self, job: DecodeJob) -> None:
        """Hands the full pages of a finished request's prompt and generated tokens to the
        prefix cache (held under the lock): a next chat turn repeats them. Only positions
        whose K/V a step wrote count: the last token was emitted, never fed back."""
        if job.prompt is None or job.reservation_state is not Res.ADMITTED:
            return
        fed = job.kept[: max(0, job.position - job.prompt_tokens)]
        if (job.prompt_tokens + len(fed)) // job.block_size > len(job.prefix_hashes):
            written = list(job.prompt) + fed
            self.allocator.publish(job.request_id, block_hashes(written, job.block_size, self._model_name))

    def writer_stopped(self, request_id: str) -> bool:
        """The prefiller confirmed none of the request's writes can land: a fenced
        reservation's pages go back at once. True if this freed it."""
        with self.lock:
            entry = self.ledger.writer_stopped(request_id)
            if entry is not None:
                self.jobs.pop(request_id, None)
        if entry is not None:
            self.on_change()
        return entry is not None

    def confirm_bound_passed(self, request_id: str) -> bool:
        """`cancel_confirm_timeout_s` passed for a fenced reservation whose registration was
        kept open, without the prefiller's word (the reaper): revoked now; its pages stay
        fenced to `fence_timeout_s`. True if something was open."""
        entry = self.ledger.revoke_writes(request_id)
        if entry is not None:
            log.info("request %s: the prefiller did not confirm within cancel_confirm_timeout_s=%s s that none of "
                     "its writes is in flight: registration revoked, pages fenced to fence_timeout_s",
                     request_id, self.ledger.cancel_confirm_timeout_s)
        return entry is not None

    def fence_expired(self, request_id: str) -> None:
        """`fence_timeout_s` passed for a fenced reservation: its pages go back (the reaper)."""
        with self.lock:
            entry = self.ledger.get(request_id)
            if entry is not None and entry.state is Res.FENCED \
                    and entry.deadline_setting is not DeadlineSetting.CANCEL_CONFIRM:
                # fence_timeout_s exceeds every prefiller's transfer deadline: no write of
                # this reservation can still land.
                self.ledger.move(request_id, Res.FREE, "fence_timeout_s passed")
                self.jobs.pop(request_id, None)
        self.on_change()

    def cancel(self, request_id: str, prefill_stopped: bool = False, caller: str = "anonymous") -> dict[str, Any]:
        """Cancels a request. With `prefill_stopped` (the router relays the prefiller's
        `in_flight: false`) its pages are freed at once, else they stay fenced until the
        prefiller's word or `fence_timeout_s`."""
        with self.lock:
            job = self.jobs.get(request_id)
            if job is None:
                self._remember_cancel(caller, request_id)
        if job is not None and job.owner != caller:
            # Only the caller whose token reserved it may end it.
            raise RequestRejected(Rejection.UNKNOWN_REQUEST, f"unknown request id {request_id}", request_id)
        if job is None:
            if prefill_stopped:
                return {"request_id": request_id, "state": Res.FREE.value, "known": False}
            raise RequestRejected(Rejection.UNKNOWN_REQUEST, f"unknown request id {request_id}", request_id)
        self.end(job, DecodePhase.CANCELLED, writer_stopped=prefill_stopped,
                 error=f"request {request_id} was cancelled", reason=Rejection.CONFLICT)
        if prefill_stopped:
            self.writer_stopped(request_id)  # it was already ended and fenced before
        return {"request_id": request_id, "state": job.reservation_state.value, "known": True}

    def _remember_cancel(self, caller: str, request_id: str) -> None:
        """Remembers a cancel of an id not (yet) reserved, for reservation_ttl_s (a
        reservation completing later would be failed by then anyway); held under the lock.
        Bounded: past 4 entries per request slot, expired ones go, then the oldest."""
        now = time.monotonic()
        memory = self.cancelled_unreserved
        if len(memory) >= 4 * self._max_requests:
            for key in [k for k, expiry in memory.items() if expiry <= now]:
                del memory[key]
            while len(memory) >= 4 * self._max_requests:
                del memory[next(iter(memory))]
        memory[(caller, request_id)] = now + self._reservation_ttl_s

    def was_cancelled_unreserved(self, caller: str, request_id: str) -> bool:
        """A cancel came for this id before it was reserved and has not expired (held
        under the lock; forgets it)."""
        return self.cancelled_unreserved.pop((caller, request_id), 0.0) > time.monotonic()
