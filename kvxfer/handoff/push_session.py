"""The layer-by-layer KV push from a prefill worker into a decode worker's reserved pages.

The decoder reserves pages and hands out a `KVReservation`: its KV cache descriptor, the
page ids, an immediate value and how many units of it to expect. The prefiller's
`PushSession` issues one paged write per (layer, chunk) as soon as that layer's pages are
final, all carrying the reservation's immediate, and finally writes a small mailbox record
(first token, prompt length, nonce) with the same immediate. It never sends "done": the
decoder admits the request when its ImmCounter reaches `expected_count`, which is
`num_layers * pages(prompt) + 1` whatever the engine coalesced or sharded. The record also
says how many immediate units the push posted (every paged write it posted, whatever a hook
made of the layer's writes, and the mailbox write itself): an extra write, counted in place
of one not counted yet, cannot complete the decoder's count unnoticed.

With `reservation.checksums` each layer's pages are checksummed (native CRC-32C) just
before their write is posted, and the table rides in the mailbox write (kv.integrity),
tagged under the cluster's table key where the reservation asks (`checksum_tag`).
A push that stalled longer than `max_stall_s` between two of its writes (a frozen or
starved process) may have missed its decoder's fence: it raises instead of writing.
Tests and failure drills make a push go wrong through its `PushHooks` (handoff.push_hooks),
given at construction; production gives none.

`PushSession` is the builtin prefiller's adapter over the push core it shares with the
vLLM connector's sender: its state is a `PushLifecycle` (push_state.py, starting in
PUSHING: the router relays the reservation with the request), its pages and offsets come
from a `PushPlan` (push_plan.py, over the cache's pages as a `CacheGeometry`) and its
posted writes are an `InflightWrites` (inflight_writes.py). What is its own: the mailbox
record, the stall check, the per-write timings of `PushStats` and the lock that lets the
prefiller's /cancel trust `in_flight()`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvxfer.errors import TransferError
from kvxfer.handoff.inflight_writes import InflightWrites
from kvxfer.handoff.push_hooks import NO_PUSH_HOOKS, PushHooks
from kvxfer.handoff.push_plan import PushPlan, whole_page_geometry
from kvxfer.handoff.push_state import PushLifecycle, PushState
from kvxfer.kv.cache import PagedKVCache
from kvxfer.kv.integrity import layer_checksums
from kvxfer.kv.protocol import KVReservation, encode_mailbox
from kvxfer.transfer.engine import RegisteredMemory, Transfer, TransferEngine


@dataclass
class PushStats:
    """What one push cost: bytes moved, writes issued, and the transfer tail.

    `tail_s` is the time from the end of compute to the last write's completion: the part
    of the transfer that did not hide behind compute.

    Per-write timings come from the engine (`Transfer.duration_s`, submission to
    completion, so a write queued behind earlier ones counts its wait): `write_s` holds
    one entry per KV write, i.e. per (layer, chunk), in issue order; `mailbox_write_s` is
    the final mailbox write. `last_completed_at` (engine completion time) and
    `compute_done_monotonic` are CLOCK_MONOTONIC seconds, so `engine_tail_s` is the tail
    without the cost of waking the waiting thread.
    """

    kv_bytes: int = 0
    writes: int = 0
    compute_done_at: float = 0.0
    transfers_done_at: float = 0.0
    first_write_at: float = 0.0
    layer_push_s: list[float] = field(default_factory=list)
    write_s: list[float] = field(default_factory=list)
    mailbox_write_s: float = 0.0
    compute_done_monotonic: float = 0.0
    last_completed_at: float = 0.0
    # Seconds in which at least one KV write was in flight (engine clock). The push span
    # (transfer_s) also holds the compute between layers; rates are bytes / wire_s.
    wire_s: float = 0.0

    @property
    def layer_transfer_s_mean(self) -> float:
        """Mean engine duration of one KV write (one layer of one chunk)."""
        return sum(self.write_s) / len(self.write_s) if self.write_s else 0.0

    @property
    def layer_transfer_s_max(self) -> float:
        """Longest engine duration of one KV write."""
        return max(self.write_s, default=0.0)

    @property
    def engine_tail_s(self) -> float:
        """End of compute to the last write's completion, by the engine's clock."""
        if not self.last_completed_at or not self.compute_done_monotonic:
            return 0.0
        return max(0.0, self.last_completed_at - self.compute_done_monotonic)

    @property
    def tail_s(self) -> float:
        return max(0.0, self.transfers_done_at - self.compute_done_at)

    @property
    def transfer_s(self) -> float:
        return max(0.0, self.transfers_done_at - self.first_write_at)


class PushStalled(TransferError):
    """The push stopped longer than its stall limit between two writes: a write now could
    land after the decoder gave the pages to another request, so none is posted."""


def _covered_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class PushSession:
    """Pushes one request's KV, layer by layer, into a decoder's reserved pages.

    Call `on_layer_done` from the model's prefill callback, `finish` once the first token
    is known, then `wait`. `cancel` stops further writes; `wait` still returns only when
    nothing of this request is in flight, so the decoder may then reuse the pages.
    `table_key` (kv.integrity.checksum_table_key) tags the checksum table where the
    reservation asks for a tag; one that asks while there is no key is refused here.
    `hooks` (handoff.push_hooks) are called at each layer: tests and drills inject faults there.
    Block indices are the prompt's (local block `b` is `local_pages[b]`); blocks below the
    reservation's `first_page` (the decoder holds them, a prefix-cache hit) are never
    pushed, and block `b` lands in the reservation's page ``b - first_page``.
    """

    def __init__(
        self,
        engine: TransferEngine,
        cache: PagedKVCache,
        cache_region: RegisteredMemory,
        mailbox: np.ndarray,
        mailbox_region: RegisteredMemory,
        mailbox_slot: int,
        mailbox_slot_stride: int,
        reservation: KVReservation,
        local_pages: list[int],
        *,
        max_stall_s: float = float("inf"),
        hooks: PushHooks = NO_PUSH_HOOKS,
        table_key: bytes | None = None,
    ) -> None:
        if reservation.kv_layout != cache.kv_layout:
            raise TransferError(
                reservation.request_id,
                f"KV layout mismatch: decoder has {reservation.kv_layout}, prefiller {cache.kv_layout}",
            )
        if len(local_pages) > reservation.first_page + len(reservation.pages):
            raise TransferError(
                reservation.request_id,
                f"decoder reserved {len(reservation.pages)} pages after the {reservation.first_page} it holds, "
                f"prompt needs {len(local_pages)}",
            )
        if reservation.checksums and reservation.checksum_tag and table_key is None:
            # Refused before any write: the decoder would refuse the untagged table after all of them.
            raise TransferError(
                reservation.request_id,
                "the decoder asks for a tagged checksum table and this prefiller has no cluster key "
                "(KVXFER_CLUSTER_KEY_FILE) to tag it with",
            )
        self._engine = engine
        self._cache = cache
        self._region = cache_region
        self._mailbox = mailbox
        self._mailbox_region = mailbox_region
        self._slot = mailbox_slot
        self._slot_stride = mailbox_slot_stride
        self.reservation = reservation
        self._local = np.asarray(local_pages, dtype=np.int64)
        self._plan = PushPlan(reservation, whole_page_geometry(cache.kv_layout, cache.num_layers, cache.num_pages,
                                                               cache.page_bytes))
        self._state = PushLifecycle(str(reservation.request_id), PushState.PUSHING)
        self._writes = InflightWrites()
        self._mailbox_transfer: Transfer | None = None
        # The prefiller's /cancel, the drills and the monitor's failure handling all count
        # as a cancel, whatever state the push was in (failure reasons read it).
        self._cancel_requested = threading.Event()
        # Held while a write is decided and posted, and by cancel(): once cancel() returned,
        # every write this session will ever post is tracked, so `in_flight()` can be
        # trusted by the prefiller's /cancel (whose answer frees the decoder's pages).
        self._issue_lock = threading.Lock()
        self.stats = PushStats()
        self._max_stall_s = max_stall_s
        self._last_progress = time.monotonic()
        self._hooks = hooks
        self._table_key = table_key if reservation.checksum_tag else None

    @property
    def cache(self) -> PagedKVCache:
        """The prefiller's KV cache the pages are written from."""
        return self._cache

    @property
    def first_page(self) -> int:
        """The first prompt block this push writes (the decoder holds the ones before)."""
        return self.reservation.first_page

    @property
    def state(self) -> PushState:
        """Where the push is (push_state.py): PUSHING until cancelled, stalled or ended."""
        return self._state.state

    @property
    def cancelled(self) -> bool:
        """True once cancel() was called: no further writes are issued."""
        return self._cancel_requested.is_set()

    def cancel(self) -> None:
        """Stops issuing writes; those already posted still complete (or fail)."""
        with self._issue_lock:
            self._cancel_requested.set()
            if self._state.live:
                self._state.move(PushState.STOPPING, "cancelled")

    def mark_progress(self) -> None:
        """Compute of this push starts now: its stall clock starts here, not at queueing."""
        self._last_progress = time.monotonic()

    def on_layer_done(self, layer: int, first_block: int, end_block: int) -> None:
        """Pushes blocks [first_block, end_block) of `layer` that the decoder lacks: they are
        final now."""
        first_block = max(first_block, self.first_page)
        if end_block > first_block and self._state.live:
            # Outside the lock: a hook that holds the push here must not hold up cancel().
            self._hooks.before_layer(self, layer, first_block)
        with self._issue_lock:
            self._push_layer(layer, first_block, end_block)

    def _check_stall(self) -> None:
        """Raises PushStalled (and fails the push) if it stood still too long since its last write."""
        now = time.monotonic()
        stalled = now - self._last_progress
        if stalled > self._max_stall_s:
            error = PushStalled(
                self.reservation.request_id,
                f"push stalled {stalled:.2f} s between writes (limit {self._max_stall_s:.2f} s: the decoder's "
                "fence_timeout_s minus this prefiller's transfer_timeout_s); not writing into pages it may have reused",
            )
            self._state.move(PushState.FAILED, error.reason)
            raise error
        self._last_progress = now

    def _push_layer(self, layer: int, first_block: int, end_block: int) -> None:
        if not self._state.live:
            return
        pages = self._plan.blocks(layer, first_block, end_block, self._local)
        if pages is None:
            return
        self._check_stall()
        start = time.perf_counter()
        if not self.stats.first_write_at:
            self.stats.first_write_at = start
        self._hooks.before_checksum(self, layer, pages.local)
        if self._plan.checksums is not None:
            self._plan.record_checksums(pages, layer_checksums(self._cache, layer, pages.local))
        for write_local, write_remote in self._hooks.layer_writes(self, layer, pages.local, pages.remote):
            self._write_pages(layer, write_local, write_remote)
        self._plan.posted(pages)
        self._writes.count(len(pages.remote), len(pages.remote) * self._cache.page_bytes)
        self.stats.kv_bytes = self._writes.bytes_posted
        self.stats.layer_push_s.append(time.perf_counter() - start)

    def _write_pages(self, layer: int, local: np.ndarray, remote: np.ndarray) -> None:
        for run in self._plan.runs(layer):
            transfer = self._engine.write_paged(
                self._region,
                local,
                self.reservation.descriptor,
                remote,
                run.length,
                src_stride=run.src_stride,
                dst_stride=run.dst_stride,
                src_offset=run.src_offset,
                dst_offset=run.dst_offset,
                imm=self.reservation.imm,
                request_id=self.reservation.request_id,
            )
            # The decoder's ImmCounter grows by one per page of a paged write: the units the
            # mailbox declares are these, so a page written twice shows there too.
            self._writes.add(transfer, transfer.bytes, units=len(remote))
            self.stats.writes += 1

    def finish(self, first_token: int, prompt_tokens: int) -> None:
        """Writes the mailbox record (first token), the request's last write."""
        self.stats.compute_done_at = time.perf_counter()
        self.stats.compute_done_monotonic = time.monotonic()
        with self._issue_lock:
            self._write_mailbox(first_token, prompt_tokens)

    def _write_mailbox(self, first_token: int, prompt_tokens: int) -> None:
        if not self._state.live:
            return
        self._check_stall()
        table = self._plan.checksums.tobytes() if self._plan.checksums is not None else b""
        # Every unit posted so far, and this write's one: the decoder admits only if that is
        # exactly its expected count (handoff.admission.check_landed).
        record = encode_mailbox(self.reservation.nonce, first_token, prompt_tokens, table,
                                units=self._writes.units_posted + 1,
                                table_key=self._table_key, imm=self.reservation.imm)
        # The staging slot is `mailbox_slot_bytes` wide (the prefiller sized it for its context).
        offset = self._slot * self._slot_stride
        if offset + len(record) > self._mailbox.size:
            raise TransferError(self.reservation.request_id, f"mailbox record of {len(record)} bytes does not fit the staging slot")
        self._mailbox[offset : offset + len(record)] = np.frombuffer(record, dtype=np.uint8)
        self._mailbox_transfer = self._engine.write(
            self._mailbox_region,
            offset,
            self.reservation.meta_descriptor,
            self.reservation.meta_offset,
            len(record),
            imm=self.reservation.imm,
            request_id=self.reservation.request_id,
        )
        self._writes.add(self._mailbox_transfer, self._mailbox_transfer.bytes, units=1)

    def poll(self) -> tuple[int, int, bool, Exception | None]:
        """One look at the posted writes, for the push monitor (its thread only): writes
        still in flight and their bytes, whether any completed successfully since the last
        poll, and the first failure (a `TransferTimeout` at the engine's deadline, else
        `TransferError`)."""
        reaped = self._writes.reap()
        return reaped.pending, reaped.pending_bytes, reaped.progressed, reaped.failure

    def collect_stats(self) -> PushStats:
        """The push's stats once every write completed (the monitor found them done).

        The monitor looks every few milliseconds; the end of the push is the last write's
        completion by the engine's clock, carried over to `perf_counter` time."""
        now_perf, now_mono = time.perf_counter(), time.monotonic()
        self._collect_write_times()
        late_s = now_mono - self.stats.last_completed_at if self.stats.last_completed_at else 0.0
        self.stats.transfers_done_at = now_perf - max(0.0, late_s)
        self._settle(None)
        return self.stats

    def wait(self, timeout_s: float) -> PushStats:
        """Waits until every write completed; raises the first TransferError.

        Even when one write fails, it waits for all others to finish (or hit the engine's
        own transfer deadline) so that on return nothing of this request is in flight.
        """
        deadline = time.monotonic() + timeout_s
        first_error: Exception | None = None
        for transfer in self._writes.posted:
            try:
                transfer.wait(max(0.0, deadline - time.monotonic()))
            except TransferError as exc:
                first_error = first_error or exc
                if not transfer.done():
                    # Our deadline passed: bounded by the engine's transfer timeout.
                    transfer._native.wait(self._engine.transfer_timeout_s + 1.0)  # type: ignore[attr-defined]
        self.stats.transfers_done_at = time.perf_counter()
        self._collect_write_times()
        self._settle(first_error)
        if first_error is not None:
            raise first_error
        return self.stats

    def _settle(self, error: Exception | None) -> None:
        """Nothing is in flight: a failed push is FAILED, a cancelled one DONE (drained), a
        live one DONE once its mailbox went (a drill may wait mid-push)."""
        with self._issue_lock:
            if self._state.final:
                return
            if error is not None:
                self._state.move(PushState.FAILED, str(error))
            elif self._state.state is PushState.STOPPING or self._mailbox_transfer is not None:
                self._state.move(PushState.DONE)

    def _collect_write_times(self) -> None:
        """Fills the per-write engine timings of `stats` from the finished transfers."""
        write_s: list[float] = []
        spans: list[tuple[float, float]] = []
        for transfer in self._writes.posted:
            duration = transfer.duration_s  # type: ignore[attr-defined]
            if duration is None:
                continue
            completed = transfer.completed_at_s or 0.0
            if transfer is self._mailbox_transfer:
                self.stats.mailbox_write_s = duration
            else:
                write_s.append(duration)
                spans.append((completed - duration, completed))
            self.stats.last_completed_at = max(self.stats.last_completed_at, completed)
        self.stats.write_s = write_s
        self.stats.wire_s = _covered_seconds(spans)

    def in_flight(self) -> bool:
        """True while any write of this request may still land on the decoder."""
        return self._writes.in_flight()
