"""The decode worker: reserves KV pages, admits a request when its ImmCounter says every
pushed write landed, and decodes with continuous batching. `DecodeService` is the glue
(threads, batching, typed errors for HTTP) over small parts, in the order a request meets
them:

- `reservation_issuer`: /reserve checks the request, opens its ledger entry
  (`handoff.decode_ledger`, the one record of where the reservation is: RESERVED,
  RECEIVING, ADMITTED, FAILED, CANCELLED, FENCED, FREE) and its `job.DecodeJob` (what the
  ledger does not know: the decode phase, tokens, the /generate queue), scopes what a
  prefiller may write and issues the `KVReservation`.
- `push_admission` (with `landed_kv_check`): /generate waits for the count, checks the
  landed KV end to end (`kv_integrity`: off, sampled, full), admits; `local_prefill` is the
  colocated path.
- `batch_loop`: the batch thread. `reaper`: the thread for aborts, first immediates, the
  TTL and fence deadlines. `job_table`: requests by id, the hand-over between them, and
  `end`, the one way a request ends (FREE, or FENCED while a prefiller may still write).

Pages of a request that ended while a prefiller may still write into them go FENCED and
come back only once the prefiller confirmed it stopped (its abort message, or the router
relaying its /cancel) or after `fence_timeout_s`. Its registration stays open until that
word too (`cancel_confirm_timeout_s` at most, job_table): revoked under a write still
queued, it would cost other requests' writes on the same connection.

With `prefix_cache` on (the default) the decoder keeps finished requests' full prompt
pages (kv.prefix_cache, owned by the page allocator): /reserve starts the block table with
the pages of the longest held prefix (read-only for the request, pinned until its
reservation is FREE) and asks the prefiller for the rest only (the reservation's
`first_page`, its `cached_tokens`); /generate_local computes only the tokens after that
prefix. A request's full prompt pages go to the cache once its KV is known complete
(admission, or the end of its local prefill), never from a request whose pages a write
may still reach; when it finishes, so do the full pages of its generated tokens (a chat's
next turn repeats them). `/prefix_index` reports the held hashes to routers.

Threads: the HTTP event loop (and its executor) runs /reserve, admission and cancels; the
batch thread owns the running batch; the reaper owns the waiting nobody else does. They
meet in `JobTable`, whose one lock is held for bookkeeping only (see job_table).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from pydantic import Field, model_validator

from kvxfer.handoff.decode_ledger import ReservationLedger, cancel_confirm_bound_s, cancel_confirm_overrun
from kvxfer.handoff.reservation_state import WAITING
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.integrity import KVIntegrity
from kvxfer.kv.page_allocator import PageAllocator
from kvxfer.kv.prefix_cache import PrefixCache
from kvxfer.kv.protocol import MAX_SLOTS, KVReservation
from kvxfer.metrics import DecodeMetrics
from kvxfer.model.tokenizer import ByteTokenizer
from kvxfer.registry.signing import checksum_table_key_of
from kvxfer.workers.decode.batch_loop import DecodeBatchLoop
from kvxfer.workers.decode.job import DecodeJob, DecodePhase
from kvxfer.workers.decode.job_table import JobTable
from kvxfer.workers.decode.landed_kv_check import LandedKVCheck
from kvxfer.workers.decode.local_prefill import prefill_locally
from kvxfer.workers.decode.mailbox import DecodeMailbox
from kvxfer.workers.decode.push_admission import PushAdmission
from kvxfer.workers.decode.reaper import DecodeReaper
from kvxfer.workers.decode.reservation_issuer import KVRegistration, ReservationIssuer, ReservationScopes
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore, WorkerSettings


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
    cancel_confirm_timeout_s: float = Field(
        10.0, ge=0, description="after a reservation ends while its prefiller may still write (/cancel, the TTL, a "
        "failed KV wait or check), how long its registration stays open for the prefiller's word that none of its "
        "writes is in flight (the router relaying its /cancel answer, or its abort message); revoked then, or at "
        "that word, and the pages fenced to fence_timeout_s as before. Revoking under a live write is what this "
        "avoids: libfabric's net provider refuses the next op with a revoked key by dropping the whole "
        "connection, so every write queued behind it to this decoder, other requests' too, fails. A live "
        "prefiller answers once its writes of the request drained, and each of those completes or fails within "
        "its transfer_timeout_s (10 s by default), hence 10 s. It leaves revoke_grace_s of fence_timeout_s after "
        "it: the default is cut to fence_timeout_s - revoke_grace_s where that is shorter; a value set above it "
        "is an error. The pages stay fenced all along, so a late write lands only in them",
    )
    revoke_grace_s: float = Field(
        1.0, ge=0, description="how much of fence_timeout_s a reservation revoked at cancel_confirm_timeout_s "
        "keeps its pages after the revoke: the rest of a write already under way then, which the revoke does not "
        "stop (net checks a write's key once, at its header, and copies the rest as it comes)",
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
        "registration of its pages and mailbox slot with fresh random keys, closed at admission, or once a "
        "failed, cancelled or expired one's prefiller confirms it stopped writing (cancel_confirm_timeout_s at "
        "most); 'whole_cache': every reservation hands out the one whole-cache descriptor (cheaper on RDMA NICs, "
        "where a registration pins memory; see benchmarks/bench_registration.py)",
    )
    kv_receipt_digest: bool = Field(
        False, description="put kv.integrity.prompt_kv_digest of the landed prompt KV in the receipt (one more "
        "read of it: for tests that compare with the colocated reference, and audits)",
    )

    @model_validator(mode="after")
    def _confirm_bound_inside_the_fence(self) -> DecodeSettings:
        overrun = cancel_confirm_overrun(self.cancel_confirm_timeout_s, self.fence_timeout_s, self.revoke_grace_s,
                                         "revoke_grace_s")
        if "cancel_confirm_timeout_s" in self.model_fields_set and overrun:
            raise ValueError(overrun)
        return self

    @property
    def cancel_confirm_bound_s(self) -> float:
        """How long an ended reservation's registration waits for the prefiller's word:
        cancel_confirm_timeout_s, cut so that revoke_grace_s of the fence is left after it."""
        return cancel_confirm_bound_s(self.cancel_confirm_timeout_s, self.fence_timeout_s, self.revoke_grace_s)


class DecodeService:
    """A decode worker without its HTTP face (tests drive it directly): wires the parts
    together, owns their threads and answers the HTTP layer with typed errors."""

    def __init__(self, settings: DecodeSettings) -> None:
        self.settings = settings
        self.core = WorkerCore(settings, "decode")
        self.tokenizer = ByteTokenizer()
        self.metrics = DecodeMetrics(self.core.metrics_registry)
        self.allocator = PageAllocator(settings.num_pages, self.core.config.block_size,
                                       prefix_cache=PrefixCache() if settings.prefix_cache else None)
        self.mailbox_slots = DecodeMailbox.register(self.core, settings.max_requests, settings.num_pages)
        self.scopes = ReservationScopes(self.core, self.mailbox_slots, settings.kv_registration, self.metrics)
        self.ledger = ReservationLedger(
            self.allocator,
            settings.max_requests,
            reservation_ttl_s=settings.reservation_ttl_s,
            fence_timeout_s=settings.fence_timeout_s,
            cancel_confirm_timeout_s=settings.cancel_confirm_bound_s,
            forget_imm=self.core.engine.reset_imm,
            close_writes=self.scopes.revoke,
        )
        self.table = JobTable(self.ledger, self.allocator, model_name=self.core.config.name,
                              max_requests=settings.max_requests, reservation_ttl_s=settings.reservation_ttl_s,
                              on_change=self._update_gauges)
        # With a cluster key, only checksum tables tagged under it are believed (kv.integrity).
        table_key = checksum_table_key_of(settings.cluster_key_file)
        self.issuer = ReservationIssuer(
            self.core, self.table, self.scopes, self.mailbox_slots, self.metrics,
            max_reservations_per_caller=settings.max_reservations_per_caller, retry_after_s=settings.retry_after_s,
            fence_timeout_s=settings.fence_timeout_s, integrity=settings.kv_integrity,
            tagged_tables=table_key is not None,
        )
        check = LandedKVCheck(self.core, self.mailbox_slots, self.metrics, mode=settings.kv_integrity,
                              sample_rate=settings.kv_integrity_sample_rate, table_key=table_key,
                              receipt_digest=settings.kv_receipt_digest)
        self.admission = PushAdmission(self.table, self.core.engine, check, self.metrics)
        self._batch_loop = DecodeBatchLoop(self.table, self.core.model, self.core.cache, settings.max_batch)
        self._reaper = DecodeReaper(self.table, self.core.engine, self.metrics,
                                    reaper_interval_s=settings.reaper_interval_s,
                                    reservation_ttl_s=settings.reservation_ttl_s)
        self._batch_loop.start()
        self._reaper.start()
        self._update_gauges()

    # -- what tests and tools read ----------------------------------------------------------
    @property
    def jobs(self) -> dict[str, DecodeJob]:
        """Requests by id (the table's; read-only use)."""
        return self.table.jobs

    @property
    def mailbox(self) -> np.ndarray:
        """The mailbox buffer (one slot per reservation)."""
        return self.mailbox_slots.buffer

    @property
    def mailbox_slot_stride(self) -> int:
        return self.mailbox_slots.slot_stride

    # -- requests -----------------------------------------------------------------------
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
        if self.core.draining:
            raise RequestRejected(Rejection.DRAINING, "worker is draining", request_id)
        reservation = self.issuer.issue(request_id, prompt_tokens, max_tokens, caller, prefill_address, prompt)
        self._update_gauges()
        return reservation

    def job(self, request_id: str, caller: str = "anonymous") -> DecodeJob:
        """The job of a request id reserved by `caller`; `Rejection.UNKNOWN_REQUEST` if there is
        none (another caller's id is unknown to this one: no oracle for what others hold)."""
        return self.table.job(request_id, caller)

    async def wait_for_kv(self, job: DecodeJob, timeout_s: float) -> None:
        """Waits until every write of the job's push landed (or the request ends: abort,
        TTL, cancel), checks the landed KV and starts decoding (push_admission)."""
        await self.admission.wait_for_kv(job, timeout_s)

    async def prefill_locally(self, job: DecodeJob, prompt: list[int]) -> None:
        """Colocated path: prefill on this worker into the reserved pages, then decode."""
        await prefill_locally(job, prompt, table=self.table, core=self.core,
                              chunk_tokens=self.settings.prefill_chunk_tokens)

    def end(self, job: DecodeJob, phase: DecodePhase, **kw: Any) -> None:
        """Ends a job once (see `JobTable.end`)."""
        self.table.end(job, phase, **kw)

    def writer_stopped(self, request_id: str) -> bool:
        """The prefiller confirmed none of the request's writes can land: a fenced
        reservation's pages go back at once. True if this freed it."""
        return self.table.writer_stopped(request_id)

    def cancel(self, request_id: str, prefill_stopped: bool = False, caller: str = "anonymous") -> dict[str, Any]:
        """Cancels a request. With `prefill_stopped` (the router relays the prefiller's
        `in_flight: false`) its pages are freed at once, else they stay fenced until the
        prefiller's word or `fence_timeout_s`."""
        return self.table.cancel(request_id, prefill_stopped, caller)

    # -- load -------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        """Load fields published in etcd and /info."""
        return {
            "total_pages": self.allocator.total_pages,
            "free_pages": self.allocator.free_pages,
            "running": self.table.running_count(),
            "queue_depth": self.ledger.count(*WAITING),
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

    # -- threads ------------------------------------------------------------------------
    def stop_threads(self) -> None:
        """Asks the batch loop (after its current step) and the reaper to end."""
        self._batch_loop.stop()
        self._reaper.stop()

    def close(self) -> None:
        """Stops the batch loop, the reaper and the engine."""
        self.stop_threads()
        self._batch_loop.join(timeout_s=5)
        self._reaper.join(timeout_s=self.settings.reaper_interval_s + 5)
        self.core.close()
