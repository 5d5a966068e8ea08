"""The check of a push whose count completed, before the decoder admits it (kv.integrity).

The mailbox record must be this reservation's (with a cluster key, its checksum table
tagged under the cluster's table key); then the step both decoders share
(`handoff.admission.check_landed`): no write may have been counted twice, the record's
declared total of posted units must be exactly the expected count, and (per
`kv_integrity`: off, sampled, full) the pages' CRC-32C must equal the prefiller's. What
passes gets a `TransferReceipt`; what fails raises `KVIntegrityError`.
"""

from __future__ import annotations

import random
import time

import numpy as np

from kvxfer.handoff.admission import check_landed
from kvxfer.kv.integrity import (
    KVIntegrity,
    KVIntegrityError,
    TransferReceipt,
    Verification,
    prompt_kv_digest,
    verify_pages,
)
from kvxfer.kv.protocol import decode_mailbox, mailbox_checksums, mailbox_tag_verifies
from kvxfer.metrics import DecodeMetrics
from kvxfer.workers.decode.job import DecodeJob
from kvxfer.workers.decode.mailbox import DecodeMailbox
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore

#: The receipt's word for what each `kv_integrity` mode checked.
VERDICTS = {KVIntegrity.OFF: "unchecked", KVIntegrity.SAMPLED: "sampled", KVIntegrity.FULL: "verified"}


class LandedKVCheck:
    """Checks the landed KV of a job whose immediate count completed. Stateless but for
    its sampling generator; runs off the event loop (a full check reads the prompt's KV)."""

    def __init__(self, core: WorkerCore, mailbox: DecodeMailbox, metrics: DecodeMetrics, *, mode: KVIntegrity,
                 sample_rate: float, table_key: bytes | None, receipt_digest: bool) -> None:
        self._core = core
        self._mailbox = mailbox
        self._metrics = metrics
        self._mode = mode
        self._sample_rate = sample_rate
        # With a cluster key, only checksum tables tagged under it are believed.
        self._table_key = table_key
        self._receipt_digest = receipt_digest
        self._sample_rng = random.Random()

    def check(self, job: DecodeJob, landed_at: float) -> tuple[int, TransferReceipt]:
        """The first token and the receipt of a job whose count completed at `landed_at`
        (monotonic); raises `KVIntegrityError` if the mailbox, the count or a page's
        checksum says the landed KV is not the push that was meant, and
        `Rejection.CONFLICT` if the request ended meanwhile."""
        cfg = self._core.config
        rid = job.request_id
        raw = self._mailbox.read(job.slot)
        why = "a write was counted twice or came from elsewhere"
        try:
            nonce, first_token, prompt_tokens, declared = decode_mailbox(raw)
        except ValueError as exc:
            nonce, first_token, prompt_tokens, declared = -1, -1, -1, -1
            why = str(exc)
        if nonce != job.nonce or prompt_tokens != job.prompt_tokens:
            raise KVIntegrityError(rid, "mailbox_mismatch", f"the count completed but the mailbox holds another "
                                   f"record: {why}")
        pushed = job.pushed_pages
        table = self._checksum_table(job, raw) if self._mode is not KVIntegrity.OFF else None

        def verify() -> Verification:
            assert table is not None  # called only with kv_integrity on
            started = time.perf_counter()
            verification = verify_pages(self._core.cache, pushed, table.reshape(cfg.num_layers, -1), self._mode,
                                        self._sample_rate, self._sample_rng)
            # Recorded here, so a check that finds a mismatch is measured too.
            self._metrics.pages_verified.inc(verification.checked)
            self._metrics.verify_duration.observe(time.perf_counter() - started)
            return verification

        count = self._core.engine.imm_count(job.imm)
        if count < job.expected_count:
            # Only an end resets a completed count (fence, free): the request ended meanwhile.
            raise RequestRejected(Rejection.CONFLICT, f"request {rid} was {job.phase.value}", rid)
        # The count, the push's own total (a page written twice counts one write late: the
        # mailbox, read above, or the extra write), then the checksums: the step the vLLM
        # connector runs too.
        found = check_landed(rid, count, job.expected_count, self._mode, verify, declared=declared)
        receipt = TransferReceipt(
            request_id=rid,
            kv_bytes=cfg.num_layers * len(pushed) * self._core.cache.page_bytes,
            pages=len(pushed),
            layers=cfg.num_layers,
            wire_ms=max(0.0, landed_at - (job.first_imm_at or landed_at)) * 1e3,
            verify_ms=found.verify_s * 1e3,
            verdict=VERDICTS[self._mode],
            pages_checked=found.checked,
        )
        if self._receipt_digest:
            receipt.kv_digest = prompt_kv_digest(self._core.cache, job.prompt_pages, job.prompt_tokens)
        return first_token, receipt

    def _checksum_table(self, job: DecodeJob, raw: bytes) -> np.ndarray:
        """The prefiller's CRC-32C table from the mailbox slot, one per (layer, pushed page)."""
        rid = job.request_id
        if self._table_key is not None and not mailbox_tag_verifies(raw, self._table_key, job.imm):
            # CRC-32C is not keyed: whoever holds a stolen reservation can send the right
            # table for forged pages, so only a table a holder of the cluster key tagged counts.
            raise KVIntegrityError(rid, "mailbox_mismatch", "the checksum table carries no tag that verifies "
                                   "under the cluster key: the record was not written by a prefiller of "
                                   "this cluster")
        try:
            table = np.frombuffer(mailbox_checksums(raw), dtype="<u4")
        except ValueError as exc:
            raise KVIntegrityError(rid, "checksums_missing", str(exc)) from None
        num_layers = self._core.config.num_layers
        if table.size != num_layers * len(job.pushed_pages):
            raise KVIntegrityError(rid, "checksums_missing", f"the prefiller sent {table.size} checksums, "
                                   f"{num_layers} layers x {len(job.pushed_pages)} pages were pushed")
        return table
