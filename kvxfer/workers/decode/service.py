"""The decode worker: reserves KV pages, admits a request when its ImmCounter says every
pushed write landed, and decodes with continuous batching.

Two state machines, kept apart on purpose. The request's (`RequestState`): RESERVED (KV
not yet complete) -> RUNNING (in the decode batch) -> DONE; or FAILED/CANCELLED: what the
client is told. The reservation's (`handoff.decode_ledger.ReservationState`: RESERVED, RECEIVING,
ADMITTED, FAILED, CANCELLED, FENCED, FREE): what may happen to its pages, slot and
immediate. Pages of a request that ended while a prefiller may still write into them go
FENCED and come back only once the prefiller confirmed it stopped (its abort message, or
the router relaying its /cancel) or after `fence_timeout_s`.

Before admission the landed KV is checked end to end (`kv_integrity`: off, sampled, full;
kv.integrity): the mailbox record must be this reservation's (with a cluster key, its
checksum table tagged under the cluster's table key), no write may have been counted
twice, and the pages' CRC-32C must equal the prefiller's. A request that fails the check is
failed (502 `integrity`, `kvxfer_decode_kv_integrity_failures_total{reason}`) and
its pages are fenced, since what landed is not what was meant. An admitted request carries a
`TransferReceipt`, logged and returned with /generate.

With `prefix_cache` on (the default) the decoder keeps finished requests' full prompt
pages (kv.prefix_cache, owned by the page allocator): /reserve looks the prompt's block
hashes up, starts the block table with the pages of the longest held prefix (read-only for
the request, pinned until its reservation is FREE) and asks the prefiller for the rest only
(the reservation's `first_page`, its `cached_tokens`); /generate_local computes only the
tokens after that prefix. A request's full prompt pages go to the cache once its KV is
known complete (admission, or the end of its local prefill), never from a request whose
pages a write may still reach; when it finishes, so do the full pages of its generated
tokens (a chat's next turn repeats them). `/prefix_index` reports the held hashes to routers.

One reaper thread does all the waiting that has no caller: it receives abort messages,
marks RECEIVING, fails reservations past `reservation_ttl_s` and frees fenced ones past
`fence_timeout_s`. No thread or timer per request.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, AsyncIterator, Sequence

import numpy as np
from pydantic import Field

from kvxfer.errors import TransferTimeout
from kvxfer.kv.integrity import KVIntegrity, KVIntegrityError, TransferReceipt, prompt_kv_digest, verify_pages
from kvxfer.handoff.decode_ledger import WAITING, NoSlotError, ReservationLedger
from kvxfer.handoff.decode_ledger import ReservationState as Res
from kvxfer.kv.page_allocator import OutOfPagesError, PageAllocator
from kvxfer.kv.prefix_cache import PrefixCache
from kvxfer.kv.prefix_hash import block_hashes, reusable_blocks
from kvxfer.kv.protocol import (
    MAX_SLOTS,
    KVReservation,
    decode_abort,
    decode_mailbox,
    expected_imm_count,
    mailbox_checksums,
    mailbox_slot_bytes,
    mailbox_tag_verifies,
    pages_for_tokens,
)
from kvxfer.handoff.reservation_scope import PrefillAddressError, ReservationScope
from kvxfer.kv.write_windows import reservation_windows
from kvxfer.metrics import DecodeMetrics
from kvxfer.registry.signing import checksum_table_key_of
from kvxfer.model.tokenizer import ByteTokenizer
from kvxfer.model.transformer import DecodeRequest, FinishReason, finish_reason_after
from kvxfer.transfer.engine import RegisteredMemory
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore, WorkerSettings

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


class DecodeSettings(WorkerSettings):
    """Decode worker settings (env prefix KVXFER_)."""

    port: int = 8200
    max_batch: int = 64
    max_requests: int = Field(1024, gt=0, le=MAX_SLOTS)
    kv_wait_timeout_s: float = Field(30.0, gt=0, description="default deadline of POST /generate's wait for the KV")
    reservation_ttl_s: float = Field(
        120.0, gt=0, description="a reservation not admitted this long after /reserve is failed and fenced"
    )
    fence_timeout_s: float = Field(
        15.0, gt=0, description="how long fenced pages wait for the prefiller's word before they are "
        "reused anyway; prefillers refuse a reservation whose fence is not longer than their "
        "transfer_timeout_s",
    )
    max_reservations_per_caller: int = Field(
        256, gt=0, description="live reservations (waiting for KV or decoding) one authenticated caller may hold; "
        "beyond it /reserve answers 429, so one caller cannot squat every page"
    )
    reaper_interval_s: float = Field(
        0.05, gt=0, le=1.0, description="the reaper's longest sleep: granularity of the TTL and fence deadlines"
    )
    kv_integrity: KVIntegrity = Field(
        KVIntegrity.FULL, description="end-to-end check of landed KV before admission: 'off' (prefillers send "
        "no checksums), 'sampled' (kv_integrity_sample_rate of each layer's pages), 'full' (every page)",
    )
    kv_integrity_sample_rate: float = Field(
        0.05, gt=0, le=1.0, description="share of each layer's pages checked when kv_integrity is 'sampled' "
        "(at least one page per layer)",
    )
    kv_registration: KVRegistration = Field(
        KVRegistration.PER_RESERVATION, description="'per_reservation': each reservation gets its own memory "
        "registration of its pages and mailbox slot with fresh random keys, closed at admission, failure, cancel "
        "or TTL; 'whole_cache': every reservation hands out the one whole-cache descriptor (cheaper on RDMA NICs, "
        "where a registration pins memory; see benchmarks/bench_registration.py)",
    )
    kv_receipt_digest: bool = Field(
        False, description="put kv.integrity.prompt_kv_digest of the landed prompt KV in the receipt (one more "
        "read of it: for tests that compare with the colocated reference, and audits)",
    )


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
    #: The caller (token issuer) that reserved it: only it may generate or cancel it.
    owner: str = "anonymous"
    state: RequestState = RequestState.RESERVED
    kept: list[int] = field(default_factory=list)
    last_token: int = 0
    position: int = 0
    finish_reason: str | None = None
    error: str | None = None
    queue: "asyncio.Queue[tuple[str, Any]] | None" = None
    loop: asyncio.AbstractEventLoop | None = None
    admitted_at: float = 0.0
    # Set (in `loop`) when the request ends while /generate waits for its KV: an abort,
    # the TTL or a cancel wakes the waiter at once instead of at its deadline.
    ended: "asyncio.Future[None] | None" = None
    #: The Rejection the waiter raises when `ended` fires.
    end_reason: Rejection = Rejection.FAILED
    #: Monotonic time the reaper first saw one of its immediates (0: not yet).
    first_imm_at: float = 0.0
    #: What the decoder saw of the push, once admitted (None for a local prefill).
    receipt: TransferReceipt | None = None
    #: Leading prompt pages reused from the prefix cache (nobody writes into them).
    held_pages: int = 0
    #: Block hashes of the prompt's full pages (empty without a prefix cache).
    prefix_hashes: list[bytes] = field(default_factory=list)
    #: Tokens per page (the model's block size).
    block_size: int = 0
    #: The prompt's tokens (kept only with a prefix cache: generated pages are named by them).
    prompt: Sequence[int] | None = None

    @property
    def prompt_pages(self) -> list[int]:
        """The block table's pages that hold the prompt."""
        return self.pages[:pages_for_tokens(self.prompt_tokens, self.block_size)]

    @property
    def pushed_pages(self) -> list[int]:
        """The prompt pages a prefiller writes: those after the reused prefix."""
        return self.prompt_pages[self.held_pages:]


class DecodeService:
    """State and logic of a decode worker, independent of HTTP (tests drive it directly)."""

    def __init__(self, settings: DecodeSettings) -> None:
        self.settings = settings
        self.core = WorkerCore(settings, "decode")
        self.tokenizer = ByteTokenizer()
        self.allocator = PageAllocator(settings.num_pages, self.core.config.block_size,
                                       prefix_cache=PrefixCache() if settings.prefix_cache else None)
        self.ledger = ReservationLedger(
            self.allocator,
            settings.max_requests,
            reservation_ttl_s=settings.reservation_ttl_s,
            fence_timeout_s=settings.fence_timeout_s,
            forget_imm=self.core.engine.reset_imm,
            close_writes=self._revoke_scope,
        )
        # Each reservation's registrations (kv_registration=per_reservation) and immediate
        # binding, by request id, open while it waits for its KV.
        # With per_reservation every scope holds registrations, with whole_cache none does.
        self._scopes: dict[str, ReservationScope] = {}
        cfg = self.core.config
        # Each slot holds the record and one CRC-32C per (layer, page) of the longest prompt.
        max_prompt_pages = min(pages_for_tokens(cfg.max_context, cfg.block_size), settings.num_pages)
        self.mailbox_slot_stride = mailbox_slot_bytes(cfg.num_layers, max_prompt_pages)
        self.mailbox = np.zeros(settings.max_requests * self.mailbox_slot_stride, dtype=np.uint8)
        self._sample_rng = random.Random()
        # With a cluster key, only checksum tables tagged under it are believed (kv.integrity).
        self._table_key = checksum_table_key_of(settings.cluster_key_file)
        self.mailbox_region = self.core.engine.register(self.mailbox)
        self.metrics = DecodeMetrics(self.core.metrics_registry)
        self.jobs: dict[str, DecodeJob] = {}
        # (caller, request id) -> monotonic expiry of a cancel that found no reservation:
        # the router cancels a /reserve it gave up waiting for, and that reservation may
        # still complete afterwards (it was queued behind others); it is then refused.
        self._cancelled_unreserved: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()  # jobs and batch hand-over: control path only
        self._admitted: list[DecodeJob] = []
        self._deferred_release: list[DecodeJob] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._batch_thread = threading.Thread(target=self._batch_loop, name="decode-batch", daemon=True)
        self._batch_thread.start()
        # Daemon: a fenced reservation never holds the process at exit.
        self._reaper_thread = threading.Thread(target=self._reaper_loop, name="decode-reaper", daemon=True)
        self._reaper_thread.start()
        self._update_gauges()

    # -- reservation ------------------------------------------------------------------
    def prefix_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """Block hashes of the prompt's full pages under this model's namespace (empty when
        the prefix cache is off)."""
        if not self.allocator.prefix_cache_enabled:
            return []
        return block_hashes(prompt, self.core.config.block_size, self.core.config.name)

    def reserve(self, request_id: str, prompt_tokens: int, max_tokens: int, caller: str = "anonymous",
                prefill_address: bytes | None = None, prompt: Sequence[int] | None = None) -> KVReservation:
        """Reserves pages for prompt + max_tokens and a mailbox slot/immediate, owned by `caller`.

        With `prefill_address` (the engine address of the prefiller the router chose), the
        reservation's immediate is credited only with arrivals from that engine where the
        provider can tell (see `TransferEngine.bind_imm_source`); a malformed address is a
        `Rejection.BAD_REQUEST` and takes nothing. With the `prompt`'s tokens and the prefix
        cache on, the longest cached prefix of full pages is reused (never the page of the
        prompt's last token: its logits make the first token) and the reservation asks the
        prefiller for the other pages only (`first_page`).
        """
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
        if prompt is not None and len(prompt) != prompt_tokens:
            raise RequestRejected(Rejection.BAD_REQUEST, f"prompt has {len(prompt)} tokens, not {prompt_tokens}",
                                  request_id)
        hashes = self.prefix_hashes(prompt) if prompt is not None else []
        with self._lock:
            if request_id in self.jobs:
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} already exists", request_id)
            if self._cancelled_unreserved.pop((caller, request_id), 0.0) > time.monotonic():
                raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled before it was "
                                      "reserved (its caller gave up waiting)", request_id)
            held = sum(1 for j in self.jobs.values()
                       if j.owner == caller and j.state in (RequestState.RESERVED, RequestState.RUNNING))
            if held >= self.settings.max_reservations_per_caller:
                self.metrics.caller_limit_rejections.inc()
                raise RequestRejected(
                    Rejection.OVERLOADED, f"caller {caller} holds {held} live reservations on this worker "
                    f"(max_reservations_per_caller={self.settings.max_reservations_per_caller})",
                    request_id, retry_after_s=self.settings.retry_after_s)
            try:
                entry = self.ledger.open(request_id, prompt_tokens + max_tokens,
                                         hashes[:reusable_blocks(prompt_tokens, cfg.block_size)])
            except NoSlotError as exc:
                raise RequestRejected(Rejection.OVERLOADED, f"too many requests on this decode worker: {exc}", request_id) from None
            except OutOfPagesError as exc:
                raise RequestRejected(Rejection.OVERLOADED, str(exc), request_id) from None
            job = DecodeJob(
                request_id=request_id,
                pages=entry.pages,
                slot=entry.slot,
                imm=entry.imm,
                nonce=entry.nonce,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                # One write per pushed page and layer, plus the mailbox; held pages are not sent.
                expected_count=expected_imm_count(cfg.num_layers, prompt_tokens, cfg.block_size)
                - cfg.num_layers * entry.held_pages,
                created_at=time.monotonic(),
                owner=caller,
                held_pages=entry.held_pages,
                prefix_hashes=hashes,
                block_size=cfg.block_size,
                prompt=prompt if self.allocator.prefix_cache_enabled else None,
            )
            self.jobs[request_id] = job
            # Immediates for this slot and generation that arrived before the reservation
            # existed came from no writer it names: drop them, so they are never credited.
            stray = self.core.engine.imm_count(job.imm)
            if stray:
                self.core.engine.reset_imm(job.imm)
                self.metrics.stray_immediates.inc(stray)
                log.warning("discarded %d immediates for %#x that arrived before request %s reserved it",
                            stray, job.imm, request_id)
            try:
                descriptor, meta_descriptor = self._open_scope(job, prefill_address)
            except Exception as exc:
                # Nothing may stay taken for a reservation the caller never got.
                self.ledger.end(request_id, Res.FAILED, writer_stopped=True, reason="registration failed")
                self.jobs.pop(request_id, None)
                if isinstance(exc, PrefillAddressError):
                    raise RequestRejected(Rejection.BAD_REQUEST, f"prefill_engine_address: {exc}", request_id) from None
                raise
        if hashes:
            self.metrics.prefix.observe(prompt_tokens, job.held_pages * cfg.block_size)
        self._update_gauges()
        return KVReservation(
            request_id=request_id,
            descriptor=descriptor,
            # With a reused prefix, exactly the pages to push (kv.protocol.KVReservation).
            pages=job.pushed_pages if job.held_pages else list(job.pages),
            first_page=job.held_pages,
            num_pages=self.core.cache.num_pages,
            imm=job.imm,
            expected_count=job.expected_count,
            kv_layout=self.core.kv_layout,
            meta_descriptor=meta_descriptor,
            meta_offset=job.slot * self.mailbox_slot_stride,
            nonce=job.nonce,
            fence_timeout_s=self.settings.fence_timeout_s,
            checksums=self.settings.kv_integrity is not KVIntegrity.OFF,
            checksum_tag=self.settings.kv_integrity is not KVIntegrity.OFF and self._table_key is not None,
        )

    def _open_scope(self, job: DecodeJob, prefill_address: bytes | None) -> tuple[bytes, bytes]:
        """Opens the job's `ReservationScope` and returns the KV and mailbox descriptors it
        hands out: with per_reservation (see `KVRegistration`), registrations of its prompt
        pages and its mailbox slot only; and its immediate bound to `prefill_address`."""
        parts: list[tuple[RegisteredMemory, list[tuple[int, int]]]] = []
        if self.settings.kv_registration is not KVRegistration.WHOLE_CACHE:
            cache = self.core.cache
            # Only the pages it pushes: a reused (held) page is out of the descriptor's reach.
            parts = [
                (self.core.cache_region,
                 reservation_windows(job.pushed_pages, self.core.config.num_layers, cache.num_pages, cache.page_bytes)),
                (self.mailbox_region, [(job.slot * self.mailbox_slot_stride, self.mailbox_slot_stride)]),
            ]
        scope = ReservationScope.open(self.core.engine, f"request {job.request_id}", job.imm, prefill_address, parts)
        self._scopes[job.request_id] = scope
        if not parts:
            return self.core.cache_region.descriptor, self.mailbox_region.descriptor
        self.metrics.reservation_registrations.inc()
        self.metrics.reservation_registrations_open.set(len(self._scopes))
        kv, mailbox = scope.descriptors
        return kv, mailbox

    def _revoke_scope(self, request_id: str) -> None:
        """Revokes a reservation's scope (the ledger calls it when the reservation stops
        waiting for its KV); a write with its descriptors then fails at its writer."""
        scope = self._scopes.pop(request_id, None)
        if scope is None:
            return
        if scope.windows:
            self.metrics.reservation_registrations_open.set(len(self._scopes))
        scope.revoke()

    def job(self, request_id: str, caller: str = "anonymous") -> DecodeJob:
        """The job of a request id reserved by `caller`; `Rejection.UNKNOWN_REQUEST` if there is
        none (another caller's id is unknown to this one: no oracle for what others hold)."""
        job = self.jobs.get(request_id)
        if job is None or job.owner != caller:
            raise RequestRejected(Rejection.UNKNOWN_REQUEST, f"unknown request id {request_id}", request_id)
        return job

    # -- admission --------------------------------------------------------------------
    async def wait_for_kv(self, job: DecodeJob, timeout_s: float) -> None:
        """Waits on the ImmCounter (or the request's end: abort, TTL, cancel), reads the
        mailbox and joins the running batch."""
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        with self._lock:
            if job.state is not RequestState.RESERVED or job.ended is not None:
                raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} is {job.state.value}", job.request_id)
            job.loop = loop
            job.ended = loop.create_future()
        kv = asyncio.ensure_future(self.core.engine.wait_imm_async(job.imm, job.expected_count, timeout_s))
        try:
            await asyncio.wait({kv, job.ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not kv.done():
                kv.cancel()
        if job.ended.done():
            # Ended by someone else (an abort, the TTL, a cancel): say why, at once.
            raise RequestRejected(job.end_reason, job.error or f"request {job.request_id} was {job.state.value}", job.request_id)
        try:
            kv.result()
        except TransferTimeout:
            self.metrics.admission_timeouts.inc()
            got = self.core.engine.imm_count(job.imm)
            reason = f"KV incomplete after {timeout_s} s ({got} of {job.expected_count} writes landed)"
            self.end(job, RequestState.FAILED, error=f"request {job.request_id}: {reason}")
            # The engine's own exception names only the immediate: the 504 must name the request.
            raise TransferTimeout(job.request_id, reason) from None
        self.metrics.imm_wait.observe(time.perf_counter() - start)
        landed = self.core.engine.imm_count(job.imm)
        if landed > job.expected_count:
            # More immediates than the prefiller sends: a page written twice or a writer the
            # reservation does not name. Counted here; _check_landed_kv refuses the request
            # (write_overcount) and fences its pages, since its count proves nothing.
            self.metrics.stray_immediates.inc(landed - job.expected_count)
        landed_at = time.monotonic()
        if job.state is not RequestState.RESERVED:
            raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} was {job.state.value}", job.request_id)
        try:
            # Off the event loop: a full check of a long prompt reads all of its KV once.
            first_token, receipt = await loop.run_in_executor(None, self._check_landed_kv, job, landed_at)
        except KVIntegrityError as exc:
            self.metrics.integrity_failures.labels(exc.reason).inc()
            log.error("%s", exc)
            # What landed is not what was meant (a write counted twice, a foreign or corrupt
            # one): no proof that the last write landed, so the pages are fenced, not freed.
            self.end(job, RequestState.FAILED, error=str(exc), reason=Rejection.INTEGRITY)
            raise RequestRejected(Rejection.INTEGRITY, str(exc), job.request_id) from None
        # Off the event loop: admission closes the reservation's registrations, a hand-off
        # to the engine's progress thread that waits behind its work under load.
        await loop.run_in_executor(None, self._mark_admitted, job)
        job.receipt = receipt
        log.info("transfer receipt %s: %s", job.request_id, receipt.header_value())
        self._admit(job, first_token)

    def _mark_admitted(self, job: DecodeJob) -> None:
        with self._lock:
            if job.state is not RequestState.RESERVED:
                raise RequestRejected(Rejection.CONFLICT, f"request {job.request_id} was {job.state.value}", job.request_id)
            # Every write landed and checked out: none can come any more.
            self.ledger.move(job.request_id, Res.ADMITTED)
            # The prompt's full pages are final: later tokens go to later pages.
            self.allocator.publish(job.request_id, job.prefix_hashes)

    def _check_landed_kv(self, job: DecodeJob, landed_at: float) -> tuple[int, TransferReceipt]:
        """The first token and the receipt of a request whose count completed; raises
        `KVIntegrityError` if the mailbox, the count or (per `kv_integrity`) a page's
        checksum says the landed KV is not the push that was meant."""
        cfg = self.core.config
        rid = job.request_id
        offset = job.slot * self.mailbox_slot_stride
        raw = bytes(self.mailbox[offset : offset + self.mailbox_slot_stride])
        try:
            nonce, first_token, prompt_tokens = decode_mailbox(raw)
        except ValueError:
            nonce, first_token, prompt_tokens = -1, -1, -1
        if nonce != job.nonce or prompt_tokens != job.prompt_tokens:
            raise KVIntegrityError(rid, "mailbox_mismatch", "the count completed but the mailbox holds another "
                                   "record: a write was counted twice or came from elsewhere")
        prompt_pages = job.pushed_pages
        mode = self.settings.kv_integrity
        verify_s, checked, mismatches = 0.0, 0, []
        if mode is not KVIntegrity.OFF:
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
            if table.size != cfg.num_layers * len(prompt_pages):
                raise KVIntegrityError(rid, "checksums_missing", f"the prefiller sent {table.size} checksums, "
                                       f"{cfg.num_layers} layers x {len(prompt_pages)} pages were pushed")
            t0 = time.perf_counter()
            verification = verify_pages(self.core.cache, prompt_pages, table.reshape(cfg.num_layers, -1), mode,
                                        self.settings.kv_integrity_sample_rate, self._sample_rng)
            verify_s = time.perf_counter() - t0
            checked, mismatches = verification.checked, verification.mismatches
            self.metrics.pages_verified.inc(checked)
            self.metrics.verify_duration.observe(verify_s)
        landed = self.core.engine.imm_count(job.imm)
        if landed > job.expected_count:
            raise KVIntegrityError(rid, "write_overcount", f"{landed} writes counted, the reservation expects "
                                   f"{job.expected_count}: a page was written twice")
        if mismatches:
            layer, block, page = mismatches[0]
            raise KVIntegrityError(rid, "checksum_mismatch", f"{len(mismatches)} of {checked} checked pages differ "
                                   f"from the prefiller's CRC-32C; first: layer {layer}, block {block}, page {page}")
        verdict = {KVIntegrity.OFF: "unchecked", KVIntegrity.SAMPLED: "sampled", KVIntegrity.FULL: "verified"}[mode]
        receipt = TransferReceipt(
            request_id=rid,
            kv_bytes=cfg.num_layers * len(prompt_pages) * self.core.cache.page_bytes,
            pages=len(prompt_pages),
            layers=cfg.num_layers,
            wire_ms=max(0.0, landed_at - (job.first_imm_at or landed_at)) * 1e3,
            verify_ms=verify_s * 1e3,
            verdict=verdict,
            pages_checked=checked,
        )
        if self.settings.kv_receipt_digest:
            receipt.kv_digest = prompt_kv_digest(self.core.cache, job.prompt_pages, job.prompt_tokens)
        return first_token, receipt

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
        loop = asyncio.get_running_loop()
        with self._lock:
            # No remote writer: the pages are this worker's from here on.
            self.ledger.move(job.request_id, Res.ADMITTED)
        result = await loop.run_in_executor(
            None,
            lambda: self.core.model.prefill(
                prompt, self.core.cache, job.pages, chunk_size=self.settings.prefill_chunk_tokens,
                start_pos=job.held_pages * self.core.config.block_size,
            ),
        )
        with self._lock:
            if job.state is RequestState.RESERVED:
                # Computed and not ended meanwhile: its full prompt pages are final.
                self.allocator.publish(job.request_id, job.prefix_hashes)
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
        writer_stopped: bool = False,
        finish_reason: str | None = None,
        error: str | None = None,
        reason: Rejection = Rejection.FAILED,
    ) -> None:
        """Ends a job once and moves its reservation on: FREE when no write can land (KV
        all arrived, or `writer_stopped`: the prefiller said so), else FENCED.

        A /generate still waiting for the KV is woken and fails with `reason`.
        """
        with self._lock:
            if job.state in (RequestState.DONE, RequestState.FAILED, RequestState.CANCELLED):
                return
            in_batch = job.state is RequestState.RUNNING and job not in self._admitted
            job.state = state
            job.finish_reason = finish_reason
            job.error = error
            job.end_reason = reason
            if job in self._admitted:
                self._admitted.remove(job)
            # The batch thread may be writing this job's K/V right now: it frees the pages
            # itself after its current step.
            defer = in_batch and threading.current_thread() is not self._batch_thread
            if defer:
                self._deferred_release.append(job)
            else:
                if state is RequestState.DONE:
                    self._cache_generated(job)
                outcome = Res.CANCELLED if state is RequestState.CANCELLED else Res.FAILED
                entry = self.ledger.end(job.request_id, outcome, writer_stopped=writer_stopped, reason=error or "")
                if entry.state is Res.FREE:
                    self.jobs.pop(job.request_id, None)
            ended = job.ended
        if ended is not None and job.loop is not None:
            job.loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))
        self._emit(job, ("end", state))
        self._update_gauges()

    def _cache_generated(self, job: DecodeJob) -> None:
        """Hands the full pages of a finished request's prompt and generated tokens to the
        prefix cache (held under `_lock`): a next chat turn repeats them. Only positions
        whose K/V a step wrote count: the last token was emitted, never fed back."""
        entry = self.ledger.get(job.request_id)
        if job.prompt is None or entry is None or entry.state is not Res.ADMITTED:
            return
        fed = job.kept[: max(0, job.position - job.prompt_tokens)]
        if (job.prompt_tokens + len(fed)) // job.block_size > len(job.prefix_hashes):
            written = list(job.prompt) + fed
            self.allocator.publish(job.request_id, block_hashes(written, job.block_size, self.core.config.name))

    def _release(self, job: DecodeJob) -> None:
        """Frees an admitted job's pages (the batch thread, after its step)."""
        with self._lock:
            self.ledger.end(job.request_id, Res.FAILED, writer_stopped=True)
            self.jobs.pop(job.request_id, None)

    def writer_stopped(self, request_id: str) -> bool:
        """The prefiller confirmed none of the request's writes can land: a fenced
        reservation's pages go back at once. True if this freed it."""
        with self._lock:
            entry = self.ledger.writer_stopped(request_id)
            if entry is not None:
                self.jobs.pop(request_id, None)
        if entry is not None:
            self._update_gauges()
        return entry is not None

    def cancel(self, request_id: str, prefill_stopped: bool = False, caller: str = "anonymous") -> dict[str, Any]:
        """Cancels a request. With `prefill_stopped` (the router relays the prefiller's
        `in_flight: false`) its pages are freed at once, else they stay fenced until the
        prefiller's word or `fence_timeout_s`."""
        with self._lock:
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
        self.end(job, RequestState.CANCELLED, writer_stopped=prefill_stopped,
                 error=f"request {request_id} was cancelled", reason=Rejection.CONFLICT)
        if prefill_stopped:
            self.writer_stopped(request_id)  # it was already ended and fenced before
        entry = self.ledger.get(request_id)
        return {"request_id": request_id, "state": (entry.state if entry else Res.FREE).value, "known": True}

    def _remember_cancel(self, caller: str, request_id: str) -> None:
        """Remembers a cancel of an id not (yet) reserved, for reservation_ttl_s (a
        reservation completing later would be failed by then anyway); held under `_lock`.
        Bounded: past 4 entries per request slot, expired ones go, then the oldest."""
        now = time.monotonic()
        memory = self._cancelled_unreserved
        if len(memory) >= 4 * self.settings.max_requests:
            for key in [k for k, expiry in memory.items() if expiry <= now]:
                del memory[key]
            while len(memory) >= 4 * self.settings.max_requests:
                del memory[next(iter(memory))]
        memory[(caller, request_id)] = now + self.settings.reservation_ttl_s

    # -- the reaper -------------------------------------------------------------------
    def _reaper_loop(self) -> None:
        """The one thread that waits for what no caller waits for: abort messages, first
        immediates, TTLs and fence deadlines."""
        interval_s = self.settings.reaper_interval_s
        while not self._stop.is_set():
            try:
                message = self.core.engine.recv(interval_s)
                if message is not None:
                    self._on_message(message)
                self._walk_deadlines()
            except Exception:  # the reaper must outlive any one bad entry or message
                if self._stop.is_set() or self.core.engine.closed:
                    return
                log.exception("reaper step failed")
                self._stop.wait(interval_s)

    def _on_message(self, message: bytes) -> None:
        abort = decode_abort(message)
        if abort is None:
            log.warning("ignoring a control message that is not an abort (%d bytes)", len(message))
            return
        imm, nonce, why = abort
        entry = self.ledger.by_imm(imm)
        if entry is None or entry.nonce != nonce:
            # An earlier generation of the slot, or a stranger: counts toward nothing.
            log.info("ignoring an abort for immediate %#x that no live reservation carries", imm)
            return
        job = self.jobs.get(entry.request_id)
        self.metrics.push_aborts.inc()
        if job is not None and entry.state in WAITING:
            # The prefiller sends it once none of its writes is in flight: nothing can land.
            self.end(job, RequestState.FAILED, writer_stopped=True, reason=Rejection.PUSH_FAILED,
                     error=f"request {entry.request_id}: the prefiller aborted the push: {why}")
        else:
            self.writer_stopped(entry.request_id)

    def _walk_deadlines(self) -> None:
        engine = self.core.engine
        for entry in self.ledger.entries():
            if entry.state is Res.RESERVED and engine.imm_count(entry.imm) > 0:
                with self._lock:
                    if entry.state is Res.RESERVED:
                        self.ledger.move(entry.request_id, Res.RECEIVING)
                        job = self.jobs.get(entry.request_id)
                        if job is not None:
                            job.first_imm_at = time.monotonic()
        for entry in self.ledger.due():
            job = self.jobs.get(entry.request_id)
            if entry.state in WAITING and job is not None:
                self.metrics.reservations_expired.inc()
                self.end(job, RequestState.FAILED, reason=Rejection.KV_TIMEOUT,
                         error=f"request {entry.request_id}: not admitted within reservation_ttl_s="
                               f"{self.settings.reservation_ttl_s} s ({engine.imm_count(entry.imm)} of "
                               f"{job.expected_count} writes landed); pages fenced")
            elif entry.state is Res.FENCED:
                with self._lock:
                    if entry.state is Res.FENCED:
                        # fence_timeout_s exceeds every prefiller's transfer deadline: no
                        # write of this reservation can still land.
                        self.ledger.move(entry.request_id, Res.FREE, "fence_timeout_s passed")
                        self.jobs.pop(entry.request_id, None)
                self._update_gauges()

    # -- load -------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        """Load fields published in etcd and /info."""
        with self._lock:
            running = sum(1 for j in self.jobs.values() if j.state is RequestState.RUNNING)
            waiting = self.ledger.count(*WAITING)
        return {
            "total_pages": self.allocator.total_pages,
            "free_pages": self.allocator.free_pages,
            "running": running,
            "queue_depth": waiting,
        }

    def in_flight(self) -> int:
        """Reservations a caller may still use: waiting for KV or decoding. Fenced ones do
        not count: they only wait for a deadline, and a drain must not wait for it."""
        return self.ledger.count(Res.RESERVED, Res.RECEIVING, Res.ADMITTED)

    def _update_gauges(self) -> None:
        load = self.load()
        self.metrics.set_pages(self.allocator.total_pages, self.allocator.free_pages)
        self.metrics.pages_reserved.set(self.allocator.reserved_pages)
        self.metrics.pages_fenced.set(self.allocator.quarantined_pages)
        self.metrics.requests_running.set(load["running"])
        self.metrics.requests_waiting_for_kv.set(load["queue_depth"])
        counters = self.allocator.prefix_counters()
        if counters is not None:
            self.metrics.prefix.update(counters.held_pages, counters.evictions)
        self.core.update_load(**load)

    def stop_batch_loop(self) -> None:
        """Asks the batch loop to end after its current step."""
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Stops the batch loop, the reaper and the engine."""
        self.stop_batch_loop()
        self._batch_thread.join(timeout=5)
        self._reaper_thread.join(timeout=self.settings.reaper_interval_s + 5)
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
