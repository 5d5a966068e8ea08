"""The prefill/decode hand-off contract: the reservation a decoder hands out and the mailbox.

The decoder reserves pages and hands out a `KVReservation`: its KV cache descriptor, the
page ids, an immediate value and how many units of it to expect. The prefiller writes each
layer's pages with that immediate and finally a small mailbox record (first token, prompt
length, nonce); the decoder admits the request when its ImmCounter reaches
`expected_count`, which is `num_layers * pages(prompt) + 1` whatever the engine coalesced
or sharded. The router forwards the reservation between the two; all three use this module.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kvxfer.kv.layout import pages_for_tokens

#: Bytes of one mailbox slot on the decoder (one per concurrent request).
MAILBOX_SLOT_BYTES = 64
_MAILBOX_MAGIC = 0x4B564D42  # "KVMB"
_MAILBOX_FORMAT = "<IQii"  # magic, nonce, first_token, prompt_tokens


def expected_imm_count(num_layers: int, prompt_tokens: int, block_size: int) -> int:
    """Units the decoder waits for: one per pushed page per layer, plus the mailbox write."""
    return num_layers * pages_for_tokens(prompt_tokens, block_size) + 1


def encode_mailbox(nonce: int, first_token: int, prompt_tokens: int) -> bytes:
    """The record the prefiller writes last: what decode needs besides the KV pages."""
    record = struct.pack(_MAILBOX_FORMAT, _MAILBOX_MAGIC, nonce, first_token, prompt_tokens)
    return record.ljust(MAILBOX_SLOT_BYTES, b"\0")


def decode_mailbox(raw: bytes) -> tuple[int, int, int]:
    """Returns (nonce, first_token, prompt_tokens); raises ValueError on a foreign record."""
    magic, nonce, first_token, prompt_tokens = struct.unpack_from(_MAILBOX_FORMAT, raw)
    if magic != _MAILBOX_MAGIC:
        raise ValueError("mailbox slot holds no kvxfer record")
    return nonce, first_token, prompt_tokens


@dataclass(frozen=True)
class KVReservation:
    """Where a prefiller must push one request's KV on a decode worker.

    `descriptor` covers the decoder's whole KV cache tensor (`num_pages` pages per layer);
    `pages` are the request's page ids in block-table order; `meta_descriptor` and
    `meta_offset` locate its mailbox slot; `imm` and `expected_count` gate admission.
    """

    request_id: str
    descriptor: bytes
    pages: list[int]
    num_pages: int
    imm: int
    expected_count: int
    kv_layout: str
    meta_descriptor: bytes
    meta_offset: int
    nonce: int

    def to_json(self) -> dict[str, Any]:
        """JSON form used by the HTTP API (bytes as hex)."""
        return {
            "request_id": self.request_id,
            "descriptor": self.descriptor.hex(),
            "pages": list(self.pages),
            "num_pages": self.num_pages,
            "imm": self.imm,
            "expected_count": self.expected_count,
            "kv_layout": self.kv_layout,
            "meta_descriptor": self.meta_descriptor.hex(),
            "meta_offset": self.meta_offset,
            "nonce": self.nonce,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "KVReservation":
        """Parses the HTTP form; raises ValueError/KeyError on malformed input."""
        return cls(
            request_id=str(data["request_id"]),
            descriptor=bytes.fromhex(data["descriptor"]),
            pages=[int(p) for p in data["pages"]],
            num_pages=int(data["num_pages"]),
            imm=int(data["imm"]),
            expected_count=int(data["expected_count"]),
            kv_layout=str(data["kv_layout"]),
            meta_descriptor=bytes.fromhex(data["meta_descriptor"]),
            meta_offset=int(data["meta_offset"]),
            nonce=int(data["nonce"]),
        )
