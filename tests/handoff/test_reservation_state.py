"""The one reservation state table both decoders follow (kvxfer.handoff.reservation_state):
its shape, read as the guarantees the hand-off relies on."""

from __future__ import annotations

import pytest

from kvxfer.handoff.reservation_state import (
    ENDED_UNCONFIRMED,
    TRANSITIONS,
    WAITING,
    IllegalTransition,
    ReservationState as S,
)


def reachable(source: S) -> set[S]:
    seen, todo = set(), [source]
    while todo:
        for target in TRANSITIONS[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_state_is_reachable_and_every_reservation_can_end_free() -> None:
    assert reachable(S.RESERVED) == set(S) - {S.RESERVED}
    for state in set(S) - {S.FREE}:
        assert S.FREE in reachable(state), state
    assert TRANSITIONS[S.FREE] == frozenset()


def test_only_a_waiting_reservation_is_admitted_and_nothing_goes_back_to_waiting() -> None:
    assert {s for s in S if S.ADMITTED in TRANSITIONS[s]} == WAITING
    assert all(not (TRANSITIONS[s] & WAITING) for s in set(S) - {S.RESERVED})
    assert TRANSITIONS[S.RESERVED] & WAITING == {S.RECEIVING}


def test_pages_a_write_may_still_reach_are_fenced_or_freed_never_reused_otherwise() -> None:
    # From an unconfirmed end the only ways out are the fence and FREE (on the writer's word
    # or the fence deadline); an admitted reservation's writes all landed: straight to FREE.
    for state in ENDED_UNCONFIRMED:
        assert TRANSITIONS[state] <= {S.FENCED, S.FREE}, state
    # A failure whose writer is known to have stopped frees its pages at once, unfenced.
    assert TRANSITIONS[S.FAILED] == TRANSITIONS[S.CANCELLED] == {S.FENCED, S.FREE}
    assert TRANSITIONS[S.ADMITTED] == {S.FREE}
    assert not (ENDED_UNCONFIRMED & WAITING) and S.ADMITTED not in ENDED_UNCONFIRMED


@pytest.mark.parametrize(("current", "target", "allowed"), [
    (S.FENCED, S.ADMITTED, "free"),
    (S.FREE, S.RESERVED, "nothing"),
    (S.ADMITTED, S.FENCED, "free"),
])
def test_an_illegal_transition_says_what_was_tried_and_what_is_allowed(current: S, target: S, allowed: str) -> None:
    error = IllegalTransition("r", current, target)
    assert target not in TRANSITIONS[current]
    assert str(error) == (f"reservation 'r': {current.value} -> {target.value} is not allowed "
                          f"(from {current.value}: {allowed})")
