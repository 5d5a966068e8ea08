"""End-to-end integrity of a KV push: per-(layer, page) CRC-32C, the decoder's check, the receipt.

The prefiller checksums each layer's pages as it pushes them (`layer_checksums`, native
CRC-32C over the cache memory, no copy) and sends the table in the mailbox write, the
push's last write (`kv.protocol.encode_mailbox`), so the ImmCounter that gates admission
also says the table landed. Before admission the decoder recomputes the checksums of the
pages that landed and compares (`verify_pages`): every (layer, page) with
`KVIntegrity.FULL`, a seeded random share (at least one page per layer) with `SAMPLED`,
none with `OFF`. The verdict goes into a `TransferReceipt` (bytes, pages, wire time,
verification) that the decoder logs and returns to the router.

CRC-32C is not keyed: whoever can write into a reservation can also send the right table
for what it wrote. So where the cluster has a key, the table is tagged (HMAC-SHA256 under
`registry.signing.checksum_table_key`, over the record, the table and the reservation's
immediate: `kv.protocol.mailbox_tag_verifies`), and the decoder admits no table whose tag
does not verify (docs/architecture.md, "Threat model").

`prompt_kv_digest` is the test oracle's digest: one CRC-32C over the prompt's KV, layer
by layer and page by page in block-table order, over the token rows the prompt fills only
(the tail of a last partial page holds whatever the page held before, on both sides), so a
disaggregated request can be compared with the colocated reference by bytes, not tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from kvxfer.transfer.native_library import native as _native
from kvxfer.errors import KvxferError
from kvxfer.kv.cache import PagedKVCache
from kvxfer.metrics import INTEGRITY_FAILURE_REASONS

__all__ = [
    "INTEGRITY_FAILURE_REASONS",
    "KVIntegrity",
    "KVIntegrityError",
    "TransferReceipt",
    "Verification",
    "crc32c",
    "layer_checksums",
    "prompt_kv_digest",
    "verify_pages",
]


class KVIntegrity(str, Enum):
    """How much of a request's landed KV the decoder checks before admitting it."""

    OFF = "off"  # nothing: the prefiller is not even asked for checksums
    SAMPLED = "sampled"  # a random share of (layer, page) pairs, at least one per layer
    FULL = "full"  # every (layer, page) pair


class KVIntegrityError(KvxferError):
    """A request's KV failed its end-to-end check; `reason` is one of `INTEGRITY_FAILURE_REASONS`."""

    def __init__(self, request_id: str, reason: str, detail: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"request {request_id}: KV integrity check failed ({reason}): {detail}")


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of a contiguous buffer (bytes, numpy array...); continue with `crc`."""
    return int(_native.crc32c(data, crc))


def layer_checksums(cache: PagedKVCache, layer: int, pages: Sequence[int] | np.ndarray) -> np.ndarray:
    """CRC-32C (uint32) of each of `pages` of `layer`, whole pages, in the order given."""
    ids = np.ascontiguousarray(pages, dtype=np.int64)
    return _native.page_crc32c(cache.data_ptr, cache.nbytes, cache.layer_offset_bytes(layer), cache.page_bytes, ids)


@dataclass
class Verification:
    """What `verify_pages` checked and found: pairs checked, and the mismatching ones as
    (layer, block index, page id)."""

    checked: int = 0
    mismatches: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def verify_pages(
    cache: PagedKVCache,
    pages: Sequence[int],
    expected: np.ndarray,
    mode: KVIntegrity,
    sample_rate: float,
    rng: random.Random | None = None,
) -> Verification:
    """Compares the checksums of `pages` (the prompt's pages, block-table order) of every
    layer with `expected` (shape [num_layers, len(pages)], the prefiller's table).

    SAMPLED checks `ceil(sample_rate * len(pages))` random blocks of each layer (at least
    one), so a defect confined to one layer is still found with that probability.
    """
    return compare_checksums(cache.num_layers, pages, expected, mode, sample_rate, rng or random.Random(),
                             lambda layer, ids: layer_checksums(cache, layer, ids))


def compare_checksums(
    num_layers: int,
    pages: Sequence[int],
    expected: np.ndarray,
    mode: KVIntegrity,
    sample_rate: float,
    rng: random.Random,
    checksums_of: Callable[[int, np.ndarray], np.ndarray],
) -> Verification:
    """The one check both decoders run: per layer, `checksums_of(layer, page ids)` of every
    page (FULL) or of `ceil(sample_rate * len(pages))` random ones (SAMPLED, at least one),
    against `expected[layer, position]`. Mismatches are (layer, position, page id)."""
    verification = Verification()
    if mode is KVIntegrity.OFF or not len(pages):
        return verification
    ids = np.asarray(pages, dtype=np.int64)
    n = len(ids)
    for layer in range(num_layers):
        if mode is KVIntegrity.FULL:
            positions = np.arange(n)
        else:
            count = min(n, max(1, int(np.ceil(sample_rate * n))))
            positions = np.asarray(sorted(rng.sample(range(n), count)), dtype=np.int64)
        got = checksums_of(layer, ids[positions])
        verification.checked += len(positions)
        for position in positions[got != expected[layer, positions]]:
            verification.mismatches.append((layer, int(position), int(ids[position])))
    return verification


def prompt_kv_digest(cache: PagedKVCache, pages: Sequence[int], num_tokens: int) -> int:
    """One CRC-32C over the prompt's K and V rows of every layer, in block-table order:
    equal for two caches exactly when they hold the same prompt KV in the same order."""
    raw = cache.as_bytes()
    row_bytes = cache.page_bytes // (2 * cache.block_size)  # one token's K (or V) of one page
    digest = 0
    for layer in range(cache.num_layers):
        for block, page in enumerate(pages[: cache.pages_for_tokens(num_tokens)]):
            rows = min(cache.block_size, num_tokens - block * cache.block_size)
            start = cache.page_offset_bytes(layer, page)
            for half in (0, 1):  # K rows, then V rows of the page
                begin = start + half * cache.block_size * row_bytes
                digest = crc32c(raw[begin : begin + rows * row_bytes].numpy(), digest)
    return digest


@dataclass
class TransferReceipt:
    """What the decoder saw of one request's push: logged at admission, returned with
    /generate (body field `receipt`, header `X-Kvxfer-Transfer-Receipt`) so the router sees it.

    `verdict`: `verified` (every page checked and equal), `sampled` (the sample was equal),
    `unchecked` (kv_integrity off); a failed check is an error, not a receipt. `wire_ms` runs from the first
    immediate the decoder saw (to within its reaper interval) to the last write landing.
    """

    request_id: str
    kv_bytes: int
    pages: int
    layers: int
    wire_ms: float
    verify_ms: float
    verdict: str
    pages_checked: int
    mismatches: int = 0
    #: `prompt_kv_digest` of the landed prompt KV, when the decoder's kv_receipt_digest is on.
    kv_digest: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The receipt as a JSON object."""
        return asdict(self)

    def header_value(self) -> str:
        """A compact one-line form for an HTTP header (`key=value;...`)."""
        digest = "" if self.kv_digest is None else f";kv_digest={self.kv_digest:08x}"
        return (f"verdict={self.verdict};kv_bytes={self.kv_bytes};pages={self.pages};layers={self.layers};"
                f"wire_ms={self.wire_ms:.3f};verify_ms={self.verify_ms:.3f};pages_checked={self.pages_checked};"
                f"mismatches={self.mismatches}{digest}")
