"""Page checksums on the vLLM path: the builtin workers' end-to-end check (kv.integrity) for
the connector, with the same settings (`kv_integrity`: off, sampled, full;
`kv_integrity_sample_rate`).

The prefiller takes the CRC-32C of every (layer, block) it pushes just before it posts the
write (`block_checksums`), so the table says what it meant to send. The vLLM path has no
mailbox: once the last write of a push is posted, the table goes to the decoder as control
messages (`encode_table`, a few whole layers each so that one fits the engine's control
message bound), each carrying the reservation's immediate and nonce and, where the cluster
has a key, an HMAC-SHA256 tag under the cluster's table key
(`registry.signing.checksum_table_key`, the builtin path's key) over the part and the
immediate. The decoder (`LoadChecksums`) takes only parts whose nonce is the load's and,
with a key, whose tag verifies; it admits a load only once every write landed and the
whole table is there, after recomputing the checksums of its blocks (every one with
`full`, a seeded random share per layer with `sampled`) and comparing. A block's checksum
is the CRC-32C of its byte runs in address order (`CacheGeometry.runs`), which both sides
lay out alike (the kv_layout check made sure). With several KV cache groups the table has
a row per layer and a column per prompt page, and a layer's pages are its group's
(`verify_groups`: the columns its group keeps none of are left out).
"""

from __future__ import annotations

import hashlib
import hmac
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxfer.kv.integrity import KVIntegrity, KVIntegrityError, Verification, compare_checksums, crc32c
from kvxfer.kv.protocol import MAX_CONTROL_MESSAGE_BYTES, PROTOCOL_VERSION
from kvxfer.transfer.native_library import native as _native

from .kv_region import KVRegion

_TABLE_MAGIC = b"KVCT"
# magic, protocol version, imm, nonce, first layer, layers in this part, pages per layer,
# tagged (0 or 1); then the tag (MAILBOX-style HMAC-SHA256, zeros when untagged); then the
# part's checksums, little-endian uint32, layer-major.
_TABLE_FORMAT = "<4sHIQIIIB"
_HEADER_BYTES = struct.calcsize(_TABLE_FORMAT)
_TAG_BYTES = 32
# Sets this tag apart from every other HMAC under the table key (the mailbox's included).
_TAG_DOMAIN = b"kvxfer/vllm-kv-table/v1"


def block_checksums(region: KVRegion, layer: int, blocks: Sequence[int],
                    heads: tuple[int, int] | None = None) -> np.ndarray:
    """CRC-32C (uint32) of each of `blocks` of `layer`, in the order given; of heads
    `heads` ([first, end), local) of each block only where given (a tensor parallel peer
    of another size sends or receives that slice).

    A block that is one run of exactly its stride (vLLM's CPU layout) is read in place by
    the native page checksum; otherwise each block's runs are chained in address order.
    A device cache is copied to the host block by block (slow: CUDA caches only).
    """
    g = region.geometry
    slot = region.slot(layer)  # several groups: the geometry layer that holds `layer`
    ids = np.ascontiguousarray(blocks, dtype=np.int64)
    if heads is None and region.buffer is not None and g.block_runs() == [(0, g.page_bytes)] \
            and g.block_stride == g.page_bytes and not region.state_length(layer):
        buf = region.buffer
        return _native.page_crc32c(buf.ctypes.data, buf.nbytes, g.offset(slot, 0), g.page_bytes, ids)
    out = np.empty(len(ids), dtype=np.uint32)
    for i, block in enumerate(ids):
        if region.buffer is None:
            out[i] = crc32c(region.page_bytes(layer, int(block), heads))
            continue
        crc = 0
        for start, length in region.layer_runs(layer, int(block), heads):  # a Mamba layer's state only
            crc = crc32c(region.buffer[start:start + length], crc)
        out[i] = crc
    return out


def _tag(table_key: bytes, header: bytes, table: bytes) -> bytes:
    return hmac.new(table_key, _TAG_DOMAIN + header + table, hashlib.sha256).digest()


def encode_table(imm: int, nonce: int, table: np.ndarray, table_key: bytes | None) -> list[bytes]:
    """The control messages that carry `table` ([layers, pages] uint32) to the decoder:
    whole layers per message, as many as fit; tagged under `table_key` where given."""
    layers, pages = table.shape
    room = MAX_CONTROL_MESSAGE_BYTES - _HEADER_BYTES - _TAG_BYTES
    per_part = max(1, room // max(1, 4 * pages))
    parts = []
    for first in range(0, layers, per_part):
        count = min(per_part, layers - first)
        body = np.ascontiguousarray(table[first:first + count], dtype="<u4").tobytes()
        header = struct.pack(_TABLE_FORMAT, _TABLE_MAGIC, PROTOCOL_VERSION, imm, nonce, first, count, pages,
                             int(table_key is not None))
        tag = _tag(table_key, header, body) if table_key is not None else bytes(_TAG_BYTES)
        parts.append(header + tag + body)
    return parts


@dataclass(frozen=True)
class TablePart:
    """One control message of a checksum table, as it arrived (not yet trusted)."""

    imm: int
    nonce: int
    first_layer: int
    layers: int
    pages: int
    tagged: bool
    header: bytes
    tag: bytes
    body: bytes

    def table(self) -> np.ndarray:
        """The part's checksums, [layers, pages]."""
        return np.frombuffer(self.body, dtype="<u4").reshape(self.layers, self.pages)

    def tag_verifies(self, table_key: bytes) -> bool:
        """True when the part is tagged and its tag is the one `table_key` gives it."""
        return self.tagged and hmac.compare_digest(self.tag, _tag(table_key, self.header, self.body))


def decode_table(raw: bytes) -> TablePart | None:
    """The checksum-table part a control message carries; None for any other message or a
    malformed part (its sizes disagree)."""
    if len(raw) < _HEADER_BYTES + _TAG_BYTES or not raw.startswith(_TABLE_MAGIC):
        return None
    _, version, imm, nonce, first, layers, pages, tagged = struct.unpack_from(_TABLE_FORMAT, raw)
    body = raw[_HEADER_BYTES + _TAG_BYTES:]
    if version != PROTOCOL_VERSION or tagged > 1 or len(body) != 4 * layers * pages:
        return None
    return TablePart(imm, nonce, first, layers, pages, bool(tagged), raw[:_HEADER_BYTES],
                     raw[_HEADER_BYTES:_HEADER_BYTES + _TAG_BYTES], body)


@dataclass
class LoadChecksums:
    """The decoder's side of one load's table: the parts that arrived, then the check.

    `accept` takes a part for this load (the caller matched its immediate); it refuses a
    part with another nonce, an untagged or badly tagged one where `table_key` is set, or
    one whose shape is not this load's [num_layers, pages].
    """

    request_id: str
    nonce: int
    num_layers: int
    pages: int
    table_key: bytes | None
    table: np.ndarray = field(init=False)
    _have: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.table = np.zeros((self.num_layers, self.pages), dtype=np.uint32)
        self._have = np.zeros(self.num_layers, dtype=bool)

    def accept(self, part: TablePart) -> str:
        """Stores the part; returns "" or why it was refused (the `reason` of a drop)."""
        if part.nonce != self.nonce:
            return "wrong_nonce"
        if self.table_key is not None and not part.tag_verifies(self.table_key):
            return "bad_tag"
        if part.pages != self.pages or part.first_layer + part.layers > self.num_layers:
            return "wrong_shape"
        self.table[part.first_layer:part.first_layer + part.layers] = part.table()
        self._have[part.first_layer:part.first_layer + part.layers] = True
        return ""

    @property
    def complete(self) -> bool:
        """Every layer's checksums arrived."""
        return bool(self._have.all())

    def verify(self, region: KVRegion, blocks: Sequence[int], first_page: int, mode: KVIntegrity,
               sample_rate: float, rng: random.Random, heads: tuple[int, int] | None = None) -> Verification:
        """Compares the checksums of the landed `blocks` (prompt pages `first_page...`; heads
        `heads` of them where given) with the table; raises KVIntegrityError naming the request, the first mismatching layer,
        block and prompt page."""
        if mode is KVIntegrity.OFF or not len(blocks):
            return Verification()
        if not self.complete:
            raise KVIntegrityError(self.request_id, "checksums_missing", "the prefiller's checksum table did not "
                                   f"arrive for every layer ({int(self._have.sum())} of {self.num_layers})")
        verification = compare_checksums(self.num_layers, blocks, self.table, mode, sample_rate, rng,
                                         lambda layer, ids: block_checksums(region, layer, ids, heads))
        self._raise_on_mismatch(verification, first_page)
        return verification

    def verify_groups(self, region: KVRegion, group_pages: Sequence[Sequence[int]], first_page: int,
                      mode: KVIntegrity, sample_rate: float, rng: random.Random,
                      heads: tuple[int, int] | None = None) -> Verification:
        """As `verify`, for a cache of several KV cache groups: each layer's row against its
        group's landed pages (`group_pages[g]`, per prompt page from `first_page`, -1 where
        the group keeps none; heads `heads` of them where given)."""
        verification = Verification()
        if mode is KVIntegrity.OFF:
            return verification
        if not self.complete:
            raise KVIntegrityError(self.request_id, "checksums_missing", "the prefiller's checksum table did not "
                                   f"arrive for every layer ({int(self._have.sum())} of {self.num_layers})")
        for group, pages in enumerate(group_pages):
            layers = region.group_layers(group)
            columns = np.asarray([i for i, page in enumerate(pages) if page >= 0], dtype=np.int64)
            if not len(layers) or not len(columns):
                continue
            ids = np.asarray(pages, dtype=np.int64)[columns]
            part = compare_checksums(len(layers), ids, self.table[np.ix_(layers, columns)], mode, sample_rate, rng,
                                     lambda i, chosen: block_checksums(region, layers[i], chosen, heads))
            verification.checked += part.checked
            verification.mismatches += [(layers[i], int(columns[position]), block)
                                        for i, position, block in part.mismatches]
        self._raise_on_mismatch(verification, first_page)
        return verification

    def _raise_on_mismatch(self, verification: Verification, first_page: int) -> None:
        if verification.mismatches:
            verification.mismatches.sort()
            layer, index, block = verification.mismatches[0]
            raise KVIntegrityError(
                self.request_id, "checksum_mismatch",
                f"{len(verification.mismatches)} of {verification.checked} checked blocks differ from the "
                f"prefiller's CRC-32C; first: layer {layer}, block {block} (prompt page {first_page + index})")
