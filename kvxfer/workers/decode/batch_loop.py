"""The decode worker's continuous batching: one thread that owns the running batch.

Each step takes admitted jobs from the `JobTable` up to `max_batch`, frees the pages of
jobs that ended while in the batch (after the step that might have written them), runs one
decode step of the model over the batch and hands each job its token.
"""

from __future__ import annotations

import logging
import threading

from kvxfer.kv.cache import PagedKVCache
from kvxfer.model.transformer import DecodeRequest, FinishReason, Transformer, finish_reason_after
from kvxfer.workers.decode.job import DecodeJob, DecodePhase
from kvxfer.workers.decode.job_table import JobTable

log = logging.getLogger("kvxfer.decode")

#: Longest sleep of an idle loop between looks at the table: a handed-over job wakes it at
#: once, this only bounds how late a missed wake or a stop is noticed.
IDLE_WAIT_S = 0.05


class DecodeBatchLoop:
    """The batch thread: decodes every running job one token per step."""

    def __init__(self, table: JobTable, model: Transformer, cache: PagedKVCache, max_batch: int) -> None:
        self._table = table
        self._model = model
        self._cache = cache
        self._max_batch = max_batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-batch", daemon=True)

    def start(self) -> None:
        """Starts the thread; the table learns it, so only it frees the jobs it runs."""
        self._table.batch_thread = self._thread
        self._thread.start()

    def stop(self) -> None:
        """Asks the loop to end after its current step."""
        self._stop.set()
        self._table.wake.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        table = self._table
        running: list[DecodeJob] = []
        while not self._stop.is_set():
            running.extend(table.take_for_batch(self._max_batch - len(running)))
            running = [j for j in running if j.phase is DecodePhase.RUNNING]
            deferred = table.take_deferred_releases()
            for job in deferred:
                table.release_after_step(job)
            if deferred:
                table.on_change()
            if not running:
                table.wake.wait(IDLE_WAIT_S)
                table.wake.clear()
                continue
            running = self._step(running)

    def _step(self, running: list[DecodeJob]) -> list[DecodeJob]:
        """One decode step over `running`; returns the batch to go on with."""
        table = self._table
        batch = [DecodeRequest(j.last_token, j.position, j.pages) for j in running]
        try:
            tokens = self._model.decode_step(batch, self._cache)
        except Exception as exc:  # a model error fails the batch's requests, not the worker
            log.exception("decode step failed")
            for j in running:
                table.end(j, DecodePhase.FAILED, error=f"decode step failed: {exc}")
            return []
        for j, token in zip(running, tokens):
            if j.phase is not DecodePhase.RUNNING:
                continue
            j.position += 1
            j.last_token = token
            reason = finish_reason_after(token, len(j.kept), j.max_tokens)
            if reason is not FinishReason.STOP:
                j.kept.append(token)
                j.emit(("token", token))
            if reason is not None:
                table.end(j, DecodePhase.DONE, finish_reason=reason.value)
        return running
