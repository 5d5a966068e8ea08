"""The decoder's reservation ledger: one explicit state machine per reservation.

A reservation holds KV pages, a mailbox slot and an immediate (slot + generation, see
`protocol.encode_imm`). Its states (docs/architecture.md, "Reservation states"):

    RESERVED --first immediate seen--> RECEIVING
    RESERVED | RECEIVING --every write landed--> ADMITTED --request ended--> FREE
    RESERVED | RECEIVING --failure, KV deadline, TTL--> FAILED
    RESERVED | RECEIVING --cancel--> CANCELLED
    FAILED | CANCELLED --the writer is known to have stopped--> FREE
    FAILED | CANCELLED --a write may still land--> FENCED
    FENCED --the prefiller confirmed it stopped, or fence_timeout_s passed--> FREE

"The writer is known to have stopped" means the prefiller said so (its abort message,
or its /cancel answered `in_flight: false`, relayed by the router); only then, or after
the fence deadline (longer than any prefiller's transfer deadline, which the prefiller
checks against the reservation), do the pages go back to the pool. An ADMITTED request's
writes have all landed, so its pages are freed at once.

Deadlines, all in seconds on the monotonic clock: RESERVED/RECEIVING end at
`reservation_ttl_s` after the reservation; FENCED ends at `fence_timeout_s` after the
fence. `due()` lists the entries whose deadline passed; the decoder's one reaper thread
walks it (no thread or timer per reservation).

The ledger owns the slots (FIFO, so a freed slot is reused as late as possible) and the
generations, and drives the `PageAllocator`; it never touches the engine: `forget_imm` is
called with an entry's immediate when it is fenced and when it is freed, so the decoder
resets its count there; `close_writes` is called with the request id once, when the
reservation stops waiting for its KV (ADMITTED, FAILED or CANCELLED), so the decoder
revokes the descriptor it handed out for it (closes its per-reservation registration). A
write the provider had already accepted may still be landing then, so closing does not
shorten the fence: FAILED/CANCELLED pages stay FENCED as before. Thread-safe: one lock,
held only for bookkeeping.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from kvxfer.errors import KvxferError
from kvxfer.kv.page_allocator import PageAllocator
from kvxfer.kv.protocol import MAX_SLOTS, encode_imm, generations_per_slot


class ReservationState(str, Enum):
    """Where one reservation's pages, slot and immediate are in their life."""

    RESERVED = "reserved"  # pages held, no immediate seen yet
    RECEIVING = "receiving"  # at least one write of the push landed
    ADMITTED = "admitted"  # every write landed: the request decodes; no write can come
    FAILED = "failed"  # gave up (KV deadline, TTL, abort, bad mailbox); writer state unknown
    CANCELLED = "cancelled"  # cancelled before admission; writer state unknown
    FENCED = "fenced"  # waiting until no write can land (confirmation or fence deadline)
    FREE = "free"  # pages and slot back in the pools; the entry is gone


S = ReservationState

#: Every legal transition; anything else raises `IllegalTransition`.
TRANSITIONS: dict[ReservationState, frozenset[ReservationState]] = {
    S.RESERVED: frozenset({S.RECEIVING, S.ADMITTED, S.FAILED, S.CANCELLED}),
    S.RECEIVING: frozenset({S.ADMITTED, S.FAILED, S.CANCELLED}),
    S.ADMITTED: frozenset({S.FREE}),
    S.FAILED: frozenset({S.FENCED, S.FREE}),
    S.CANCELLED: frozenset({S.FENCED, S.FREE}),
    S.FENCED: frozenset({S.FREE}),
    S.FREE: frozenset(),
}

#: States in which the reservation still waits for its KV (the TTL runs).
WAITING = frozenset({S.RESERVED, S.RECEIVING})
#: States after which a prefiller's write may still land (pages must not be reused yet).
ENDED_UNCONFIRMED = frozenset({S.FAILED, S.CANCELLED, S.FENCED})


class LedgerError(KvxferError):
    """Base of the ledger's errors."""


class IllegalTransition(LedgerError, RuntimeError):
    """A transition the table does not allow (a bug in the caller, never a client error)."""

    def __init__(self, request_id: str, current: ReservationState, target: ReservationState) -> None:
        self.request_id = request_id
        self.current = current
        self.target = target
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "nothing"
        super().__init__(f"reservation {request_id!r}: {current.value} -> {target.value} is not allowed "
                         f"(from {current.value}: {allowed})")


class NoSlotError(LedgerError):
    """Every mailbox slot is taken (max_requests reservations live or fenced)."""


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
    reason: str = ""
    history: list[tuple[ReservationState, float]] = field(default_factory=list)


class ReservationLedger:
    """Reservations by request id and immediate, their transitions and deadlines."""

    def __init__(
        self,
        allocator: PageAllocator,
        max_slots: int,
        *,
        reservation_ttl_s: float,
        fence_timeout_s: float,
        forget_imm: Callable[[int], None] = lambda imm: None,
        close_writes: Callable[[str], None] = lambda request_id: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < max_slots <= MAX_SLOTS:
            raise ValueError(f"max_slots must be in 1..{MAX_SLOTS}, got {max_slots}")
        if not reservation_ttl_s > 0 or not fence_timeout_s > 0:
            raise ValueError(f"reservation_ttl_s and fence_timeout_s must be > 0, got {reservation_ttl_s}, {fence_timeout_s}")
        self.allocator = allocator
        self.reservation_ttl_s = reservation_ttl_s
        self.fence_timeout_s = fence_timeout_s
        self._forget_imm = forget_imm
        self._close_writes = close_writes
        self._clock = clock
        self._generations = generations_per_slot(max_slots)
        self._next_generation = [0] * max_slots
        self._free_slots: deque[int] = deque(range(max_slots))
        self._entries: dict[str, LedgerEntry] = {}
        self._by_imm: dict[int, LedgerEntry] = {}
        self._lock = threading.RLock()

    # ---- queries ---------------------------------------------------------------------
    def get(self, request_id: str) -> LedgerEntry | None:
        with self._lock:
            return self._entries.get(request_id)

    def by_imm(self, imm: int) -> LedgerEntry | None:
        """The live entry whose reservation carries `imm` (None for an earlier generation's)."""
        with self._lock:
            return self._by_imm.get(imm)

    def entries(self) -> list[LedgerEntry]:
        with self._lock:
            return list(self._entries.values())

    def count(self, *states: ReservationState) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.state in states)

    def due(self) -> list[LedgerEntry]:
        """Entries whose state's deadline has passed (TTL of a waiting one, fence of a fenced one)."""
        now = self._clock()
        with self._lock:
            return [e for e in self._entries.values() if e.deadline is not None and e.deadline <= now]

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free_slots)

    # ---- transitions -------------------------------------------------------------------
    def open(self, request_id: str, num_tokens: int, prefix: Sequence[bytes] = ()) -> LedgerEntry:
        """A new RESERVED entry: pages for `num_tokens`, a slot, a fresh generation and nonce.

        `prefix`: block hashes of the leading full blocks the request may reuse from the
        allocator's prefix cache (`LedgerEntry.held_pages` says how many it got). Raises
        `NoSlotError`, or the allocator's `OutOfPagesError` / `DuplicateRequestError`;
        nothing is taken then.
        """
        with self._lock:
            if request_id in self._entries:
                raise LedgerError(f"reservation {request_id!r} already exists")
            if not self._free_slots:
                raise NoSlotError(f"reservation {request_id!r}: all {len(self._next_generation)} mailbox slots are taken")
            pages = self.allocator.reserve(request_id, num_tokens, prefix)
            held = self.allocator.held_pages(request_id) if prefix else 0
            slot = self._free_slots.popleft()
            generation = self._next_generation[slot]
            self._next_generation[slot] = (generation + 1) % self._generations
            now = self._clock()
            entry = LedgerEntry(
                request_id=request_id, slot=slot, generation=generation, imm=encode_imm(slot, generation),
                nonce=secrets.randbits(63), pages=pages, deadline=now + self.reservation_ttl_s,
                history=[(S.RESERVED, now)], held_pages=held,
            )
            self._entries[request_id] = entry
            self._by_imm[entry.imm] = entry
            return entry

    def move(self, request_id: str, target: ReservationState, reason: str = "") -> LedgerEntry:
        """Applies one transition and its effect on pages, slot and deadline.

        FENCED puts the pages in the allocator's quarantine and starts the fence deadline;
        FREE returns pages (from quarantine when fenced) and the slot. `forget_imm` runs at
        FENCED and FREE. Raises `IllegalTransition` (and `KeyError` for an unknown id).
        """
        with self._lock:
            entry = self._entries[request_id]
            if target not in TRANSITIONS[entry.state]:
                raise IllegalTransition(request_id, entry.state, target)
            previous = entry.state
            now = self._clock()
            entry.state = target
            entry.history.append((target, now))
            if reason:
                entry.reason = reason
            if previous in WAITING and target not in WAITING:
                # No write of this reservation is wanted any more: revoke its descriptor
                # before anything else can happen to its pages.
                self._close_writes(request_id)
            if target is S.RECEIVING:
                pass  # the TTL keeps running
            elif target is S.FENCED:
                self.allocator.release_after_quiesce(request_id)
                entry.deadline = now + self.fence_timeout_s
                self._forget_imm(entry.imm)
            elif target is S.FREE:
                if previous is S.FENCED:
                    self.allocator.confirm_quiesced(request_id)
                else:
                    self.allocator.free(request_id)
                # Forget what the immediate counted before the slot (and, generations later,
                # this value) can be handed out again.
                self._forget_imm(entry.imm)
                del self._entries[request_id]
                del self._by_imm[entry.imm]
                self._free_slots.append(entry.slot)
                entry.deadline = None
            else:  # ADMITTED, FAILED, CANCELLED: the TTL no longer applies
                entry.deadline = None
            return entry

    def end(self, request_id: str, outcome: ReservationState, *, writer_stopped: bool, reason: str = "") -> LedgerEntry:
        """A waiting reservation fails or is cancelled: then FREE if the writer is known to
        have stopped, else FENCED. An ADMITTED one goes to FREE (its writes all landed)."""
        with self._lock:
            entry = self._entries[request_id]
            if entry.state is S.ADMITTED:
                return self.move(request_id, S.FREE, reason)
            if entry.state in WAITING:
                self.move(request_id, outcome, reason)
            return self.move(request_id, S.FREE if writer_stopped else S.FENCED, reason)

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
