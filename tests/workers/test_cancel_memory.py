"""The prefill worker's memory of cancelled request ids (workers/prefill/cancel_memory.py),
on a clock the test steps: an id is refused from its cancel until `memory_s` later."""

from __future__ import annotations

import pytest

from kvxfer.workers.prefill.cancel_memory import CancelMemory

MEMORY_S = 600.0


class SteppedClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cancelled_id_is_remembered_until_memory_s_passed() -> None:
    clock = SteppedClock()
    memory = CancelMemory(MEMORY_S, clock=clock)
    memory.remember("late")
    clock.now += MEMORY_S - 1.0
    assert memory.was_cancelled("late")
    clock.now += 1.0
    assert not memory.was_cancelled("late")
    assert len(memory) == 0


def test_an_id_never_cancelled_is_not_remembered() -> None:
    memory = CancelMemory(MEMORY_S, clock=SteppedClock())
    memory.remember("one")
    assert not memory.was_cancelled("other")
    assert len(memory) == 1


def test_a_second_cancel_remembers_the_id_from_then() -> None:
    clock = SteppedClock()
    memory = CancelMemory(MEMORY_S, clock=clock)
    memory.remember("twice")
    clock.now += MEMORY_S - 1.0
    memory.remember("twice")
    clock.now += MEMORY_S - 1.0
    assert memory.was_cancelled("twice")


def test_expired_ids_are_forgotten_so_the_memory_stays_bounded_in_time() -> None:
    clock = SteppedClock()
    memory = CancelMemory(MEMORY_S, clock=clock)
    for i in range(100):
        memory.remember(f"old-{i}")
    clock.now += MEMORY_S
    memory.remember("new")
    assert len(memory) == 1


@pytest.mark.parametrize("memory_s", [0.0, -1.0])
def test_a_memory_that_is_not_positive_is_refused(memory_s: float) -> None:
    with pytest.raises(ValueError, match="cancel memory_s must be positive"):
        CancelMemory(memory_s)
