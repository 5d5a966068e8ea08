"""Decode side of the worker half: reserve, admit on the ImmCounter, fence before freeing.

Each load vLLM parks in WAITING_FOR_REMOTE_KVS becomes a `DecodeLoad`:

    RESERVED --every expected page landed--> ADMITTED (reported loaded)
        |--load_timeout_s passed, or load_stall_timeout_s without a new write,
        |  or vLLM aborted the request--------------------> FENCING (cancel sent)
        |--the prefiller's abort (no write in flight)-------> FAILED
    FENCING --prefiller confirms stopped, or fence_timeout_s passed--> FAILED (reported)

A load is reported to vLLM (finished_recving, plus failed_recving when it failed) only in
ADMITTED or FAILED: vLLM frees or recomputes the blocks after that, and by then no write for
them can land: the prefiller said none is in flight, or its deadline and the fence passed.
A prefiller frozen longer than `fence_timeout_s` that wakes up refuses to post, because
its own `transfer_timeout_s` is shorter than the fence (checked on both sides).

Where `kv_integrity` is on, a load is admitted only once every write landed and the
prefiller's checksum table arrived (a control message, tagged where the cluster has a key:
kv_checksums.py) and the landed blocks' CRC-32C equal it (every block with `full`, a share
with `sampled`); otherwise it fails (FENCING, then FAILED) with an error naming the request,
layer and block, and vLLM fails or recomputes it (`kv_load_failure_policy`). Tests read what
a load reserved and admitted through the `ConnectorHooks` given at construction.

Under tensor parallelism each decode rank runs its own receiver. A rank whose heads come
from one prefill rank of the same size reserves there as above. Otherwise its load has one
part per prefill rank it draws heads from (`tensor_parallel.head_sources`), each a
reservation of its own (slot, immediate, nonce, scope, checksum table over its head slice)
sent as a sliced reservation (sliced_reservation.py); the request is admitted once every
part is, and fails (the other parts fenced) when one part fails.

The immediate of a reservation is a slot and a generation (`kvxfer.kv.protocol`): a slot
comes back only with a new generation, so a late write of an earlier holder never counts.

With `kv_registration: per_reservation` (the default) a load hands its prefiller a
registration of its own blocks only, with fresh random keys, and credits its immediate only
from the prefiller it names (where the provider can tell a sender). Both are revoked the
moment the load leaves RESERVED: a stolen descriptor writes nothing outside the load's
blocks, and nothing at all once the load was admitted, cancelled or timed out.

A prefiller that died is noticed in about a second, not at load_stall_timeout_s plus
fence_timeout_s: a load with no new write for `prefiller_probe_after_s` gets its prefiller
probed (one probe message in flight per prefiller address, however many loads wait on it).
A probe, or a cancel, that fails as unreachable or is not delivered within
`prefiller_probe_timeout_s` means the process is gone (a live one, even a frozen one, has
its kernel take the bytes at once): every load on it goes to FENCING, and with
per_reservation registration it is freed after `dead_prefiller_fence_s`, not
fence_timeout_s. That is safe because no write for it can land any more: the process that
could post one is gone, and the load's registration was revoked when it left RESERVED, so
even a write some other holder of the descriptor posts fails at the writer; the short grace
only lets this decoder's progress thread finish bytes it already received. With the
whole_cache registration nothing is revoked, so such a load keeps the full fence.
"""

from __future__ import annotations

import enum
import logging
import random
import secrets
import time
from dataclasses import dataclass, field, replace

from kvxfer.errors import TransferError
from kvxfer.kv.integrity import KVIntegrity, KVIntegrityError
from kvxfer.handoff.push_monitor import peer_unreachable
from kvxfer.kv.protocol import (
    KVReservation,
    encode_cancel,
    encode_imm,
    encode_probe,
    encode_reservation_message,
    generations_per_slot,
)
from kvxfer.handoff.reservation_scope import ReservationScope
from kvxfer.registry.signing import checksum_table_key_of
from kvxfer.transfer.engine import RegisteredMemory, Transfer, TransferEngine

from .cache_paths import DirectLanding, StagedLanding
from .connector_hooks import NO_CONNECTOR_HOOKS, ConnectorHooks
from .connector_metrics import ConnectorMetrics
from .kv_checksums import LoadChecksums, TablePart
from .kv_region import KVRegion
from .metadata import LoadSpec
from .settings import ConnectorSettings
from .sliced_reservation import SliceTarget, encode_sliced_reservation

log = logging.getLogger(__name__)


class LoadState(enum.Enum):
    """Where one reservation is."""

    RESERVED = "reserved"
    ADMITTED = "admitted"
    FENCING = "fencing"
    FAILED = "failed"


@dataclass
class DecodeLoad:
    """One request's reservation on this decoder."""

    spec: LoadSpec
    reservation: KVReservation | None
    slot: int
    sent_at: float
    deadline: float  # load_timeout_s after sent_at: the most a load may take
    stall_deadline: float = 0.0  # load_stall_timeout_s after the last write landed (or sent_at)
    landed: int = 0  # writes counted at the last poll
    state: LoadState = LoadState.RESERVED
    reason: str = ""
    fence_deadline: float = 0.0
    vllm_aborted: bool = False
    scope: ReservationScope | None = None  # its registration and immediate binding, until revoked
    pages: list[int] = field(default_factory=list)  # what the prefiller writes: its blocks, or landing blocks
    checksums: LoadChecksums | None = None  # the prefiller's table as it arrives (kv_integrity on)
    target: SliceTarget | None = None  # the heads this part takes from its prefill rank (None: whole blocks)
    sent: Transfer | None = None  # the reservation message, until it is known to have left
    cancel_sent: Transfer | None = None  # the cancel message (FENCING), until it is known to have left
    cancel_sent_at: float = 0.0
    prefiller_gone: bool = False  # its fence was cut to dead_prefiller_fence_s

    @property
    def heads(self) -> tuple[int, int] | None:
        """This part's heads of the landed blocks ([first, end), local); None: every head."""
        return self.target.slice.dst_heads if self.target is not None else None


class KVReceiver:
    """Reservations and admissions of one decode instance; called from vLLM's worker thread only."""

    def __init__(self, settings: ConnectorSettings, engine: TransferEngine, region: KVRegion,
                 memory: RegisteredMemory | None, metrics: ConnectorMetrics,
                 landing: DirectLanding | StagedLanding | None = None,
                 hooks: ConnectorHooks = NO_CONNECTOR_HOOKS) -> None:
        self.settings = settings
        self._hooks = hooks
        self._table_key = checksum_table_key_of(settings.cluster_key_file)
        self._sample_rng = random.Random()
        self.engine = engine
        self.region = region
        self.memory = memory
        #: Where the prefiller's writes land: the request's own blocks (a host cache
        #: registered as `memory`), or pinned landing blocks copied to a device cache.
        self.landing = landing or (DirectLanding(memory, region.geometry) if memory is not None
                                   else StagedLanding(engine, region))
        self.metrics = metrics
        slots = settings.max_concurrent_loads
        self._generations = generations_per_slot(slots)
        self._generation = [0] * slots
        self._free_slots = list(range(slots - 1, -1, -1))
        self._loads: dict[str, list[DecodeLoad]] = {}  # request id -> its parts (one per prefill rank)
        self._by_imm: dict[int, DecodeLoad] = {}
        #: prefill engine address -> (its probe in flight or last sent, when it was sent)
        self._probes: dict[bytes, tuple[Transfer | None, float]] = {}
        metrics.foreign_immediates.set_function(lambda: float(engine.engine_stats().get("imm_foreign_dropped", 0)))

    # ---- starting and cancelling ----------------------------------------------------------

    def refuse(self, spec: LoadSpec, reason_label: str, why: str) -> None:
        """Fail `spec` before anything is reserved or sent (reported failed at the next poll)."""
        now = time.monotonic()
        load = DecodeLoad(spec, None, -1, now, now)
        self._loads[spec.request_id] = [load]
        self._to_failed(load, reason_label, why)

    def start(self, spec: LoadSpec, parts: list[tuple[bytes, SliceTarget | None]] | None = None) -> None:
        """Reserve `spec.block_ids` and send the reservation to the prefiller; under
        tensor parallelism, one reservation to each (prefill rank address, head slice) of
        `parts` (None: whole blocks from `spec.prefill_engine`)."""
        parts = parts or [(spec.prefill_engine, None)]
        if len(self._free_slots) < len(parts):
            self.refuse(spec, "no_slot", f"{self.settings.max_concurrent_loads} loads already in flight "
                        "(max_concurrent_loads)")
            return
        if len(parts) > 1 and not isinstance(self.landing, DirectLanding):
            self.refuse(spec, "tp_mismatch", "a device cache takes a request's KV from one prefill rank only; this "
                        f"decode rank's heads are on {len(parts)} (use equal tensor parallel sizes)")
            return
        pages = self.landing.reserve(list(spec.block_ids))
        if pages is None:
            self.refuse(spec, "no_landing_room", f"no room for {len(spec.block_ids)} blocks in the landing "
                        "cache (device caches land in pinned host blocks first)")
            return
        self._loads[spec.request_id] = []
        for address, target in parts:
            self._start_part(replace(spec, prefill_engine=address), pages, target)

    def _start_part(self, spec: LoadSpec, pages: list[int], target: SliceTarget | None) -> None:
        now = time.monotonic()
        slot = self._free_slots.pop()
        imm = encode_imm(slot, self._generation[slot])
        load = DecodeLoad(spec, None, slot, now, now + self.settings.load_timeout_s,
                          stall_deadline=now + self.settings.load_stall_timeout_s, pages=pages, target=target)
        self._loads[spec.request_id].append(load)
        try:
            descriptor = self._open_scope(load, imm)
        except Exception as exc:  # a malformed prefiller address, a registration the provider refused
            self._to_failed(load, "registration_failed", f"scoping the reservation failed: {exc}")
            return
        reservation = KVReservation(
            request_id=spec.transfer_id, descriptor=descriptor, pages=list(pages),
            num_pages=self.landing.geometry.num_blocks, imm=imm, expected_count=self.region.num_layers * len(pages),
            kv_layout=self.region.signature, meta_descriptor=b"", meta_offset=0,
            nonce=secrets.randbits(63), fence_timeout_s=self.settings.fence_timeout_s,
            first_page=spec.first_page, mailbox=False,
            checksums=self.settings.kv_integrity is not KVIntegrity.OFF,
            checksum_tag=self.settings.kv_integrity is not KVIntegrity.OFF and self._table_key is not None,
        )
        load.reservation = reservation
        if reservation.checksums:
            load.checksums = LoadChecksums(spec.request_id, reservation.nonce, self.region.num_layers,
                                           len(pages), self._table_key)
        self._by_imm[imm] = load
        self.metrics.loads_in_flight.inc()  # _release decrements it, whatever happens next
        self._hooks.load_reserved(self.region, load)
        message = (encode_reservation_message(reservation) if target is None
                   else encode_sliced_reservation(target, reservation))
        try:
            load.sent = self.engine.send(spec.prefill_engine, message)
        except Exception as exc:
            # Nothing reached the prefiller, so no write can land: fail at once.
            self._to_failed(load, "reservation_send_failed", f"sending the reservation to the prefiller failed: {exc}")

    def _open_scope(self, load: DecodeLoad, imm: int) -> bytes:
        """Opens the load's scope (see `ReservationScope`): its own registration of its
        blocks (per_reservation), and its immediate bound to the prefiller it names. Returns
        the descriptor the load hands out."""
        per_reservation = self.settings.kv_registration == "per_reservation"
        parts = [(self.landing.memory, self.landing.geometry.windows(load.pages))] if per_reservation else []
        load.scope = ReservationScope.open(self.engine, f"transfer {load.spec.transfer_id}", imm,
                                           load.spec.prefill_engine, parts)
        if not per_reservation:
            return self.landing.memory.descriptor
        self.metrics.registrations.inc()
        self.metrics.registrations_open.inc()
        return load.scope.descriptors[0]

    def _revoke(self, load: DecodeLoad) -> None:
        """Revokes the load's scope (idempotent): from now on a write with its descriptor
        fails at the writer and lands nothing."""
        if load.scope is None:
            return
        scope, load.scope = load.scope, None
        if scope.windows:
            self.metrics.registrations_open.dec()
        scope.revoke()

    def cancel(self, request_id: str, why: str) -> None:
        """vLLM finished the request (aborted) while its load is pending: fence, then free."""
        for load in self._loads.get(request_id, ()):
            load.vllm_aborted = True
            if load.state is LoadState.RESERVED:
                self._to_fencing(load, "cancelled", why)

    def _to_fencing(self, load: DecodeLoad, reason_label: str, why: str, send_cancel: bool = True) -> None:
        res = load.reservation
        assert res is not None
        self._revoke(load)
        load.state = LoadState.FENCING
        load.reason = why
        load.fence_deadline = time.monotonic() + self.settings.fence_timeout_s
        self.metrics.failures.labels(side="decode", reason=reason_label).inc()
        log.warning("transfer %s (request %s): %s; waiting for the prefiller to confirm no write is in flight",
                    load.spec.transfer_id, load.spec.request_id, why)
        if not send_cancel:
            return
        try:
            load.cancel_sent = self.engine.send(load.spec.prefill_engine, encode_cancel(res.imm, res.nonce, why))
            load.cancel_sent_at = time.monotonic()
        except Exception as exc:  # a dead prefiller: the fence deadline covers it
            log.info("transfer %s: cancel not delivered: %s", load.spec.transfer_id, exc)

    # ---- a prefiller that is gone ---------------------------------------------------------

    def _probe(self, address: bytes, now: float) -> None:
        """Sends `address` a probe unless one is in flight or was sent under
        prefiller_probe_after_s ago (many loads share one prefiller)."""
        probe, sent_at = self._probes.get(address, (None, float("-inf")))
        if probe is not None or now - sent_at < self.settings.prefiller_probe_after_s:
            return
        try:
            self._probes[address] = (self.engine.send(address, encode_probe()), now)
        except Exception as exc:  # a malformed address: the load's own deadlines cover it
            log.info("probing a prefiller failed: %s", exc)
            self._probes[address] = (None, now)

    def _gone(self, sent: Transfer, sent_at: float, now: float) -> str:
        """Why the peer `sent` went to is gone ("" while it may be alive): the message
        failed as unreachable, or is not delivered within prefiller_probe_timeout_s."""
        if not sent.done():
            if now - sent_at > self.settings.prefiller_probe_timeout_s:
                return f"a message to it was not delivered within prefiller_probe_timeout_s=" \
                       f"{self.settings.prefiller_probe_timeout_s}"
            return ""
        try:
            sent.wait(0)
        except TransferError as exc:
            if peer_unreachable(exc):  # a TransferTimeout is not: a slow peer times out too
                return f"it is unreachable ({exc.reason})"
        return ""

    def _check_probes(self, now: float) -> None:
        """Ends the probes whose outcome is known; a gone prefiller fails its loads."""
        for address, (probe, sent_at) in list(self._probes.items()):
            if probe is None:
                if now - sent_at >= self.settings.prefiller_probe_after_s:
                    del self._probes[address]  # no longer paces anything: forget the prefiller
                continue
            gone = self._gone(probe, sent_at, now)
            if gone:
                del self._probes[address]
                self._prefiller_gone(address, f"the prefiller process is gone: {gone}", now)
            elif probe.done():
                self._probes[address] = (None, sent_at)

    def _prefiller_gone(self, address: bytes, why: str, now: float) -> None:
        """Every load waiting on the prefiller at `address` fails, freed after the short
        dead_prefiller_fence_s where its registration was its own (see the module docstring)."""
        for parts in self._loads.values():
            for load in parts:
                if load.spec.prefill_engine != address:
                    continue
                if load.state is LoadState.RESERVED and load.reservation is not None:
                    self._to_fencing(load, "prefiller_gone", why, send_cancel=False)
                if load.state is LoadState.FENCING:
                    self._shorten_fence(load, now)

    def _shorten_fence(self, load: DecodeLoad, now: float) -> None:
        if self.settings.kv_registration == "per_reservation":
            load.fence_deadline = min(load.fence_deadline, now + self.settings.dead_prefiller_fence_s)
            load.prefiller_gone = True

    def _to_failed(self, load: DecodeLoad, reason_label: str | None, why: str) -> None:
        if reason_label is not None:
            self.metrics.failures.labels(side="decode", reason=reason_label).inc()
        self._revoke(load)
        load.state = LoadState.FAILED
        load.reason = load.reason or why
        log.warning("transfer %s (request %s): load failed: %s", load.spec.transfer_id, load.spec.request_id, why)

    # ---- from the prefiller ---------------------------------------------------------------

    def on_prefill_stopped(self, imm: int, nonce: int, reason: str) -> None:
        """The prefiller's abort: its push ended early and none of its writes is in flight."""
        load = self._by_imm.get(imm)
        if load is None or load.reservation is None or load.reservation.nonce != nonce:
            self.metrics.dropped_messages.labels(reason="unknown_abort").inc()
            return
        if load.state is LoadState.RESERVED:
            self._to_failed(load, "prefill_aborted", f"the prefiller stopped: {reason}")
        elif load.state is LoadState.FENCING:
            self._to_failed(load, None, load.reason)

    def on_checksum_table(self, part: TablePart) -> None:
        """A part of a prefiller's checksum table; dropped unless it is for a waiting load
        and from its prefiller (its nonce, and with a cluster key its tag)."""
        load = self._by_imm.get(part.imm)
        if load is None or load.checksums is None or load.state is not LoadState.RESERVED:
            self.metrics.dropped_messages.labels(reason="unknown_table").inc()
            return
        refused = load.checksums.accept(part)
        if refused:
            log.warning("transfer %s: dropped a checksum table (%s)", load.spec.transfer_id, refused)
            self.metrics.dropped_messages.labels(reason="bad_table").inc()

    # ---- every step -----------------------------------------------------------------------

    def wait_briefly(self) -> None:
        """On an idle step, block up to idle_wait_ms until any pending load is complete,
        instead of running vLLM's empty steps back to back."""
        wanted = [(ld.reservation.imm, ld.reservation.expected_count) for parts in self._loads.values()
                  for ld in parts if ld.state is LoadState.RESERVED and ld.reservation is not None]
        if not wanted or self.settings.idle_wait_ms <= 0:
            return
        try:
            self.engine.wait_imm_any(wanted, self.settings.idle_wait_ms / 1000.0)
        except TransferError:
            pass

    def poll(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids to report now; failed ones are in both sets."""
        for rid in finished_req_ids:
            if rid in self._loads:
                self.cancel(rid, "the request was aborted on the decode instance")
        now = time.monotonic()
        self._check_probes(now)
        finished: set[str] = set()
        failed: set[str] = set()
        for rid, parts in list(self._loads.items()):
            for load in parts:
                self._poll_part(load, now)
            broken = next((ld for ld in parts if ld.state is LoadState.FAILED), None)
            if broken is not None:
                # One prefill rank's part failed: the request cannot be admitted; fence the rest.
                for load in parts:
                    if load.state is LoadState.RESERVED:
                        self._to_fencing(load, "part_failed", f"another prefill rank's part failed: {broken.reason}")
            if all(ld.state in (LoadState.ADMITTED, LoadState.FAILED) for ld in parts):
                finished.add(rid)
                if broken is None:
                    self._hooks.load_admitted(self.region, parts[0])
                elif not broken.vllm_aborted:
                    failed.add(rid)
                for load in parts:
                    self._release(load)
                del self._loads[rid]
                self.landing.release(parts[0].pages)  # no write for them can land any more
        return finished, failed

    def _poll_part(self, load: DecodeLoad, now: float) -> None:
        """One part's writes, table and deadlines."""
        res = load.reservation
        if load.state is LoadState.RESERVED and load.sent is not None and load.sent.done():
            sent, load.sent = load.sent, None
            try:
                sent.wait(0)
            except TransferError as exc:
                # It never reached the prefiller, so none of its writes can come: fail now,
                # not at load_stall_timeout_s.
                self._to_failed(load, "reservation_send_failed", f"the reservation did not reach the prefiller: {exc}")
        if load.state is LoadState.RESERVED and load.sent is not None:
            gone = self._gone(load.sent, load.sent_at, now)  # not delivered yet: is the prefiller there?
            if gone:
                load.sent = None
                self._prefiller_gone(load.spec.prefill_engine, f"the prefiller process is gone: {gone}", now)
        if load.state is LoadState.RESERVED and res is not None:
            landed = self.engine.imm_count(res.imm)
            if landed > load.landed:  # progress: the prefiller is alive and pushing
                load.landed = landed
                load.stall_deadline = now + self.settings.load_stall_timeout_s
            table_missing = load.checksums is not None and not load.checksums.complete
            if landed >= res.expected_count and not table_missing:
                self._revoke(load)  # every write landed: none may come any more
                try:
                    self.landing.land(load.pages, list(load.spec.block_ids))
                except Exception as exc:  # a device copy that failed: vLLM must not read the blocks
                    self._to_failed(load, "landing_failed", f"copying the landed blocks to the cache failed: {exc}")
                else:
                    self._admit(load, landed, now)
            elif now > load.deadline:
                self._to_fencing(load, "load_timeout", f"not every write landed within load_timeout_s="
                                 f"{self.settings.load_timeout_s} ({landed} of {res.expected_count} pages"
                                 f"{', no checksum table' if table_missing else ''})")
            elif now > load.stall_deadline:
                self._to_fencing(load, "load_stalled", f"no write landed for load_stall_timeout_s="
                                 f"{self.settings.load_stall_timeout_s} ({landed} of {res.expected_count} pages"
                                 f"{', no checksum table' if table_missing else ''})")
            elif load.sent is None and now - (load.stall_deadline - self.settings.load_stall_timeout_s) \
                    >= self.settings.prefiller_probe_after_s:
                self._probe(load.spec.prefill_engine, now)  # silent for a while: is the prefiller still there?
        if load.state is LoadState.FENCING and load.cancel_sent is not None:
            gone = self._gone(load.cancel_sent, load.cancel_sent_at, now)
            if gone:
                load.cancel_sent = None
                log.info("transfer %s: the prefiller process is gone: %s", load.spec.transfer_id, gone)
                self._shorten_fence(load, now)
            elif load.cancel_sent.done():
                load.cancel_sent = None
        if load.state is LoadState.FENCING and now > load.fence_deadline and load.prefiller_gone:
            self._to_failed(load, None, f"{load.reason}; the prefiller process is gone, "
                            f"dead_prefiller_fence_s={self.settings.dead_prefiller_fence_s} passed")
        elif load.state is LoadState.FENCING and now > load.fence_deadline:
            self._to_failed(load, "fence_timeout", f"{load.reason}; the prefiller never confirmed, "
                            f"fence_timeout_s={self.settings.fence_timeout_s} passed")

    def _admit(self, load: DecodeLoad, landed: int, now: float) -> None:
        """Every write landed (in the request's blocks): check them per `kv_integrity`,
        then ADMITTED, or FENCING on a failed check (what landed is not what was meant)."""
        res = load.reservation
        assert res is not None
        mode = self.settings.kv_integrity
        try:
            if mode is not KVIntegrity.OFF:
                if landed > res.expected_count:
                    raise KVIntegrityError(load.spec.request_id, "write_overcount", f"{landed} writes counted, the "
                                           f"reservation expects {res.expected_count}: a page was written twice")
                assert load.checksums is not None
                t0 = time.perf_counter()
                verification = load.checksums.verify(self.region, list(load.spec.block_ids), res.first_page, mode,
                                                     self.settings.kv_integrity_sample_rate, self._sample_rng,
                                                     load.heads)
                self.metrics.pages_verified.inc(verification.checked)
                self.metrics.verify_seconds.observe(time.perf_counter() - t0)
        except KVIntegrityError as exc:
            self.metrics.integrity_failures.labels(reason=exc.reason).inc()
            self._to_fencing(load, "integrity", str(exc))
            return
        load.state = LoadState.ADMITTED
        self.metrics.admission_wait.observe(now - load.sent_at)
        self.metrics.pages_received.inc(res.expected_count)

    def _release(self, load: DecodeLoad) -> None:
        self._revoke(load)
        if load.reservation is not None:
            self._by_imm.pop(load.reservation.imm, None)
            # No write for this immediate can land any more: forget its count, and give the
            # slot a new generation so the value is not reused soon.
            self.engine.reset_imm(load.reservation.imm)
            self.metrics.loads_in_flight.dec()
        if load.slot >= 0:
            self._generation[load.slot] = (self._generation[load.slot] + 1) % self._generations
            self._free_slots.append(load.slot)

    def failure(self, request_id: str) -> str:
        """Why `request_id`'s load failed or is being fenced ("" while it is fine, or unknown)."""
        return next((ld.reason for ld in self._loads.get(request_id, ()) if ld.reason), "")

    @property
    def pending(self) -> int:
        """Loads not yet reported to vLLM."""
        return len(self._loads)
