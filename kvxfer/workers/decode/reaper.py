"""The decode worker's reaper: the one thread that waits for what no caller waits for.

It receives the prefillers' abort messages (the engine's `recv`), marks a reservation
RECEIVING when its first immediate is counted, fails reservations past
`reservation_ttl_s`, revokes a fenced one's registration kept open for its prefiller's
word once `cancel_confirm_timeout_s` passed, and frees fenced ones past `fence_timeout_s`.
No thread or timer per request: every deadline is a ledger entry's, walked here every
`reaper_interval_s` at most.
"""

from __future__ import annotations

import logging
import threading

from kvxfer.handoff.decode_ledger import DeadlineSetting
from kvxfer.handoff.reservation_state import WAITING
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.protocol import decode_abort
from kvxfer.metrics import DecodeMetrics
from kvxfer.transfer.engine import TransferEngine
from kvxfer.workers.decode.job import DecodePhase
from kvxfer.workers.decode.job_table import JobTable
from kvxfer.workers.rejection import Rejection

log = logging.getLogger("kvxfer.decode")


class DecodeReaper:
    """The reaper thread over a `JobTable` and the engine's control messages."""

    def __init__(self, table: JobTable, engine: TransferEngine, metrics: DecodeMetrics, *,
                 reaper_interval_s: float, reservation_ttl_s: float) -> None:
        self._table = table
        self._engine = engine
        self._metrics = metrics
        self._interval_s = reaper_interval_s
        self._reservation_ttl_s = reservation_ttl_s
        self._stop = threading.Event()
        # Daemon: a fenced reservation never holds the process at exit.
        self._thread = threading.Thread(target=self._run, name="decode-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                message = self._engine.recv(self._interval_s)
                if message is not None:
                    self.on_message(message)
                self.walk_deadlines()
            except Exception:  # the reaper must outlive any one bad entry or message
                if self._stop.is_set() or self._engine.closed:
                    return
                log.exception("reaper step failed")
                self._stop.wait(self._interval_s)

    def on_message(self, message: bytes) -> None:
        """Handles a control message from a prefiller: only aborts are expected."""
        abort = decode_abort(message)
        if abort is None:
            log.warning("ignoring a control message that is not an abort (%d bytes)", len(message))
            return
        imm, nonce, why = abort
        entry = self._table.ledger.by_imm(imm)
        if entry is None or entry.nonce != nonce:
            # An earlier generation of the slot, or a stranger: counts toward nothing.
            log.info("ignoring an abort for immediate %#x that no live reservation carries", imm)
            return
        job = self._table.jobs.get(entry.request_id)
        self._metrics.push_aborts.inc()
        if job is not None and entry.state in WAITING:
            # The prefiller sends it once none of its writes is in flight: nothing can land.
            self._table.end(job, DecodePhase.FAILED, writer_stopped=True, reason=Rejection.PUSH_FAILED,
                            error=f"request {entry.request_id}: the prefiller aborted the push: {why}")
        else:
            self._table.writer_stopped(entry.request_id)

    def walk_deadlines(self) -> None:
        """Marks first immediates, then ends what is past its deadline."""
        table = self._table
        for entry in table.ledger.entries():
            if entry.state is Res.RESERVED and self._engine.imm_count(entry.imm) > 0:
                with table.lock:
                    if entry.state is Res.RESERVED:
                        # The move's time, in the entry's history, starts the receipt's wire_ms.
                        table.ledger.move(entry.request_id, Res.RECEIVING)
        for entry in table.ledger.due():
            job = table.jobs.get(entry.request_id)
            if entry.state in WAITING and job is not None:
                self._metrics.reservations_expired.inc()
                table.end(job, DecodePhase.FAILED, reason=Rejection.KV_TIMEOUT,
                          error=f"request {entry.request_id}: not admitted within reservation_ttl_s="
                                f"{self._reservation_ttl_s} s ({self._engine.imm_count(entry.imm)} of "
                                f"{job.expected_count} writes landed); pages fenced")
            elif entry.state is Res.FENCED and entry.deadline_setting is DeadlineSetting.CANCEL_CONFIRM:
                table.confirm_bound_passed(entry.request_id)  # the fence runs on to fence_timeout_s
            elif entry.state is Res.FENCED:
                table.fence_expired(entry.request_id)
