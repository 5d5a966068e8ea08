"""The decoder's reservation ledger: one explicit state machine per reservation, both engines.

A reservation holds pages, a slot and an immediate (slot + generation,
`immediate_slots.ImmediateSlots`). Its states and their table are `reservation_state`'s
(docs/architecture.md, "Reservation states"): RESERVED, RECEIVING, ADMITTED, FAILED,
CANCELLED, FENCED, FREE. The builtin decoder (kvxfer/workers/decode/) and the vLLM
connector's receiver (kvxfer/integrations/vllm/kv_receiver.py) both keep their
reservations here; they differ only in where the pages come from (a `PageSource`: the
builtin's `kv.page_allocator.PageAllocator`, the connector's vLLM blocks or landing blocks,
whose "free" means the receiver may report the load to vLLM) and in which deadlines they
set.

"The writer is known to have stopped" means the prefiller said so (its abort message, or
its /cancel answered `in_flight: false`); only then, or after the fence deadline (longer
than any prefiller's transfer deadline, which the prefiller checks against the
reservation), do the pages go back. An ADMITTED reservation's writes have all landed, so
its pages are freed at once.

Deadlines, all in seconds on the ledger's monotonic clock, one per state (`due()` lists
the entries whose deadline passed, `LedgerEntry.deadline_setting` says which one; the
caller's one loop walks it: no thread or timer here):
- RESERVED/RECEIVING: `reservation_ttl_s` after the reservation (the connector's
  `load_timeout_s`), and, where `stall_timeout_s` is set, that long after the last
  progress (`progress()`: more writes counted; the connector's `load_stall_timeout_s`);
  whichever comes first.
- FENCED: `fence_timeout_s` after the fence, cut to `fence_s` by `writer_gone()` when the
  prefiller process is known to be gone (the connector's `dead_prefiller_fence_s`, or 0
  where the writer's connections were severed after the revoke). A fenced entry whose
  writes were kept open (`end(..., keep_writes_open=True)`, below) first has
  `cancel_confirm_timeout_s`: when it passes, the caller revokes (`revoke_writes()`) and
  the deadline becomes the fence's.

The ledger never touches the engine: `forget_imm` is called with an entry's immediate when
it is fenced and when it is freed, so the decoder resets its count there; `close_writes` is
called with the request id once, when the reservation stops waiting for its KV (ADMITTED,
FAILED or CANCELLED), so the decoder revokes the descriptor it handed out for it (closes
its per-reservation registration). A write the provider had already accepted may still be
landing then, so closing does not shorten the fence.

Closing under a live write costs more than that write, though: libfabric's net provider
refuses the next op whose header names a closed key by dropping the whole connection, and
every write queued behind it to that peer, another reservation's too, fails ("Transport
endpoint is not connected"). So a reservation ended by a cancel that its prefiller will
confirm can keep its writes open (`keep_writes_open`, on a ledger with
`cancel_confirm_timeout_s`): FENCED with its descriptor still open, closed when the
prefiller confirms (just before FREE: its writes are all drained, nothing is cut), when
the prefiller is gone (`writer_gone`), or at `cancel_confirm_timeout_s` (`revoke_writes`,
then the rest of the fence as before). Its pages stay out of use all along, so a late write
lands only in pages no one else holds, and its immediate was forgotten at FENCED: nothing
reads what it counts. Thread-safe: one lock, held only for bookkeeping.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Protocol, Sequence

from kvxfer.handoff.immediate_slots import ImmediateSlots
from kvxfer.handoff.reservation_state import (
    ENDED_UNCONFIRMED,
    TRANSITIONS,
    WAITING,
    IllegalTransition,
    LedgerError,
    ReservationState,
)

__all__ = ["DeadlineSetting", "LedgerEntry", "NoSlotError", "PageSource", "ReservationLedger"]

S = ReservationState


class NoSlotError(LedgerError):
    """Every slot is taken (that many reservations live or fenced)."""


class PageSource(Protocol):
    """Where a reservation's pages come from and what handing them back means.

    `reserve` takes pages for a new reservation (raising leaves nothing taken); `free`
    hands them back at once (the writer stopped, or every write landed);
    `release_after_quiesce` then `confirm_quiesced` hand them back only after a fence.
    """

    def reserve(self, request_id: str, num_tokens: int, prefix: Sequence[bytes]) -> list[int]: ...

    def held_pages(self, request_id: str) -> int: ...

    def free(self, request_id: str) -> None: ...

    def release_after_quiesce(self, request_id: str) -> None: ...

    def confirm_quiesced(self, request_id: str) -> None: ...


class DeadlineSetting(str, Enum):
    """Which limit an entry's `deadline` is (named after the ledger's settings)."""

    RESERVATION_TTL = "reservation_ttl_s"
    STALL = "stall_timeout_s"
    FENCE = "fence_timeout_s"
    CANCEL_CONFIRM = "cancel_confirm_timeout_s"
    WRITER_GONE = "writer_gone_fence_s"


def cancel_confirm_bound_s(cancel_confirm_timeout_s: float, fence_timeout_s: float, grace_s: float) -> float:
    """How long a cancelled reservation's writes stay open for its prefiller's word (the
    ledger's `cancel_confirm_timeout_s`): an engine's setting, cut so that `grace_s` of the
    fence is left after the revoke, for the rest of a write already under way then."""
    return max(0.0, min(cancel_confirm_timeout_s, fence_timeout_s - grace_s))


def cancel_confirm_overrun(cancel_confirm_timeout_s: float, fence_timeout_s: float, grace_s: float,
                           grace_name: str) -> str:
    """Why an explicitly set `cancel_confirm_timeout_s` is refused ("" where it fits): with
    the grace (`grace_name`, `grace_s`) after it, it must end inside the fence."""
    if cancel_confirm_timeout_s + grace_s <= fence_timeout_s:
        return ""
    return (f"cancel_confirm_timeout_s ({cancel_confirm_timeout_s}) + {grace_name} ({grace_s}) must not exceed "
            f"fence_timeout_s ({fence_timeout_s}): the rest of a write under way at the revoke may still land after it")


@dataclass
class LedgerEntry:
    """One reservation: its resources, state and the deadline of that state."""

    request_id: str
    slot: int
    generation: int
    imm: int
    nonce: int
    pages: list[int]
    state: ReservationState = S.RESERVED
    #: Leading pages of `pages` reused from the prefix cache: read-only, never written by
    #: this reservation's prefiller (kv.page_allocator keeps them referenced until FREE).
    held_pages: int = 0
    #: Monotonic seconds at which the current state times out (None: no deadline).
    deadline: float | None = None
    #: Which limit `deadline` is.
    deadline_setting: DeadlineSetting | None = None
    #: Why it failed or was cancelled: the first reason given, kept through the fence.
    reason: str = ""
    #: Writes counted at the last `progress()`, and when that count last grew (or the
    #: reservation was made).
    landed: int = 0
    progress_at: float = 0.0
    #: `writer_gone()` cut the fence: the prefiller process is gone.
    writer_gone: bool = False
    #: When `reservation_ttl_s` ends (the waiting states' outer bound).
    expires_at: float = 0.0
    #: Its descriptor is still open while FENCED (kept for the prefiller's confirmation).
    writes_open: bool = False
    #: When the fence ends (`fence_timeout_s` after FENCED; set at FENCED).
    fence_ends_at: float | None = None
    history: list[tuple[ReservationState, float]] = field(default_factory=list)


class ReservationLedger:
    """Reservations by request id and immediate, their transitions and deadlines."""

    def __init__(
        self,
        allocator: PageSource,
        max_slots: int,
        *,
        reservation_ttl_s: float,
        fence_timeout_s: float,
        stall_timeout_s: float | None = None,
        cancel_confirm_timeout_s: float | None = None,
        forget_imm: Callable[[int], None] = lambda imm: None,
        close_writes: Callable[[str], None] = lambda request_id: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not reservation_ttl_s > 0 or not fence_timeout_s > 0:
            raise ValueError(f"reservation_ttl_s and fence_timeout_s must be > 0, got {reservation_ttl_s}, "
                             f"{fence_timeout_s}")
        if stall_timeout_s is not None and not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 (or None: no stall deadline), got {stall_timeout_s}")
        self.allocator = allocator
        self.reservation_ttl_s = reservation_ttl_s
        self.fence_timeout_s = fence_timeout_s
        if cancel_confirm_timeout_s is not None and not 0 <= cancel_confirm_timeout_s <= fence_timeout_s:
            raise ValueError(f"cancel_confirm_timeout_s must be in [0, fence_timeout_s={fence_timeout_s}] (or None: "
                             f"writes close when the reservation stops waiting), got {cancel_confirm_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self.cancel_confirm_timeout_s = cancel_confirm_timeout_s
        self._forget_imm = forget_imm
        self._close_writes = close_writes
        self._clock = clock
        self._slots = ImmediateSlots(max_slots)
        self._entries: dict[str, LedgerEntry] = {}
        self._by_imm: dict[int, LedgerEntry] = {}
        self._lock = threading.RLock()

    # ---- queries ---------------------------------------------------------------------
    def get(self, request_id: str) -> LedgerEntry | None:
        """The live entry of `request_id` (None once FREE, or never opened)."""
        with self._lock:
            return self._entries.get(request_id)

    def by_imm(self, imm: int) -> LedgerEntry | None:
        """The live entry whose reservation carries `imm` (None for an earlier generation's)."""
        with self._lock:
            return self._by_imm.get(imm)

    def entries(self) -> list[LedgerEntry]:
        """Every live entry (a copy of the list: the caller may move them)."""
        with self._lock:
            return list(self._entries.values())

    def count(self, *states: ReservationState) -> int:
        """Live entries in any of `states`."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.state in states)

    def due(self) -> list[LedgerEntry]:
        """Entries whose state's deadline has passed (a waiting one's TTL or stall bound, a
        fenced one's fence); `deadline_setting` says which."""
        now = self._clock()
        with self._lock:
            return [e for e in self._entries.values() if e.deadline is not None and e.deadline <= now]

    @property
    def free_slots(self) -> int:
        with self._lock:
            return self._slots.free

    # ---- transitions -------------------------------------------------------------------
    def open(self, request_id: str, num_tokens: int, prefix: Sequence[bytes] = ()) -> LedgerEntry:
        """A new RESERVED entry: pages for `num_tokens` from the page source, a slot, a fresh
        generation and nonce.

        `prefix`: block hashes of the leading full blocks the request may reuse from the
        allocator's prefix cache (`LedgerEntry.held_pages` says how many it got). Raises
        `NoSlotError`, or the page source's error (the allocator's `OutOfPagesError` /
        `DuplicateRequestError`); nothing is taken then.
        """
        with self._lock:
            if request_id in self._entries:
                raise LedgerError(f"reservation {request_id!r} already exists")
            if not self._slots.free:
                raise NoSlotError(f"reservation {request_id!r}: all {self._slots.size} mailbox slots are taken")
            pages = self.allocator.reserve(request_id, num_tokens, prefix)
            held = self.allocator.held_pages(request_id) if prefix else 0
            taken = self._slots.take()
            assert taken is not None  # checked above, under the lock
            now = self._clock()
            entry = LedgerEntry(
                request_id=request_id, slot=taken.slot, generation=taken.generation, imm=taken.imm,
                nonce=secrets.randbits(63), pages=pages, history=[(S.RESERVED, now)], held_pages=held,
                progress_at=now, expires_at=now + self.reservation_ttl_s,
            )
            self._set_waiting_deadline(entry)
            self._entries[request_id] = entry
            self._by_imm[entry.imm] = entry
            return entry

    def progress(self, request_id: str, landed: int) -> bool:
        """`landed` writes are counted for a waiting reservation: if more than last time,
        its stall deadline starts again and a RESERVED one moves to RECEIVING. True if the
        count grew; False for a count that did not, or an entry that no longer waits."""
        with self._lock:
            entry = self._entries[request_id]
            if entry.state not in WAITING or landed <= entry.landed:
                return False
            entry.landed = landed
            entry.progress_at = self._clock()
            if entry.state is S.RESERVED:
                self.move(request_id, S.RECEIVING)
            self._set_waiting_deadline(entry)
            return True

    def move(self, request_id: str, target: ReservationState, reason: str = "", *,
             keep_writes_open: bool = False) -> LedgerEntry:
        """Applies one transition and its effect on pages, slot and deadline.

        FENCED puts the pages in the allocator's quarantine and starts the fence deadline
        (`cancel_confirm_timeout_s` first where the writes were kept open); FREE closes writes
        still open, then returns pages (from quarantine when fenced) and the slot.
        `forget_imm` runs at FENCED and FREE. `keep_writes_open`: on leaving the waiting
        states, the descriptor stays open (see the module; only on a ledger with
        `cancel_confirm_timeout_s`, only into FAILED or CANCELLED). Raises
        `IllegalTransition` (and `KeyError` for an unknown id).
        """
        with self._lock:
            entry = self._entries[request_id]
            if target not in TRANSITIONS[entry.state]:
                raise IllegalTransition(request_id, entry.state, target)
            if keep_writes_open and (self.cancel_confirm_timeout_s is None or entry.state not in WAITING
                                     or target not in (S.FAILED, S.CANCELLED)):
                raise ValueError(f"reservation {request_id!r}: writes are kept open only from a waiting state into "
                                 f"FAILED or CANCELLED, on a ledger with cancel_confirm_timeout_s")
            previous = entry.state
            now = self._clock()
            entry.state = target
            entry.history.append((target, now))
            if reason and not entry.reason:
                entry.reason = reason
            if previous in WAITING and target not in WAITING:
                if keep_writes_open:
                    entry.writes_open = True  # closed at the confirmation, the bound or the writer's end
                else:
                    # No write of this reservation is wanted any more: revoke its descriptor
                    # before anything else can happen to its pages.
                    self._close_writes(request_id)
            if target is S.RECEIVING:
                pass  # the wait deadlines keep running
            elif target is S.FENCED:
                self.allocator.release_after_quiesce(request_id)
                entry.fence_ends_at = now + self.fence_timeout_s
                entry.deadline, entry.deadline_setting = entry.fence_ends_at, DeadlineSetting.FENCE
                if entry.writes_open:
                    assert self.cancel_confirm_timeout_s is not None
                    entry.deadline = now + self.cancel_confirm_timeout_s
                    entry.deadline_setting = DeadlineSetting.CANCEL_CONFIRM
                self._forget_imm(entry.imm)
            elif target is S.FREE:
                if entry.writes_open:
                    # Before the pages go back: no write may land in them once reused.
                    entry.writes_open = False
                    self._close_writes(request_id)
                if previous is S.FENCED:
                    self.allocator.confirm_quiesced(request_id)
                else:
                    self.allocator.free(request_id)
                # Forget what the immediate counted before the slot (and, generations later,
                # this value) can be handed out again.
                self._forget_imm(entry.imm)
                del self._entries[request_id]
                del self._by_imm[entry.imm]
                self._slots.give_back(entry.slot)
                entry.deadline, entry.deadline_setting = None, None
            else:  # ADMITTED, FAILED, CANCELLED: the wait deadlines no longer apply
                entry.deadline, entry.deadline_setting = None, None
            return entry

    def end(self, request_id: str, outcome: ReservationState, *, writer_stopped: bool, reason: str = "",
            keep_writes_open: bool = False) -> LedgerEntry:
        """A waiting reservation fails or is cancelled: then FREE if the writer is known to
        have stopped, else FENCED. An ADMITTED one goes to FREE (its writes all landed).

        `keep_writes_open` (a fenced one, on a ledger with `cancel_confirm_timeout_s`): its
        descriptor stays open until the prefiller confirms, is gone, or that bound passes
        (the caller has asked the prefiller to confirm; see the module)."""
        with self._lock:
            entry = self._entries[request_id]
            if entry.state is S.ADMITTED:
                return self.move(request_id, S.FREE, reason)
            if entry.state in WAITING:
                self.move(request_id, outcome, reason,
                          keep_writes_open=keep_writes_open and not writer_stopped and self.cancel_confirm_timeout_s
                          is not None)
            return self.move(request_id, S.FREE if writer_stopped else S.FENCED, reason)

    def revoke_writes(self, request_id: str) -> LedgerEntry | None:
        """Closes a fenced entry's writes kept open for its prefiller's confirmation (its
        `cancel_confirm_timeout_s` passed, or its prefiller is gone); the fence then runs to
        `fence_timeout_s` after FENCED, as for an entry closed at once. The entry, or None
        where nothing was open (or it is unknown)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or not entry.writes_open:
                return None
            entry.writes_open = False
            self._close_writes(request_id)
            if entry.deadline_setting is DeadlineSetting.CANCEL_CONFIRM:
                entry.deadline, entry.deadline_setting = entry.fence_ends_at, DeadlineSetting.FENCE
            return entry

    def writer_stopped(self, request_id: str) -> LedgerEntry | None:
        """The prefiller confirmed none of its writes can land: an ended entry goes to FREE.

        Returns the entry if it was freed, None if it still waits or runs (the confirmation
        of a stopped writer does not end a request by itself) or is unknown.
        """
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.state not in ENDED_UNCONFIRMED:
                return None
            return self.move(request_id, S.FREE, "prefiller confirmed that its writes stopped")

    def writer_gone(self, request_id: str, fence_s: float) -> LedgerEntry | None:
        """The prefiller process is gone (it can post nothing more, and the reservation's
        registration is revoked, here where it was kept open): a FENCED entry's fence ends
        at most `fence_s` from now,
        the grace for the rest of the op under way at the revoke, which the revoke does not
        stop and the dead writer's kernel still sends; 0 where no connection of the writer
        is left after the revoke (`TransferEngine.sever_peer` proved it), so none of that op
        can land. None unless it is FENCED."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.state is not S.FENCED:
                return None
            self.revoke_writes(request_id)  # the grace below counts from the revoke
            cut = self._clock() + fence_s
            assert entry.deadline is not None
            if cut < entry.deadline:
                entry.deadline, entry.deadline_setting = cut, DeadlineSetting.WRITER_GONE
            entry.writer_gone = True
            return entry

    def _set_waiting_deadline(self, entry: LedgerEntry) -> None:
        """The earlier of the TTL and the stall bound (lock held)."""
        entry.deadline, entry.deadline_setting = entry.expires_at, DeadlineSetting.RESERVATION_TTL
        if self.stall_timeout_s is not None and entry.progress_at + self.stall_timeout_s < entry.expires_at:
            entry.deadline, entry.deadline_setting = entry.progress_at + self.stall_timeout_s, DeadlineSetting.STALL
