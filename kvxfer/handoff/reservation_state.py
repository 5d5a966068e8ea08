"""The one state machine of a decoder's reservation, for both engines.

A reservation holds pages, a slot and an immediate on a decoder until no write of its
prefiller can land in those pages any more. The builtin decoder (kvxfer/workers/decode/)
and the vLLM connector's receiver (kvxfer/integrations/vllm/kv_receiver.py) both keep it
as a `decode_ledger.ReservationLedger` entry, so both follow this table
(docs/architecture.md, "Reservation states"):

    RESERVED --first write counted--> RECEIVING
    RESERVED | RECEIVING --every write landed and checked--> ADMITTED --ended or reported--> FREE
    RESERVED | RECEIVING --failure, a deadline, a failed check--> FAILED
    RESERVED | RECEIVING --cancel--> CANCELLED
    FAILED | CANCELLED --the writer is known to have stopped--> FREE
    FAILED | CANCELLED --a write may still land--> FENCED
    FENCED --the prefiller confirmed it stopped, or the fence deadline passed--> FREE

Only the table lives here; what a transition does to pages, slots and deadlines is the
ledger's.
"""

from __future__ import annotations

from enum import Enum

from kvxfer.errors import KvxferError


class ReservationState(str, Enum):
    """Where one reservation's pages, slot and immediate are in their life."""

    RESERVED = "reserved"  # pages held, no write counted yet
    RECEIVING = "receiving"  # at least one write of the push landed
    ADMITTED = "admitted"  # every write landed and passed its checks: no write can come
    FAILED = "failed"  # gave up (deadline, abort, failed check); writer state unknown
    CANCELLED = "cancelled"  # cancelled before admission; writer state unknown
    FENCED = "fenced"  # waiting until no write can land (confirmation or fence deadline)
    FREE = "free"  # pages and slot handed back; the entry is gone


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

#: States in which the reservation still waits for its KV (its wait deadlines run).
WAITING = frozenset({S.RESERVED, S.RECEIVING})
#: States after which a prefiller's write may still land (pages must not be reused yet).
ENDED_UNCONFIRMED = frozenset({S.FAILED, S.CANCELLED, S.FENCED})


class LedgerError(KvxferError):
    """Base of the reservation ledger's errors."""


class IllegalTransition(LedgerError, RuntimeError):
    """A transition the table does not allow (a bug in the caller, never a client error)."""

    def __init__(self, request_id: str, current: ReservationState, target: ReservationState) -> None:
        self.request_id = request_id
        self.current = current
        self.target = target
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "nothing"
        super().__init__(f"reservation {request_id!r}: {current.value} -> {target.value} is not allowed "
                         f"(from {current.value}: {allowed})")
