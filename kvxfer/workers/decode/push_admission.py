"""Admission of a pushed request: wait until its ImmCounter says every write landed (or
the request ends first), check what landed (`LandedKVCheck`), move its reservation to
ADMITTED and hand it to the batch loop.

A request that fails the check is failed (502 `integrity`,
`kvxfer_decode_kv_integrity_failures_total{reason}`) and its pages are fenced, since what
landed is not what was meant. An admitted request carries a `TransferReceipt`, logged and
returned with /generate.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvxfer.errors import TransferTimeout
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.integrity import KVIntegrityError
from kvxfer.metrics import DecodeMetrics
from kvxfer.transfer.engine import TransferEngine
from kvxfer.workers.decode.job import DecodeJob, DecodePhase
from kvxfer.workers.decode.job_table import JobTable
from kvxfer.workers.decode.landed_kv_check import LandedKVCheck
from kvxfer.workers.rejection import Rejection, RequestRejected

log = logging.getLogger("kvxfer.decode")


class PushAdmission:
    """Waits for a job's pushed KV and admits it; one per decode worker, no state of its own."""

    def __init__(self, table: JobTable, engine: TransferEngine, check: LandedKVCheck, metrics: DecodeMetrics) -> None:
        self._table = table
        self._engine = engine
        self._check = check
        self._metrics = metrics

    async def wait_for_kv(self, job: DecodeJob, timeout_s: float) -> None:
        """Waits on the ImmCounter (or the request's end: abort, TTL, cancel), checks the
        landed KV and starts decoding."""
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        with self._table.lock:
            if not job.waiting_for_kv or job.phase.ended or job.end_signal is not None:
                raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} is {job.phase.value}",
                                      job.request_id)
            job.loop = loop
            job.end_signal = loop.create_future()
        kv = asyncio.ensure_future(self._engine.wait_imm_async(job.imm, job.expected_count, timeout_s))
        try:
            await asyncio.wait({kv, job.end_signal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not kv.done():
                kv.cancel()
        if job.end_signal.done():
            # Ended by someone else (an abort, the TTL, a cancel): say why, at once.
            raise RequestRejected(job.end_reason, job.error or f"request {job.request_id} was {job.phase.value}",
                                  job.request_id)
        try:
            kv.result()
        except TransferTimeout:
            self._metrics.admission_timeouts.inc()
            got = self._engine.imm_count(job.imm)
            reason = f"KV incomplete after {timeout_s} s ({got} of {job.expected_count} writes landed)"
            self._table.end(job, DecodePhase.FAILED, error=f"request {job.request_id}: {reason}")
            # The engine's own exception names only the immediate: the 504 must name the request.
            raise TransferTimeout(job.request_id, reason) from None
        self._metrics.imm_wait.observe(time.perf_counter() - start)
        landed = self._engine.imm_count(job.imm)
        if landed > job.expected_count:
            # More immediates than the prefiller sends: a page written twice or a writer the
            # reservation does not name. Counted here; the check refuses the request
            # (write_overcount) and fences its pages, since its count proves nothing.
            self._metrics.stray_immediates.inc(landed - job.expected_count)
        landed_at = time.monotonic()
        if not job.waiting_for_kv:
            raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} was {job.phase.value}", job.request_id)
        try:
            # Off the event loop: a full check of a long prompt reads all of its KV once.
            first_token, receipt = await loop.run_in_executor(None, self._check.check, job, landed_at)
        except KVIntegrityError as exc:
            self._metrics.integrity_failures.labels(exc.reason).inc()
            log.error("%s", exc)
            # What landed is not what was meant (a write counted twice, a foreign or corrupt
            # one): no proof that the last write landed, so the pages are fenced, not freed.
            self._table.end(job, DecodePhase.FAILED, error=str(exc), reason=Rejection.INTEGRITY)
            raise RequestRejected(Rejection.INTEGRITY, str(exc), job.request_id) from None
        # Off the event loop: admission closes the reservation's registrations, a hand-off
        # to the engine's progress thread that waits behind its work under load.
        await loop.run_in_executor(None, self._mark_admitted, job)
        job.receipt = receipt
        log.info("transfer receipt %s: %s", job.request_id, receipt.header_value())
        self._table.start_decoding(job, first_token)

    def _mark_admitted(self, job: DecodeJob) -> None:
        table = self._table
        with table.lock:
            if not job.waiting_for_kv or job.phase.ended:
                raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} was {job.phase.value}",
                                      job.request_id)
            # Every write landed and checked out: none can come any more.
            table.ledger.move(job.request_id, Res.ADMITTED)
            # The prompt's full pages are final: later tokens go to later pages.
            table.allocator.publish(job.request_id, job.prefix_hashes)
