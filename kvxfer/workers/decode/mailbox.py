"""The decode worker's mailbox: one slot per reservation, where the prefiller's last write
puts the record (nonce, first token, prompt length) and the pages' checksum table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.kv.protocol import mailbox_slot_bytes, pages_for_tokens
from kvxfer.transfer.engine import RegisteredMemory
from kvxfer.workers.worker_core import WorkerCore


@dataclass(frozen=True)
class DecodeMailbox:
    """The registered mailbox buffer and the size of one slot."""

    buffer: np.ndarray
    region: RegisteredMemory
    slot_stride: int

    @classmethod
    def register(cls, core: WorkerCore, slots: int, num_pages: int) -> "DecodeMailbox":
        """A zeroed mailbox of `slots` slots, registered with the worker's engine. Each slot
        holds the record and one CRC-32C per (layer, page) of the longest prompt."""
        cfg = core.config
        max_prompt_pages = min(pages_for_tokens(cfg.max_context, cfg.block_size), num_pages)
        stride = mailbox_slot_bytes(cfg.num_layers, max_prompt_pages)
        buffer = np.zeros(slots * stride, dtype=np.uint8)
        return cls(buffer=buffer, region=core.engine.register(buffer), slot_stride=stride)

    def offset(self, slot: int) -> int:
        """Byte offset of `slot` in the buffer (the reservation's `meta_offset`)."""
        return slot * self.slot_stride

    def read(self, slot: int) -> bytes:
        """A copy of what landed in `slot`."""
        offset = self.offset(slot)
        return bytes(self.buffer[offset : offset + self.slot_stride])
