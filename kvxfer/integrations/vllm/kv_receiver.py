"""Decode side of the worker half: reserve, admit on the ImmCounter, fence before freeing.

Each load vLLM parks in WAITING_FOR_REMOTE_KVS becomes a `DecodeLoad` per prefill rank it
draws from, each one entry of the hand-off's `ReservationLedger` (kvxfer/handoff/,
the builtin decoder's state machine; docs/architecture.md, "Reservation states"):

    RESERVED --first write counted--> RECEIVING
    RESERVED | RECEIVING --every expected page landed and checked--> ADMITTED
        |--load_timeout_s passed, or load_stall_timeout_s without a new write, a failed
        |  check, or vLLM aborted the request--> FAILED | CANCELLED --> FENCED (cancel sent,
        |  registration kept open for the prefiller's word, cancel_confirm_timeout_s at most)
        |--the prefiller's abort (no write in flight)--> FAILED --> FREE
    FENCED --prefiller confirms stopped, or fence_timeout_s passed--> FREE
    ADMITTED --reported to vLLM--> FREE

A load is reported to vLLM (finished_recving, plus failed_recving when it failed) only once
each of its parts is ADMITTED or FREE: vLLM frees or recomputes the blocks after that, and
by then no write for them can land: every write landed, or the prefiller said none is in
flight, or its deadline and the fence passed. Its pages come from `LoadPages`, the ledger's
page source here: the request's own blocks, or landing blocks for them (device caches).
A prefiller frozen longer than `fence_timeout_s` that wakes up refuses to post, because
its own `transfer_timeout_s` is shorter than the fence (checked on both sides). Not
covered: the rest of an op it was sending when it froze still lands when it wakes (with
per_reservation at most that one op, the next one's header refused: measured in
tests/integrations/test_kv_revoked_write_in_progress.py), however long the fence was,
unless it was declared gone and its connections severed (below).

Where `kv_integrity` is on, a load is admitted only once every write landed and the
prefiller's checksum table arrived (a control message, tagged where the cluster has a key:
kv_checksums.py) and the landed blocks' CRC-32C equal it (every block with `full`, a share
with `sampled`), the step the builtin decoder runs too (`handoff.admission.check_landed`,
which also fails a count above the expected one, whatever `kv_integrity` says); otherwise it
fails (FAILED, fenced, then reported) with an error naming the request, layer and block, and
vLLM fails or recomputes it (`kv_load_failure_policy`). Tests read what
a load reserved and admitted through the `ConnectorHooks` given at construction.

Under tensor parallelism each decode rank runs its own receiver. A rank whose heads come
from one prefill rank of the same size reserves there as above. Otherwise its load has one
part per prefill rank it draws heads from (`tensor_parallel.head_sources`), each a
reservation of its own (slot, immediate, nonce, scope, checksum table over its head slice)
sent as a sliced reservation (sliced_reservation.py); the request is admitted once every
part is, and fails (the other parts fenced) when one part fails. On a device cache the
parts share the request's landing blocks, each landing its heads, and the blocks are copied
to the device once, when every part counted its writes (the landing blocks go back only
when every part handed them back: no write for them can land any more).

With several KV cache groups (vLLM's hybrid manager) the reservation names the decoder's
blocks per group (`group_pages`, -1 where a group keeps no block: a sliding window's pages
before its window; on a device cache the landing block of each), expects one write per
layer per pushed page of the layer's group, and the checksum check compares each layer with
its group's blocks (`LoadChecksums.verify_groups`, after the landing copy); under tensor
parallelism every part's reservation, sliced or not, carries the same `group_pages`, and a
sliced part's check covers its heads only.

The immediate of a reservation is a slot and a generation, handed out by the ledger
(`handoff.immediate_slots`): a slot comes back only with a new generation, so a late write
of an earlier holder never counts.

With `kv_registration: per_reservation` (the default) a load hands its prefiller a
registration of its own blocks only, with fresh random keys, and credits its immediate only
from the prefiller it names (where the provider can tell a sender). Both are revoked the
moment the load is admitted or its prefiller is known to have stopped or be gone; a load
this decoder cancels (a deadline, vLLM's abort, a failed check, a failed sibling part)
keeps them until its prefiller confirms that none of its writes is in flight, or
`cancel_confirm_timeout_s` passes (then revoked, and fenced to fence_timeout_s as before).
Revoking under a write still queued would make the net provider drop the whole connection
at that write's header, failing every write queued behind it to this decoder, other
loads' too; its blocks stay reserved meanwhile, so a late write lands only in them, and
its immediate counts toward nothing (forgotten at FENCED, released before FREE). A stolen
descriptor writes nothing outside the load's blocks, and nothing at all once the load was
reported.

A prefiller that died is noticed in milliseconds, not at load_stall_timeout_s plus
fence_timeout_s. Where the load names the prefiller's liveness port (`LoadSpec.
prefill_liveness`, from its registry record through the router), the receiver holds one
TCP connection to it while loads wait on that prefiller (prefiller_liveness.py) and looks
at it, without blocking, on every poll: the kernel closes a dead process's sockets at
once, so its EOF or reset (or a refused connect) means the process is gone; a frozen
process keeps it open. Under tensor parallelism only prefill rank 0 binds the port, and
every part of a load, also one drawn from rank s>0, names it (worker_side.py): it stands
for the prefill instance, which cannot serve once any rank died (vLLM's engine core shuts
every worker down, rank 0 with them), so its EOF declares gone every prefill rank address
that loads naming it wait on, each revoked and severed as below; whether rank s is dead
yet does not matter, since after that no byte of it can land. Where that gives no signal
(no address, a connect or the listener's HELD byte not there within
liveness_connect_timeout_s), the probes remain: a load with no new write for
`prefiller_probe_after_s` gets its prefiller probed (one probe message in flight per
prefiller address, however many loads wait on it; its reservation not delivered yet
included), and a probe, or a cancel, that fails as unreachable (refused, reset) means the
process is gone. Either way every load on it is fenced, and with per_reservation
registration freed after `dead_prefiller_fence_s`, not fence_timeout_s.

A probe not delivered within `prefiller_probe_timeout_s` is not such a proof: under CPU
overload a live prefiller's probe once took longer, and declaring it gone severed its
connections and cut the other loads it was serving. So a late probe (`_probe_overdue`)
never severs. Where the prefiller is visibly alive (a write of it counted since the probe
was sent, or its liveness connection held) it changes nothing. Where it is proven gone (a
pinned same-host writer whose threads are all exiting) it is a gone prefiller as above.
Otherwise its loads silent since before the probe fail, decided deliberately with the
regular fence: a cancel is sent, and the blocks are freed on the prefiller's word or after
fence_timeout_s, which a live prefiller's own transfer_timeout_s is shorter than; not
after dead_prefiller_fence_s, whose grace assumes a dead writer and, without a sever, a
link's worth of bytes in flight. Over the net provider a message to a killed process is
neither delivered nor failed, so a killed prefiller without a liveness signal (no address,
or its connection never held) and without the same-host proof now keeps its blocks for
fence_timeout_s after the probe's timeout (the trade: a false "gone" costs other loads'
data, a late "gone" only blocks). A cancel not delivered in time proves nothing either:
its load keeps its fence.

No new write for a gone prefiller can start any more: the process that could post
one is gone, and the load's registration was revoked when it stopped waiting, by the
engine's progress thread (the fabric domain's owner) before the revoke returned, so an op
whose header arrives after that is refused (and its connection cut). The op already under
way is not stopped: the provider checked its key at its header and copies the rest as it
arrives, and forgetting the peer (fi_av_remove) does not stop it either (measured over a
200 Mbit/s link: tests/integrations/test_kv_revoked_write_in_progress.py). A killed
writer's kernel keeps sending what it held of that op, at most one op (4 MiB). So, once
every load of the prefiller was revoked, the receiver severs the prefiller's connections
(`TransferEngine.sever_peer`, on the progress thread: each socket connected to its rail
addresses shut down and its receive queue dropped, so the provider reads EOF and drops the
op). Where that proves no byte of it lands any more (net or tcp; no connection our
listener accepted from its host and no reset one with unread bytes, which cannot be told
from another peer's; a connection the provider already closed counts as cut; a same-host
peer, which copies by memcpy with no socket, only once every thread of its process is
exiting or gone, looked at again every dead_writer_recheck_s: TransferEngine.
same_host_writes_ended), its loads are freed at once. In the connector flow the decoder opens the
connection (its reservation is the first message), so that is the usual case. Otherwise
the blocks are freed only once that op can have arrived: `dead_prefiller_fence_s` sizes it
for a 1 Gbit/s link and two lost-segment retransmissions (its description); a slower or
lossier link needs it raised. With the whole_cache registration nothing is revoked, so such
a load keeps the full fence.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Sequence

from kvxfer.errors import TransferError
from kvxfer.handoff.admission import check_landed
from kvxfer.handoff.decode_ledger import DeadlineSetting, LedgerEntry, ReservationLedger
from kvxfer.handoff.push_monitor import peer_unreachable
from kvxfer.handoff.reservation_scope import ReservationScope
from kvxfer.handoff.reservation_state import WAITING
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.integrity import KVIntegrity, KVIntegrityError, Verification
from kvxfer.kv.protocol import KVReservation, encode_cancel, encode_probe, encode_reservation_message
from kvxfer.metrics import ConnectorMetrics
from kvxfer.registry.signing import checksum_table_key_of
from kvxfer.transfer.engine import RegisteredMemory, Transfer, TransferEngine

from .cache_paths import DirectLanding, StagedLanding
from .connector_hooks import NO_CONNECTOR_HOOKS, ConnectorHooks
from .kv_checksums import LoadChecksums, TablePart
from .kv_region import KVRegion
from .metadata import LoadSpec
from .prefiller_liveness import LivenessWatch
from .settings import ConnectorSettings
from .sliced_reservation import SliceTarget, encode_sliced_reservation

log = logging.getLogger(__name__)


class LoadPages:
    """The ledger's page source on a vLLM decoder (`handoff.decode_ledger.PageSource`).

    A load's pages are its request's vLLM blocks, or as many landing blocks (device
    caches), taken once per request by `take` and shared by its parts (one ledger entry per
    prefill rank it draws heads from). A part's pages are handed back (`free`, or
    `confirm_quiesced` after a fence) once no write for it can land; when the last part of
    a request hands them back its landing blocks are free again, and the receiver reports
    the load to vLLM, which then frees or recomputes the blocks. Nothing is held in
    quarantine here: a fenced part's blocks are simply not reported yet.
    """

    def __init__(self, landing: DirectLanding | StagedLanding) -> None:
        self._landing = landing
        self._request_of: dict[str, str] = {}  # ledger key of a part -> its request id
        self._pages: dict[str, list[int]] = {}  # request id -> the pages its prefillers write
        self._holding: dict[str, int] = {}  # request id -> parts that have not handed them back

    def take(self, request_id: str, blocks: list[int], parts: int) -> list[str] | None:
        """Pages for `blocks`, shared by `parts` parts; returns the parts' ledger keys (None:
        no landing room)."""
        pages = self._landing.reserve(blocks)
        if pages is None:
            return None
        keys = [request_id] if parts == 1 else [f"{request_id}#{i}" for i in range(parts)]
        self._request_of.update((key, request_id) for key in keys)
        self._pages[request_id] = pages
        self._holding[request_id] = parts
        return keys

    def reserve(self, request_id: str, num_tokens: int, prefix: Sequence[bytes]) -> list[int]:
        """The pages `take` set aside for this part's request (vLLM chose the blocks, so
        `num_tokens` and `prefix` say nothing more)."""
        return self._pages[self._request_of[request_id]]

    def held_pages(self, request_id: str) -> int:
        return 0  # vLLM's prefix hit is outside the reservation (its first_page)

    def free(self, request_id: str) -> None:
        request = self._request_of.pop(request_id)
        self._holding[request] -= 1
        if not self._holding[request]:
            del self._holding[request]
            self._landing.release(self._pages.pop(request))  # no write for them can land any more

    def release_after_quiesce(self, request_id: str) -> None:
        """Nothing to do: the blocks stay unreported until the fence ends."""

    def confirm_quiesced(self, request_id: str) -> None:
        self.free(request_id)


@dataclass
class DecodeLoad:
    """One part of a request's load on this decoder: the connector's data; where it is in
    the hand-off is its ledger `entry`'s state (None: refused before anything was reserved)."""

    spec: LoadSpec
    entry: LedgerEntry | None
    sent_at: float
    reservation: KVReservation | None = None
    refusal: str = ""  # why it was refused (no entry)
    vllm_aborted: bool = False
    scope: ReservationScope | None = None  # its registration and immediate binding, until revoked
    checksums: LoadChecksums | None = None  # the prefiller's table as it arrives (kv_integrity on)
    target: SliceTarget | None = None  # the heads this part takes from its prefill rank (None: whole blocks)
    sent: Transfer | None = None  # the reservation message, until it is known to have left
    cancel_sent: Transfer | None = None  # the cancel message (fenced), until it is known to have left
    #: Its prefiller is gone and its connections were severed after the revoke: no byte lands.
    writer_severed: bool = False
    #: Every write counted (and its table in): it waits for the landing copy and admission.
    counted: bool = False
    #: The writes counted when it was (its immediate is forgotten once revoked).
    landed: int = 0

    @property
    def pages(self) -> list[int]:
        """What the prefiller writes: the request's blocks, or landing blocks."""
        return self.entry.pages if self.entry is not None else []

    @property
    def reason(self) -> str:
        """Why it failed or is being fenced ("" while it is fine)."""
        return self.entry.reason if self.entry is not None else self.refusal

    @property
    def state(self) -> Res:
        """Its ledger entry's state; FREE for a refused load (nothing reserved, nothing to land).
        Only an admitted part stays in the ledger until the load is reported, so a part FREE
        before that failed."""
        return self.entry.state if self.entry is not None else Res.FREE

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
        self.pages = LoadPages(self.landing)
        self.ledger = ReservationLedger(
            self.pages, settings.max_concurrent_loads, reservation_ttl_s=settings.load_timeout_s,
            fence_timeout_s=settings.fence_timeout_s, stall_timeout_s=settings.load_stall_timeout_s,
            cancel_confirm_timeout_s=settings.cancel_confirm_bound_s,
            forget_imm=engine.reset_imm, close_writes=self._close_writes,
        )
        self._loads: dict[str, list[DecodeLoad]] = {}  # request id -> its parts (one per prefill rank)
        self._parts: dict[str, DecodeLoad] = {}  # ledger key -> part, until reported
        #: prefill engine address -> (its probe in flight or last sent, when it was sent)
        self._probes: dict[bytes, tuple[Transfer | None, float]] = {}
        #: one connection per prefiller liveness address that loads wait on (prefiller_liveness.py)
        self._liveness = LivenessWatch(settings.liveness_connect_timeout_s)
        #: gone same-host prefillers whose threads were not all exiting yet -> when to look again
        self._exiting_writers: dict[bytes, float] = {}
        metrics.foreign_immediates.set_function(lambda: float(engine.engine_stats().get("imm_foreign_dropped", 0)))

    # ---- starting and cancelling ----------------------------------------------------------

    def refuse(self, spec: LoadSpec, reason_label: str, why: str) -> None:
        """Fail `spec` before anything is reserved or sent (reported failed at the next poll)."""
        self._loads[spec.request_id] = [DecodeLoad(spec, None, time.monotonic(), refusal=why)]
        self.metrics.failures.labels(side="decode", reason=reason_label).inc()
        log.warning("transfer %s (request %s): load failed: %s", spec.transfer_id, spec.request_id, why)

    def start(self, spec: LoadSpec, parts: list[tuple[bytes, SliceTarget | None]] | None = None) -> None:
        """Reserve `spec.block_ids` and send the reservation to the prefiller; under
        tensor parallelism, one reservation to each (prefill rank address, head slice) of
        `parts` (None: whole blocks from `spec.prefill_engine`)."""
        parts = parts or [(spec.prefill_engine, None)]
        if self.ledger.free_slots < len(parts):
            self.refuse(spec, "no_slot", f"{self.settings.max_concurrent_loads} loads already in flight "
                        "(max_concurrent_loads)")
            return
        keys = self.pages.take(spec.request_id, list(spec.block_ids), len(parts))
        if keys is None:
            self.refuse(spec, "no_landing_room", f"no room for {len(spec.block_ids)} blocks in the landing "
                        "cache (device caches land in pinned host blocks first)")
            return
        self._loads[spec.request_id] = []
        for key, (address, target) in zip(keys, parts):
            self._start_part(key, replace(spec, prefill_engine=address), target)

    def _start_part(self, key: str, spec: LoadSpec, target: SliceTarget | None) -> None:
        now = time.monotonic()
        entry = self.ledger.open(key, 0)
        load = DecodeLoad(spec, entry, now, target=target)
        self._loads[spec.request_id].append(load)
        self._parts[key] = load
        if spec.prefill_liveness:
            self._liveness.watch(spec.prefill_liveness, now)
        self._watch_writer(spec.prefill_engine)
        pages = entry.pages
        try:
            descriptor = self._open_scope(load, entry.imm)
        except Exception as exc:  # a malformed prefiller address, a registration the provider refused
            self._fail(load, "registration_failed", f"scoping the reservation failed: {exc}")
            return
        groups = spec.group_block_ids
        if groups is not None:
            # Each group's blocks as the pages they land in: themselves on a host cache, the
            # landing block set aside for each on a device cache (whole blocks, every slot:
            # a block id names a page of one group only); -1 stays -1 (not pushed).
            page_of = dict(zip(spec.block_ids, pages))
            groups = [[page_of[b] if b >= 0 else -1 for b in ids] for ids in groups]
        expected = (self.region.num_layers * len(pages) if groups is None else
                    sum(sum(1 for b in groups[self.region.group(layer)] if b >= 0)
                        for layer in range(self.region.num_layers)))
        reservation = KVReservation(
            request_id=spec.transfer_id, descriptor=descriptor, pages=list(pages),
            num_pages=self.landing.geometry.num_blocks, imm=entry.imm,
            expected_count=expected, kv_layout=self.region.kv_layout,
            meta_descriptor=b"", meta_offset=0, nonce=entry.nonce, fence_timeout_s=self.settings.fence_timeout_s,
            first_page=spec.first_page, mailbox=False,
            checksums=self.settings.kv_integrity is not KVIntegrity.OFF,
            checksum_tag=self.settings.kv_integrity is not KVIntegrity.OFF and self._table_key is not None,
            group_pages=[list(g) for g in groups] if groups is not None else None,
        )
        load.reservation = reservation
        if reservation.checksums:
            load.checksums = LoadChecksums(spec.request_id, reservation.nonce, self.region.num_layers,
                                           reservation.prompt_pages, self._table_key)
        self.metrics.loads_in_flight.inc()  # _release decrements it, whatever happens next
        self._hooks.load_reserved(self.region, load)
        message = (encode_reservation_message(reservation) if target is None
                   else encode_sliced_reservation(target, reservation))
        try:
            load.sent = self.engine.send(spec.prefill_engine, message)
        except Exception as exc:
            # Nothing reached the prefiller, so no write can land: fail at once.
            self._fail(load, "reservation_send_failed", f"sending the reservation to the prefiller failed: {exc}")

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

    def _close_writes(self, key: str) -> None:
        """The ledger's word that the part stopped waiting for its KV: revoke its scope."""
        load = self._parts.get(key)
        if load is not None:
            self._revoke(load)

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
            if load.state in WAITING:
                self._to_fencing(load, "cancelled", why, outcome=Res.CANCELLED)

    def _to_fencing(self, load: DecodeLoad, reason_label: str, why: str, send_cancel: bool = True,
                    outcome: Res = Res.FAILED) -> None:
        """A waiting part ends without knowing that its writer stopped: FENCED, and the
        prefiller asked to confirm. With a cancel sent its scope stays open until that word
        (or cancel_confirm_timeout_s, or the prefiller is gone): revoking under one of its
        writes still queued would drop the whole connection to it, failing other loads'
        writes queued behind (the ledger's module). Without one (a gone prefiller) it is
        revoked at once."""
        res = load.reservation
        assert res is not None and load.entry is not None
        self.ledger.end(load.entry.request_id, outcome, writer_stopped=False, reason=why, keep_writes_open=send_cancel)
        self.metrics.failures.labels(side="decode", reason=reason_label).inc()
        if not send_cancel:
            return  # the caller frees it, or fences it on, and says so then
        log.warning("transfer %s (request %s): %s; waiting for the prefiller to confirm no write is in flight",
                    load.spec.transfer_id, load.spec.request_id, why)
        try:
            load.cancel_sent = self.engine.send(load.spec.prefill_engine, encode_cancel(res.imm, res.nonce, why))
        except Exception as exc:  # a dead prefiller: the fence deadline covers it
            log.info("transfer %s: cancel not delivered: %s", load.spec.transfer_id, exc)
            self.ledger.revoke_writes(load.entry.request_id)  # no word will come

    def _fail(self, load: DecodeLoad, reason_label: str, why: str) -> None:
        """A waiting part ends and no write for it can land (its prefiller stopped, or never
        got the reservation, or every write landed): FREE at once."""
        assert load.entry is not None
        self.metrics.failures.labels(side="decode", reason=reason_label).inc()
        self.ledger.end(load.entry.request_id, Res.FAILED, writer_stopped=True, reason=why)
        log.warning("transfer %s (request %s): load failed: %s", load.spec.transfer_id, load.spec.request_id, why)

    def _fence_over(self, load: DecodeLoad, reason_label: str | None, why: str) -> None:
        """A fenced part's writer stopped (its word, or the fence deadline passed): FREE."""
        assert load.entry is not None
        if reason_label is not None:
            self.metrics.failures.labels(side="decode", reason=reason_label).inc()
        self.ledger.move(load.entry.request_id, Res.FREE)
        log.warning("transfer %s (request %s): load failed: %s", load.spec.transfer_id, load.spec.request_id, why)

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

    def _gone(self, sent: Transfer) -> str:
        """Why the peer `sent` went to is proven gone ("" while it may be alive): the message
        failed as unreachable (refused, reset: nothing holds its end any more). A message
        not delivered yet proves nothing, however late: a starved host delays a live peer's
        too (`_probe_overdue` judges a late probe)."""
        if not sent.done():
            return ""
        try:
            sent.wait(0)
        except TransferError as exc:
            if peer_unreachable(exc):  # a TransferTimeout is not: a slow peer times out too
                return f"it is unreachable ({exc.reason})"
        return ""

    def _check_probes(self, now: float) -> None:
        """Ends the probes whose outcome is known: a prefiller proven gone fails its loads;
        a probe not delivered within prefiller_probe_timeout_s goes to `_probe_overdue`."""
        for address, (probe, sent_at) in list(self._probes.items()):
            if probe is None:
                if now - sent_at >= self.settings.prefiller_probe_after_s:
                    del self._probes[address]  # no longer paces anything: forget the prefiller
                continue
            gone = self._gone(probe)
            if gone:
                del self._probes[address]
                self._prefiller_gone(address, f"the prefiller process is gone: {gone}", now)
            elif probe.done():
                self._probes[address] = (None, sent_at)
            elif now - sent_at > self.settings.prefiller_probe_timeout_s:
                self._probe_overdue(address, probe, sent_at, now)

    def _probe_overdue(self, address: bytes, probe: Transfer, sent_at: float, now: float) -> None:
        """The probe sent to `address` at `sent_at` is not delivered within
        prefiller_probe_timeout_s. That alone proves nothing (a starved host's kernel or
        progress thread delays a live prefiller's too), so it never severs:
        - the prefiller is visibly alive (a write of it counted since the probe was sent, or
          its liveness connection held): nothing happens, the probe is awaited from now on.
          For a part drawn from TP rank s>0 the held connection is rank 0's, the instance's:
          rank s dead means the instance is going down (vLLM shuts every rank down), and
          rank 0's EOF then frees the part at once; rank s frozen keeps its part to the
          load's own deadlines and the regular fence, as a frozen rank 0 does;
        - it is proven gone (a pinned same-host writer whose threads are all exiting): as
          any gone prefiller (`_prefiller_gone`: its loads fenced, its connections severed);
        - otherwise its loads silent since before the probe fail with the regular fence
          (cancel sent, fence_timeout_s, freed early on the prefiller's word): no sever
          proves that nothing of it lands, and a live prefiller posts nothing after its
          transfer_timeout_s, which is shorter."""
        loads = [(ld, ld.entry) for parts in self._loads.values() for ld in parts
                 if ld.spec.prefill_engine == address and ld.entry is not None]
        for load, entry in loads:  # count what landed since the last poll: this poll counts later
            if load.state in WAITING and load.reservation is not None:
                self.ledger.progress(entry.request_id, self.engine.imm_count(load.reservation.imm))
        why = f"a probe was not delivered within prefiller_probe_timeout_s={self.settings.prefiller_probe_timeout_s}"
        alive = next(("a write of it landed since the probe was sent" for _, entry in loads
                      if entry.progress_at > sent_at), "") or \
            next(("its liveness connection is held" for load, _ in loads if load.spec.prefill_liveness
                  and self._liveness.phase(load.spec.prefill_liveness) == "held"), "")
        if alive:
            self._probes[address] = (probe, now)  # awaited on, its timeout counted from now
            log.debug("%s, but the prefiller is alive (%s): not declared gone", why, alive)
            return
        self._probes[address] = (None, now)  # the next probe is paced as after a delivered one
        if self._still_writing(address) == "":
            self._prefiller_gone(address, f"the prefiller process is gone: {why}, and every thread of its "
                                 f"process is exiting or gone", now)
            return
        for load, entry in loads:
            if load.state in WAITING and load.reservation is not None and entry.progress_at <= sent_at:
                self._to_fencing(load, "prefiller_unresponsive", f"the prefiller does not answer: {why}, and no "
                                 f"write of it landed since; it may be alive, so no sever, and the load keeps "
                                 f"fence_timeout_s={self.settings.fence_timeout_s}")

    def _check_liveness(self, now: float) -> None:
        """Fails the loads of each prefiller whose liveness connection closed (or refused);
        stops watching prefillers no load waits on any more."""
        gone = self._liveness.poll(now)
        watched: set[str] = set()
        gone_engines: dict[bytes, str] = {}  # once per prefiller, however many loads wait on it
        for parts in self._loads.values():
            for load in parts:
                address = load.spec.prefill_liveness
                if address in gone:
                    gone_engines.setdefault(load.spec.prefill_engine, gone[address])
                elif address and (load.state in WAITING or load.state is Res.FENCED):
                    watched.add(address)
        for engine_address, why in gone_engines.items():
            self._prefiller_gone(engine_address, f"the prefiller process is gone: {why}", now)
        self._liveness.keep(watched)
        self._recheck_exiting_writers(now)

    def _watch_writer(self, address: bytes) -> None:
        """Pins a same-host prefiller's process while it runs (TransferEngine.
        watch_same_host_writer), so that once it is gone its loads can be freed as soon as
        every thread of it is exiting, instead of after dead_prefiller_fence_s."""
        if self.settings.kv_registration != "per_reservation":
            return  # nothing is revoked: the full fence holds anyway
        try:
            self.engine.watch_same_host_writer(address)
        except Exception as exc:  # a malformed address: the load fails on its own, unpinned
            log.debug("not pinning a same-host prefiller: %s", exc)

    def _recheck_exiting_writers(self, now: float) -> None:
        """A gone same-host prefiller some thread of which was not exiting yet when it was
        declared gone (not scheduled since the kill, or in an uninterruptible sleep): looked
        at again every dead_writer_recheck_s until its loads are freed (then at once) or
        their dead_prefiller_fence_s ends."""
        for address, at in list(self._exiting_writers.items()):
            fenced = [ld for parts in self._loads.values() for ld in parts
                      if ld.spec.prefill_engine == address and ld.state is Res.FENCED and not ld.writer_severed]
            if not fenced:
                del self._exiting_writers[address]
            elif now >= at:
                if self._still_writing(address) == "" and self._sever(address):
                    del self._exiting_writers[address]
                    for load in fenced:
                        self._shorten_fence(load, True)
                else:
                    self._exiting_writers[address] = now + self.settings.dead_writer_recheck_s

    def _still_writing(self, address: bytes) -> str | None:
        """Why the same-host prefiller at `address` may still write ("" once it cannot; None:
        not a pinned same-host writer, or its address does not parse)."""
        try:
            return self.engine.same_host_writes_ended(address)
        except Exception:  # a malformed address: nothing to prove with
            return None

    def _prefiller_gone(self, address: bytes, why: str, now: float) -> None:
        """Every load waiting on the prefiller at `address` fails. Where its registration
        was its own it is freed at once if the prefiller's connections were severed after
        every such load's revoke, else after the short dead_prefiller_fence_s (see the
        module docstring)."""
        fenced: list[DecodeLoad] = []
        for parts in self._loads.values():
            for load in parts:
                if load.spec.prefill_engine != address:
                    continue
                if load.state in WAITING and load.reservation is not None:
                    self._to_fencing(load, "prefiller_gone", why, send_cancel=False)  # revokes its scope
                if load.state is Res.FENCED:
                    self.ledger.revoke_writes(load.entry.request_id)  # one kept open for a cancel's word
                    fenced.append(load)
        # Only after every revoke: an op on a connection opened after the sever is refused.
        severed = bool(fenced) and self.settings.kv_registration == "per_reservation" and self._sever(address)
        for load in fenced:
            if not severed:  # a severed one is freed below, and says so then
                log.warning("transfer %s (request %s): %s; its blocks are held until no write of it can land",
                            load.spec.transfer_id, load.spec.request_id, why)
            self._shorten_fence(load, severed)
        if fenced and not severed and self._still_writing(address):
            self._exiting_writers[address] = now + self.settings.dead_writer_recheck_s

    def _sever(self, address: bytes) -> bool:
        """Cuts this process's connections to the dead prefiller (TransferEngine.sever_peer);
        True where that proves no byte of it lands any more."""
        try:
            severed = self.engine.sever_peer(address)
        except Exception as exc:  # a closed engine or a malformed address: keep the timer
            log.info("severing a dead prefiller's connections failed: %s", exc)
            return False
        if not severed:
            still = self._still_writing(address)
            log.info("a dead prefiller's connections are not all ours to sever%s: its loads keep "
                     "dead_prefiller_fence_s=%s", f", or its same-host writes may go on ({still})" if still else "",
                     self.settings.dead_prefiller_fence_s)
        return severed

    def _shorten_fence(self, load: DecodeLoad, severed: bool = False) -> None:
        """The prefiller is gone: the fence ends at once where its connections were severed
        after the revoke, else dead_prefiller_fence_s from now (per_reservation only)."""
        if self.settings.kv_registration == "per_reservation" and load.entry is not None:
            load.writer_severed = load.writer_severed or severed
            self.ledger.writer_gone(load.entry.request_id, 0.0 if severed else self.settings.dead_prefiller_fence_s)
            if load.writer_severed and load.state is Res.FENCED:
                # Freed now, not at the next poll's deadline check: that is a vLLM step later.
                self._free_severed(load)

    def _free_severed(self, load: DecodeLoad) -> None:
        """A fenced part whose gone prefiller can land no byte any more: FREE."""
        self._fence_over(load, None, f"{load.reason}; the prefiller process is gone and no connection of "
                         f"it is left open after the revoke (severed, or closed), nor a thread that could copy "
                         f"on the same host: no byte of it can land (no dead_prefiller_fence_s wait)")

    # ---- from the prefiller ---------------------------------------------------------------

    def on_prefill_stopped(self, imm: int, nonce: int, reason: str) -> None:
        """The prefiller's abort: its push ended early and none of its writes is in flight."""
        entry = self.ledger.by_imm(imm)
        if entry is None or entry.nonce != nonce:
            self.metrics.dropped_messages.labels(reason="unknown_abort").inc()
            return
        load = self._parts[entry.request_id]
        if entry.state in WAITING:
            self._fail(load, "prefill_aborted", f"the prefiller stopped: {reason}")
        elif entry.state is Res.FENCED:
            self._fence_over(load, None, load.reason)

    def on_checksum_table(self, part: TablePart) -> None:
        """A part of a prefiller's checksum table; dropped unless it is for a waiting load
        and from its prefiller (its nonce, and with a cluster key its tag)."""
        entry = self.ledger.by_imm(part.imm)
        load = self._parts.get(entry.request_id) if entry is not None else None
        if load is None or load.checksums is None or not load.state in WAITING:
            self.metrics.dropped_messages.labels(reason="unknown_table").inc()
            return
        refused = load.checksums.accept(part)
        if refused:
            log.warning("transfer %s: dropped a checksum table (%s)", load.spec.transfer_id, refused)
            self.metrics.dropped_messages.labels(reason="bad_table").inc()

    # ---- every step -----------------------------------------------------------------------

    def wait_briefly(self) -> None:
        """On an idle step, block up to idle_wait_ms until any pending load is complete,
        instead of running vLLM's empty steps back to back. A watched prefiller's close ends
        the wait too, the moment it comes (the engine's wait watches the held liveness
        connections, so the worker is not woken to look): the poll that follows fails its
        loads, and a killed prefiller's blocks go back to vLLM without waiting out the rest of
        this wait and a whole step more."""
        wanted = [(ld.reservation.imm, ld.reservation.expected_count) for parts in self._loads.values()
                  for ld in parts if ld.state in WAITING and ld.reservation is not None
                  and not ld.counted]  # a counted part waits for its siblings, not for a count
        if not wanted or self.settings.idle_wait_ms <= 0:
            return
        try:
            # One wait: a close that came before it ends it at once, as one during it does.
            self.engine.wait_imm_any(wanted, self.settings.idle_wait_ms / 1000.0, self._liveness.held_fds())
        except TransferError:
            pass

    def poll(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids to report now; failed ones are in both sets."""
        for rid in finished_req_ids:
            if rid in self._loads:
                self.cancel(rid, "the request was aborted on the decode instance")
        now = time.monotonic()
        self._check_probes(now)
        self._check_liveness(now)
        finished: set[str] = set()
        failed: set[str] = set()
        for rid, parts in list(self._loads.items()):
            for load in parts:
                self._poll_part(load, now)
            broken = next((ld for ld in parts if ld.state is Res.FREE), None)
            if broken is not None:
                # One prefill rank's part failed: the request cannot be admitted; fence the rest.
                for load in parts:
                    if load.state in WAITING:
                        self._to_fencing(load, "part_failed", f"another prefill rank's part failed: {broken.reason}")
            if all(ld.state in (Res.ADMITTED, Res.FREE) for ld in parts):
                finished.add(rid)
                if broken is None:
                    self._hooks.load_admitted(self.region, parts[0])
                elif not broken.vllm_aborted:
                    failed.add(rid)
                for load in parts:
                    self._release(load)
                del self._loads[rid]
        return finished, failed

    def _poll_part(self, load: DecodeLoad, now: float) -> None:
        """One part's writes, table and deadlines."""
        res, entry = load.reservation, load.entry
        if entry is None:
            return
        if load.state in WAITING and load.sent is not None and load.sent.done():
            sent, load.sent = load.sent, None
            try:
                sent.wait(0)
            except TransferError as exc:
                # It never reached the prefiller, so none of its writes can come: fail now,
                # not at load_stall_timeout_s.
                self._fail(load, "reservation_send_failed", f"the reservation did not reach the prefiller: {exc}")
        if load.state in WAITING and res is not None:
            landed = self.engine.imm_count(res.imm)
            self.ledger.progress(entry.request_id, landed)  # progress: the prefiller is alive and pushing
            table_missing = load.checksums is not None and not load.checksums.complete
            if landed >= res.expected_count and not table_missing:
                self._revoke(load)  # every write landed: none may come any more
                load.counted, load.landed = True, landed
                self._land(load, now)
            elif now > entry.expires_at:
                self._to_fencing(load, "load_timeout", f"not every write landed within load_timeout_s="
                                 f"{self.settings.load_timeout_s} ({landed} of {res.expected_count} pages"
                                 f"{', no checksum table' if table_missing else ''})")
            elif entry.deadline_setting is DeadlineSetting.STALL and entry.deadline is not None \
                    and now > entry.deadline:
                self._to_fencing(load, "load_stalled", f"no write landed for load_stall_timeout_s="
                                 f"{self.settings.load_stall_timeout_s} ({landed} of {res.expected_count} pages"
                                 f"{', no checksum table' if table_missing else ''})")
            elif now - entry.progress_at >= self.settings.prefiller_probe_after_s:
                # Silent for a while (its reservation maybe not even delivered): is the
                # prefiller still there? A late probe is judged in one place (_probe_overdue).
                self._probe(load.spec.prefill_engine, now)
        if load.state is Res.FENCED and load.cancel_sent is not None:
            gone = self._gone(load.cancel_sent)  # proof only: a late cancel proves nothing
            if gone:
                load.cancel_sent = None
                log.info("transfer %s: the prefiller process is gone: %s", load.spec.transfer_id, gone)
                self._shorten_fence(load)
            elif load.cancel_sent.done():
                load.cancel_sent = None
        if load.state is Res.FENCED and entry.deadline_setting is DeadlineSetting.CANCEL_CONFIRM \
                and entry.deadline is not None and now > entry.deadline:
            self.ledger.revoke_writes(entry.request_id)  # the fence goes on to fence_timeout_s
            log.info("transfer %s: the prefiller did not confirm the cancel within cancel_confirm_timeout_s=%s: "
                     "registration revoked, blocks fenced to fence_timeout_s=%s", load.spec.transfer_id,
                     self.settings.cancel_confirm_bound_s, self.settings.fence_timeout_s)
        if load.state is Res.FENCED and entry.deadline is not None and now > entry.deadline:
            if entry.writer_gone and load.writer_severed:
                self._free_severed(load)
            elif entry.writer_gone:
                self._fence_over(load, None, f"{load.reason}; the prefiller process is gone, "
                                 f"dead_prefiller_fence_s={self.settings.dead_prefiller_fence_s} passed")
            else:
                self._fence_over(load, "fence_timeout", f"{load.reason}; the prefiller never confirmed, "
                                 f"fence_timeout_s={self.settings.fence_timeout_s} passed")

    def _land(self, load: DecodeLoad, now: float) -> None:
        """Copies the landed blocks into the cache and admits, once every part that writes
        them counted its writes: a device cache's parts (one per prefill rank its heads come
        from) share landing blocks, copied whole, once; a host cache's part lands in place."""
        parts = self._loads[load.spec.request_id] if isinstance(self.landing, StagedLanding) else [load]
        if not all(ld.counted and ld.state in WAITING for ld in parts):
            return  # the copy waits for the other parts; one that fails fences this one (poll)
        try:
            self.landing.land(load.pages, list(load.spec.block_ids))
        except Exception as exc:  # a device copy that failed: vLLM must not read the blocks
            for ld in parts:
                self._fail(ld, "landing_failed", f"copying the landed blocks to the cache failed: {exc}")
            return
        for ld in parts:
            self._admit(ld, ld.landed, now)

    def _admit(self, load: DecodeLoad, landed: int, now: float) -> None:
        """Every write landed (in the request's blocks): the hand-off's admission step
        (count, then checksums per `kv_integrity`), then ADMITTED; on a failed check, fenced
        (what landed is not what was meant)."""
        res, entry = load.reservation, load.entry
        assert res is not None and entry is not None
        mode = self.settings.kv_integrity

        def verify() -> Verification:
            assert load.checksums is not None
            if load.spec.group_block_ids is not None:  # the cache's blocks, where the landing copy put them
                return load.checksums.verify_groups(self.region, load.spec.group_block_ids, res.first_page, mode,
                                                    self.settings.kv_integrity_sample_rate, self._sample_rng,
                                                    load.heads)
            return load.checksums.verify(self.region, list(load.spec.block_ids), res.first_page, mode,
                                         self.settings.kv_integrity_sample_rate, self._sample_rng, load.heads)

        try:
            checked = check_landed(load.spec.request_id, landed, res.expected_count, mode, verify)
        except KVIntegrityError as exc:
            self.metrics.integrity_failures.labels(reason=exc.reason).inc()
            self._to_fencing(load, "integrity", str(exc))
            return
        if mode is not KVIntegrity.OFF:
            self.metrics.pages_verified.inc(checked.checked)
            self.metrics.verify_seconds.observe(checked.verify_s)
        self.ledger.move(entry.request_id, Res.ADMITTED)
        self.metrics.admission_wait.observe(now - load.sent_at)
        self.metrics.pages_received.inc(res.expected_count)

    def _release(self, load: DecodeLoad) -> None:
        """The load is reported: an admitted part's entry goes FREE (its pages with it)."""
        self._revoke(load)
        if load.entry is not None:
            if load.entry.state is Res.ADMITTED:
                self.ledger.move(load.entry.request_id, Res.FREE)
            self._parts.pop(load.entry.request_id, None)
        if load.reservation is not None:
            self.metrics.loads_in_flight.dec()

    def failure(self, request_id: str) -> str:
        """Why `request_id`'s load failed or is being fenced ("" while it is fine, or unknown)."""
        return next((ld.reason for ld in self._loads.get(request_id, ()) if ld.reason), "")

    @property
    def pending(self) -> int:
        """Loads not yet reported to vLLM."""
        return len(self._loads)
