"""The one state machine of a KV push, for both senders: the builtin prefiller's
`PushSession` and the vLLM connector's `PrefillPush`.

    WAITING_FOR_RESERVATION --reservation--> PUSHING --every write landed--> DONE
           |        \\                          |  \\--cancelled--> STOPPING --drained--> DONE
           |         \\--cancelled--> STOPPING   \\--write failed, stalled, bad reservation--> FAILED
           \\--no reservation in time, bad reservation--> FAILED

A push whose reservation is known when it starts (the builtin prefiller: the router relays
it with the request) starts in PUSHING; the connector's starts WAITING_FOR_RESERVATION,
because vLLM may compute the prompt before the decoder's reservation arrives. STOPPING is
a cancelled push draining the writes already posted: nothing more is posted, and only once
none is in flight may the decoder reuse its pages. DONE and FAILED are final. Every change
goes through `PushLifecycle.move`, which refuses one the table does not list with
`IllegalTransition`: a sender that would post after its push ended is a bug to see, not to
absorb.
"""

from __future__ import annotations

import enum

from kvxfer.errors import KvxferError


class PushState(enum.Enum):
    """Where one push is (see the module's diagram)."""

    WAITING_FOR_RESERVATION = "waiting_for_reservation"
    PUSHING = "pushing"
    STOPPING = "stopping"  # cancelled: drain the writes in flight, then confirm
    DONE = "done"
    FAILED = "failed"


#: The changes a push may make; DONE and FAILED are final.
TRANSITIONS: dict[PushState, frozenset[PushState]] = {
    PushState.WAITING_FOR_RESERVATION: frozenset({PushState.PUSHING, PushState.STOPPING, PushState.FAILED}),
    PushState.PUSHING: frozenset({PushState.STOPPING, PushState.DONE, PushState.FAILED}),
    PushState.STOPPING: frozenset({PushState.DONE, PushState.FAILED}),
    PushState.DONE: frozenset(),
    PushState.FAILED: frozenset(),
}

#: States in which a push posts writes or will (it is neither cancelled nor ended).
LIVE = frozenset({PushState.WAITING_FOR_RESERVATION, PushState.PUSHING})
#: States a push never leaves.
FINAL = frozenset({PushState.DONE, PushState.FAILED})


class IllegalTransition(KvxferError, RuntimeError):
    """A push was asked to change state in a way the table does not allow (a sender bug)."""

    def __init__(self, push_id: str, current: PushState, target: PushState) -> None:
        self.push_id = push_id
        self.current = current
        self.target = target
        super().__init__(f"push {push_id}: no transition from {current.value} to {target.value}")


class PushLifecycle:
    """One push's state and why it left PUSHING, changed only along `TRANSITIONS`.

    Not thread-safe on its own: the builtin sender changes it under its issue lock, the
    connector from vLLM's worker thread only.
    """

    __slots__ = ("push_id", "state", "reason")

    def __init__(self, push_id: str, state: PushState = PushState.WAITING_FOR_RESERVATION) -> None:
        self.push_id = push_id
        self.state = state
        self.reason = ""

    def move(self, target: PushState, reason: str = "") -> None:
        """Changes to `target` (recording `reason` where given); IllegalTransition if the
        table does not allow it."""
        if target not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.push_id, self.state, target)
        self.state = target
        if reason:
            self.reason = reason

    @property
    def live(self) -> bool:
        """Neither cancelled nor ended: writes may still be posted."""
        return self.state in LIVE

    @property
    def final(self) -> bool:
        """DONE or FAILED."""
        return self.state in FINAL

    def __repr__(self) -> str:
        return f"PushLifecycle({self.push_id}, {self.state.value}, reason={self.reason!r})"
