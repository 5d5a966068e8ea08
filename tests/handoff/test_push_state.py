"""The push state table (kvxfer.handoff.push_state): the one state machine of both senders
allows exactly the moves of its diagram, and refuses every other one by name."""

from __future__ import annotations

import itertools

import pytest

from kvxfer.handoff.push_state import TRANSITIONS, IllegalTransition, PushLifecycle, PushState

W, P, S, D, F = (PushState.WAITING_FOR_RESERVATION, PushState.PUSHING, PushState.STOPPING, PushState.DONE,
                 PushState.FAILED)

#: The diagram of push_state.py, written out independently of the table it checks.
ALLOWED = {(W, P), (W, S), (W, F), (P, S), (P, D), (P, F), (S, D), (S, F)}


@pytest.mark.parametrize(("current", "target"), sorted(itertools.product(PushState, PushState),
                                                        key=lambda pair: (pair[0].value, pair[1].value)))
def test_a_push_moves_only_along_the_diagram(current: PushState, target: PushState) -> None:
    push = PushLifecycle("t1", current)
    if (current, target) in ALLOWED:
        push.move(target, "why")
        assert (push.state, push.reason) == (target, "why")
    else:
        with pytest.raises(IllegalTransition, match=f"push t1: no transition from {current.value} to {target.value}"):
            push.move(target)
        assert push.state is current


def test_done_and_failed_are_final_and_only_waiting_and_pushing_are_live() -> None:
    assert {s for s, targets in TRANSITIONS.items() if not targets} == {D, F}
    assert {s for s in PushState if PushLifecycle("t", s).live} == {W, P}
    assert {s for s in PushState if PushLifecycle("t", s).final} == {D, F}


def test_a_cancelled_push_drains_then_is_done_and_keeps_why_it_stopped() -> None:
    push = PushLifecycle("t2")
    assert push.state is W
    push.move(P)
    push.move(S, "cancelled by the decoder: load timed out")
    push.move(D)
    assert (push.state, push.reason) == (D, "cancelled by the decoder: load timed out")
    with pytest.raises(IllegalTransition):
        push.move(P)  # an ended push never posts again
