"""A decoder's immediates: which slot and generation each live reservation carries.

An immediate is a slot and that slot's generation (`kv.protocol.encode_imm`). Every taking
of a slot gets the slot's next generation, so a late write of an earlier holder carries
another value and never counts for the new one; and free slots are handed out FIFO, so a
freed slot (and, generations later, its value) comes back as late as possible. The
`decode_ledger.ReservationLedger` owns one of these for both engines; nothing else hands
out slots.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from kvxfer.kv.protocol import MAX_SLOTS, encode_imm, generations_per_slot


class Immediate(NamedTuple):
    """One taking of a slot: the slot, its generation and the immediate they encode."""

    slot: int
    generation: int
    imm: int


class ImmediateSlots:
    """`max_slots` slots, each cycling through `generations_per_slot(max_slots)` generations.

    Not thread-safe: its owner (the ledger) serialises calls.
    """

    def __init__(self, max_slots: int) -> None:
        if not 0 < max_slots <= MAX_SLOTS:
            raise ValueError(f"max_slots must be in 1..{MAX_SLOTS}, got {max_slots}")
        self.size = max_slots
        self._generations = generations_per_slot(max_slots)
        self._next_generation = [0] * max_slots
        self._free: deque[int] = deque(range(max_slots))
        self._held = [False] * max_slots

    @property
    def free(self) -> int:
        """Slots not held by any reservation."""
        return len(self._free)

    def take(self) -> Immediate | None:
        """The least recently freed slot with its next generation; None when all are held."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._held[slot] = True
        generation = self._next_generation[slot]
        self._next_generation[slot] = (generation + 1) % self._generations
        return Immediate(slot, generation, encode_imm(slot, generation))

    def give_back(self, slot: int) -> None:
        """`slot` is free again; it is handed out after every slot freed before it."""
        if not 0 <= slot < self.size or not self._held[slot]:
            raise ValueError(f"slot {slot} is not held (slots 0..{self.size - 1})")
        self._held[slot] = False
        self._free.append(slot)
