"""A decoder's slots and generations (kvxfer.handoff.immediate_slots): FIFO reuse, a new
generation on every taking, the wrap, and a slot given back twice."""

from __future__ import annotations

import pytest

from kvxfer.handoff.immediate_slots import ImmediateSlots
from kvxfer.kv.protocol import MAX_SLOTS, decode_imm, generations_per_slot


def test_a_freed_slot_is_handed_out_after_every_slot_freed_before_it() -> None:
    slots = ImmediateSlots(3)
    first = [slots.take() for _ in range(3)]
    assert [t.slot for t in first] == [0, 1, 2] and slots.take() is None and slots.free == 0
    slots.give_back(1)
    slots.give_back(0)
    assert [slots.take().slot, slots.take().slot] == [1, 0]  # the order they came back in


def test_every_taking_of_a_slot_carries_its_next_generation_until_the_wrap() -> None:
    slots = ImmediateSlots(1)
    generations = generations_per_slot(1)
    seen = []
    for _ in range(generations + 1):
        taken = slots.take()
        assert decode_imm(taken.imm) == (taken.slot, taken.generation)
        seen.append(taken.generation)
        slots.give_back(taken.slot)
    assert seen == [*range(generations), 0]  # distinct values until the table's budget wraps them


def test_a_slot_not_held_cannot_be_given_back() -> None:
    slots = ImmediateSlots(2)
    taken = slots.take()
    slots.give_back(taken.slot)
    for bad in (taken.slot, 1, 2, -1):  # twice, never taken, out of range
        with pytest.raises(ValueError, match="is not held"):
            slots.give_back(bad)
    assert slots.free == 2


@pytest.mark.parametrize("size", [0, MAX_SLOTS + 1])
def test_a_size_outside_the_immediate_range_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="max_slots must be in"):
        ImmediateSlots(size)
