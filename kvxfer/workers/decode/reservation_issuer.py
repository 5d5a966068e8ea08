"""/reserve on the decode worker: checks the request, opens its ledger entry and job,
scopes what a prefiller may write (`ReservationScopes`) and issues the `KVReservation`.

With `prefix_cache` on, the longest cached prefix of the prompt's full pages is reused (never
the page of the prompt's last token: its logits make the first token) and the reservation
asks the prefiller for the other pages only (`first_page`).
"""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from typing import Sequence

from kvxfer.handoff.decode_ledger import NoSlotError
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.handoff.reservation_scope import PrefillAddressError, ReservationScope
from kvxfer.kv.integrity import KVIntegrity
from kvxfer.kv.page_allocator import OutOfPagesError
from kvxfer.kv.prefix_hash import block_hashes, reusable_blocks
from kvxfer.kv.protocol import KVReservation, expected_imm_count
from kvxfer.kv.write_windows import reservation_windows
from kvxfer.metrics import DecodeMetrics
from kvxfer.transfer.engine import RegisteredMemory
from kvxfer.workers.decode.job import DecodeJob
from kvxfer.workers.decode.job_table import JobTable
from kvxfer.workers.decode.mailbox import DecodeMailbox
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore

log = logging.getLogger("kvxfer.decode")


class KVRegistration(str, Enum):
    """What descriptor a reservation hands its prefiller (docs/architecture.md, "Data plane")."""

    #: A registration of the reservation's own pages and mailbox slot, with fresh random
    #: keys, closed when the reservation stops waiting for its KV: a stolen or old
    #: descriptor writes nothing else and nothing after.
    PER_RESERVATION = "per_reservation"
    #: The one registration of the whole cache (and mailbox): no registration per request,
    #: but its descriptor writes anywhere in the cache for the life of the worker.
    WHOLE_CACHE = "whole_cache"


class ReservationScopes:
    """Each waiting reservation's `ReservationScope` (its own registrations with
    per_reservation, and its immediate binding), by request id. The ledger revokes one
    through `revoke` when the reservation stops waiting for its KV."""

    def __init__(self, core: WorkerCore, mailbox: DecodeMailbox, registration: KVRegistration,
                 metrics: DecodeMetrics) -> None:
        self._core = core
        self._mailbox = mailbox
        self._registration = registration
        self._metrics = metrics
        # Written by /reserve's thread and by whoever moves the ledger entry out of waiting;
        # the one lock keeps a revoke from passing an open that is not yet recorded.
        self._lock = threading.Lock()
        self._scopes: dict[str, ReservationScope] = {}

    def open(self, job: DecodeJob, prefill_address: bytes | None) -> tuple[bytes, bytes]:
        """Opens the job's scope and returns the KV and mailbox descriptors it hands out:
        with per_reservation, registrations of its pushed pages and its mailbox slot only;
        and its immediate bound to `prefill_address`. If the reservation stopped waiting
        meanwhile (a cancel can race a slow registration), the scope is revoked at once and
        the reservation refused (`Rejection.CONFLICT`)."""
        core = self._core
        parts: list[tuple[RegisteredMemory, list[tuple[int, int]]]] = []
        if self._registration is not KVRegistration.WHOLE_CACHE:
            cache = core.cache
            # Only the pages it pushes: a reused (held) page is out of the descriptor's reach.
            parts = [
                (core.cache_region,
                 reservation_windows(job.pushed_pages, core.config.num_layers, cache.num_pages, cache.page_bytes)),
                (self._mailbox.region, [(self._mailbox.offset(job.slot), self._mailbox.slot_stride)]),
            ]
        scope = ReservationScope.open(core.engine, f"request {job.request_id}", job.imm, prefill_address, parts)
        with self._lock:
            kept = job.waiting_for_kv
            if kept:
                self._scopes[job.request_id] = scope
                open_now = len(self._scopes)
        if not kept:
            scope.revoke()
            raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} was {job.phase.value} while its "
                                  "reservation was being made", job.request_id)
        if not parts:
            return core.cache_region.descriptor, self._mailbox.region.descriptor
        self._metrics.reservation_registrations.inc()
        self._metrics.reservation_registrations_open.set(open_now)
        kv, mailbox = scope.descriptors
        return kv, mailbox

    def revoke(self, request_id: str) -> None:
        """Revokes a reservation's scope; a write with its descriptors then fails at its writer."""
        with self._lock:
            scope = self._scopes.pop(request_id, None)
            open_now = len(self._scopes)
        if scope is None:
            return
        if scope.windows:
            self._metrics.reservation_registrations_open.set(open_now)
        scope.revoke()


class ReservationIssuer:
    """Turns a valid /reserve into a ledger entry, a `DecodeJob` and a `KVReservation`."""

    def __init__(self, core: WorkerCore, table: JobTable, scopes: ReservationScopes, mailbox: DecodeMailbox,
                 metrics: DecodeMetrics, *, max_reservations_per_caller: int, retry_after_s: float,
                 fence_timeout_s: float, integrity: KVIntegrity, tagged_tables: bool) -> None:
        self._core = core
        self._table = table
        self._scopes = scopes
        self._mailbox = mailbox
        self._metrics = metrics
        self._max_per_caller = max_reservations_per_caller
        self._retry_after_s = retry_after_s
        self._fence_timeout_s = fence_timeout_s
        self._integrity = integrity
        self._tagged_tables = tagged_tables

    def prefix_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """Block hashes of the prompt's full pages under this model's namespace (empty when
        the prefix cache is off)."""
        if not self._table.allocator.prefix_cache_enabled:
            return []
        return block_hashes(prompt, self._core.config.block_size, self._core.config.name)

    def _check(self, request_id: str, prompt_tokens: int, max_tokens: int, prompt: Sequence[int] | None) -> None:
        cfg = self._core.config
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
        if prompt is not None and len(prompt) != prompt_tokens:
            raise RequestRejected(Rejection.BAD_REQUEST, f"prompt has {len(prompt)} tokens, not {prompt_tokens}",
                                  request_id)

    def issue(self, request_id: str, prompt_tokens: int, max_tokens: int, caller: str,
              prefill_address: bytes | None, prompt: Sequence[int] | None) -> KVReservation:
        """Reserves pages for prompt + max_tokens and a mailbox slot/immediate, owned by
        `caller` (see `DecodeService.reserve`)."""
        self._check(request_id, prompt_tokens, max_tokens, prompt)
        job = self._open_job(request_id, prompt_tokens, max_tokens, caller, prompt)
        try:
            # Outside the table's lock: a registration is a hand-off to the engine's
            # progress thread, which waits behind its work under load.
            descriptor, meta_descriptor = self._scopes.open(job, prefill_address)
        except Exception as exc:
            # Nothing may stay taken for a reservation the caller never got.
            with self._table.lock:
                if not job.phase.ended and job.waiting_for_kv:
                    self._table.ledger.end(request_id, Res.FAILED, writer_stopped=True, reason="registration failed")
                    self._table.jobs.pop(request_id, None)
            if isinstance(exc, PrefillAddressError):
                raise RequestRejected(Rejection.BAD_REQUEST, f"prefill_engine_address: {exc}", request_id) from None
            raise
        if job.prefix_hashes:
            self._metrics.prefix.observe(prompt_tokens, job.held_pages * self._core.config.block_size)
        return KVReservation(
            request_id=request_id,
            descriptor=descriptor,
            # With a reused prefix, exactly the pages to push (kv.protocol.KVReservation).
            pages=job.pushed_pages if job.held_pages else list(job.pages),
            first_page=job.held_pages,
            num_pages=self._core.cache.num_pages,
            imm=job.imm,
            expected_count=job.expected_count,
            kv_layout=self._core.kv_layout,
            meta_descriptor=meta_descriptor,
            meta_offset=self._mailbox.offset(job.slot),
            nonce=job.nonce,
            fence_timeout_s=self._fence_timeout_s,
            checksums=self._integrity is not KVIntegrity.OFF,
            checksum_tag=self._integrity is not KVIntegrity.OFF and self._tagged_tables,
        )

    def _open_job(self, request_id: str, prompt_tokens: int, max_tokens: int, caller: str,
                  prompt: Sequence[int] | None) -> DecodeJob:
        """The ledger entry and job of a new reservation (under the table's lock)."""
        cfg = self._core.config
        table = self._table
        hashes = self.prefix_hashes(prompt) if prompt is not None else []
        engine = self._core.engine
        with table.lock:
            if request_id in table.jobs:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} already exists", request_id)
            if table.was_cancelled_unreserved(caller, request_id):
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled before it was "
                                      "reserved (its caller gave up waiting)", request_id)
            held = sum(1 for j in table.jobs.values() if j.owner == caller and j.live)
            if held >= self._max_per_caller:
                self._metrics.caller_limit_rejections.inc()
                raise RequestRejected(
                    Rejection.OVERLOADED, f"caller {caller} holds {held} live reservations on this worker "
                    f"(max_reservations_per_caller={self._max_per_caller})",
                    request_id, retry_after_s=self._retry_after_s)
            try:
                entry = table.ledger.open(request_id, prompt_tokens + max_tokens,
                                          hashes[:reusable_blocks(prompt_tokens, cfg.block_size)])
            except NoSlotError as exc:
                raise RequestRejected(Rejection.OVERLOADED, f"too many requests on this decode worker: {exc}",
                                      request_id) from None
            except OutOfPagesError as exc:
                raise RequestRejected(Rejection.OVERLOADED, str(exc), request_id) from None
            job = DecodeJob(
                request_id=request_id,
                entry=entry,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                # One write per pushed page and layer, plus the mailbox; held pages are not sent.
                expected_count=expected_imm_count(cfg.num_layers, prompt_tokens, cfg.block_size)
                - cfg.num_layers * entry.held_pages,
                created_at=time.monotonic(),
                owner=caller,
                prefix_hashes=hashes,
                block_size=cfg.block_size,
                prompt=prompt if table.allocator.prefix_cache_enabled else None,
            )
            table.jobs[request_id] = job
            # Immediates for this slot and generation that arrived before the reservation
            # existed came from no writer it names: drop them, so they are never credited.
            stray = engine.imm_count(job.imm)
            if stray:
                engine.reset_imm(job.imm)
                self._metrics.stray_immediates.inc(stray)
                log.warning("discarded %d immediates for %#x that arrived before request %s reserved it",
                            stray, job.imm, request_id)
        return job
