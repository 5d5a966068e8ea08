"""The prefill/decode hand-off contract: the reservation, its immediates, the mailbox, the abort.

The decoder reserves pages and hands out a `KVReservation`: its KV cache descriptor, the
page ids, an immediate value and how many units of it to expect. The prefiller writes each
layer's pages with that immediate and finally a small mailbox record (first token, prompt
length, nonce, and the immediate units the push posted, this write's included); the
decoder admits the request when its ImmCounter reaches `expected_count`, which is
`num_layers * pages(prompt) + 1` whatever the engine coalesced or sharded, and the
mailbox says the push posted exactly that many. A prefiller that cannot finish a push sends an abort message
(`encode_abort`) once none of its writes is in flight any more.

The reservation is checked here, once, at each boundary: the decoder builds it (the
dataclass validates itself), the router parses the decoder's reply with `from_json`, the
prefiller parses what the router forwarded with `from_json`. Every malformed field raises
one `ReservationError` naming the field; nothing else (no KeyError, UnicodeDecodeError,
TypeError) leaks out. The router imports this module, so it must stay free of torch and of
the transfer engine.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvxfer.errors import KvxferError
from kvxfer.kv.layout import layer_offset_bytes, pages_for_tokens

__all__ = [
    "ABORT_MESSAGE_BYTES",
    "IMM_ABORT_BIT",
    "IMM_GENERATION_BITS",
    "IMM_SLOT_BITS",
    "IMM_TABLE_BUDGET",
    "MAILBOX_SLOT_BYTES",
    "MAX_SLOTS",
    "PROTOCOL_VERSION",
    "KVReservation",
    "MailboxRecord",
    "ReservationError",
    "MAX_CONTROL_MESSAGE_BYTES",
    "decode_abort",
    "decode_cancel",
    "decode_imm",
    "decode_mailbox",
    "decode_reservation_message",
    "encode_abort",
    "encode_cancel",
    "encode_imm",
    "encode_mailbox",
    "encode_probe",
    "encode_reservation_message",
    "expected_imm_count",
    "generations_per_slot",
    "is_probe",
    "layer_dst_offset",
    "mailbox_checksums",
    "mailbox_slot_bytes",
    "mailbox_tag_verifies",
    "pages_for_tokens",
]

#: Version of the reservation's JSON form. A side that reads a reservation of another
#: version refuses it (`ReservationError` on `version`) rather than guessing at its fields.
PROTOCOL_VERSION = 1

#: Bytes of the mailbox record (first token, nonce...) at the start of each mailbox slot;
#: slots are a multiple of it apart (`mailbox_slot_bytes`), so slot offsets are too.
MAILBOX_SLOT_BYTES = 64
# A new magic for each new record layout: a record of another layout (a prefiller of an
# older release) reads as no record at all (`mailbox_mismatch`), never as wrong fields.
# "KVMB" was the layout without `units`.
_MAILBOX_MAGIC = 0x4B564D43  # "KVMC"
_OLDER_MAILBOX_MAGICS = {0x4B564D42: "KVMB"}  # named in the error, so a mixed fleet is told why
# magic, nonce, first_token, prompt_tokens, checksum algorithm, checksum count, units; with
# a tagged table its tag follows (MAILBOX_TAG_BYTES: the fields and the tag fill the record's
# 64 bytes). Then, from byte MAILBOX_SLOT_BYTES, the checksum table: `count` little-endian
# uint32, layer-major (layer 0's prompt pages in block-table order, then layer 1's...). The
# table travels in the mailbox write, the push's last write, so the ImmCounter says it landed
# with the KV. `units` is what the push posted with the reservation's immediate, in the
# ImmCounter's units (one per page of a paged write, one per other write), the mailbox write
# included: the count reaching `expected_count` alone cannot tell a complete push from one
# that wrote a page twice while one of its writes (the mailbox's, or the extra one) is not
# counted yet; the mailbox saying how many it sent can (handoff.admission.check_landed).
_MAILBOX_FORMAT = "<IQiiIII"
_MAILBOX_FIELDS_BYTES = struct.calcsize(_MAILBOX_FORMAT)
#: `checksum algorithm` of a mailbox record: none, CRC-32C of each (layer, page), or that
#: table with a tag (HMAC-SHA256 under the cluster's table key, `mailbox_tag_verifies`).
CHECKSUM_NONE = 0
CHECKSUM_CRC32C = 1
CHECKSUM_CRC32C_TAGGED = 2
CHECKSUM_BYTES = 4
#: Bytes of a tagged table's tag (HMAC-SHA256), right after the record's fields.
MAILBOX_TAG_BYTES = 32
# Sets the tag apart from every other HMAC under a key derived from the cluster key.
_TAG_DOMAIN = b"kvxfer/kv-table/v1"

# ---- immediates -------------------------------------------------------------------------
#
# The 32-bit immediate of a reservation: bits 0-15 hold `slot + 1` (never 0, so a zeroed CQ
# word is never a request), bits 16-30 the slot's generation (the epoch), bit 31 is
# reserved and always 0 in a reservation. A slot gets a new generation each time it is
# reserved, so a late write of an earlier holder of the slot carries another immediate and
# is never counted toward the current reservation.

IMM_SLOT_BITS = 16
IMM_GENERATION_BITS = 15
#: Reserved: never set in a reservation's immediate (kept for a future in-band signal).
IMM_ABORT_BIT = 1 << 31
#: Most mailbox slots (concurrent reservations) one decoder can encode.
MAX_SLOTS = (1 << IMM_SLOT_BITS) - 1
#: Distinct immediate values one decoder uses over its whole life. The engine's ImmCounter
#: table never frees a key (native progress_worker.hpp, 65536 entries; a value beyond it is
#: counted nowhere), so generations wrap: `slots * generations_per_slot(slots)` stays under
#: half of that table, which also keeps its open addressing short.
IMM_TABLE_BUDGET = 1 << 15


def generations_per_slot(slots: int, budget: int = IMM_TABLE_BUDGET) -> int:
    """How many generations a slot cycles through before a value comes back (at least 2)."""
    if not 0 < slots <= MAX_SLOTS:
        raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
    return max(2, min(1 << IMM_GENERATION_BITS, budget // slots))


def encode_imm(slot: int, generation: int) -> int:
    """The immediate of a reservation on mailbox slot `slot` in its `generation`."""
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot must be in 0..{MAX_SLOTS - 1}, got {slot}")
    if not 0 <= generation < (1 << IMM_GENERATION_BITS):
        raise ValueError(f"generation must be in 0..{(1 << IMM_GENERATION_BITS) - 1}, got {generation}")
    return (generation << IMM_SLOT_BITS) | (slot + 1)


def decode_imm(imm: int) -> tuple[int, int]:
    """(slot, generation) of a reservation's immediate; ValueError for a value no reservation has."""
    if not 0 < imm < IMM_ABORT_BIT or imm & ((1 << IMM_SLOT_BITS) - 1) == 0:
        raise ValueError(f"immediate {imm:#x} is not a reservation's (slot field 0 or bit 31 set)")
    return (imm & ((1 << IMM_SLOT_BITS) - 1)) - 1, imm >> IMM_SLOT_BITS


# ---- geometry ---------------------------------------------------------------------------

def expected_imm_count(num_layers: int, prompt_tokens: int, block_size: int) -> int:
    """Units the decoder waits for: one per pushed page per layer, plus the mailbox write."""
    return num_layers * pages_for_tokens(prompt_tokens, block_size) + 1


def layer_dst_offset(reservation: "KVReservation", layer: int, page_bytes: int) -> int:
    """Byte offset of page 0 of `layer` in the decoder's cache (its `num_pages` per layer)."""
    return layer_offset_bytes(layer, reservation.num_pages, page_bytes)


# ---- mailbox ----------------------------------------------------------------------------

def mailbox_slot_bytes(num_layers: int, max_prompt_pages: int) -> int:
    """Bytes of one mailbox slot: the record, then room for one checksum per (layer, page)
    of the longest prompt, rounded up to a multiple of `MAILBOX_SLOT_BYTES`."""
    table = CHECKSUM_BYTES * num_layers * max_prompt_pages
    return MAILBOX_SLOT_BYTES + -(-table // MAILBOX_SLOT_BYTES) * MAILBOX_SLOT_BYTES


def encode_mailbox(nonce: int, first_token: int, prompt_tokens: int, checksums: bytes = b"", *, units: int,
                   table_key: bytes | None = None, imm: int = 0) -> bytes:
    """The record the prefiller writes last: what decode needs besides the KV pages and
    `units`, the immediate units its push posted with the reservation's immediate (this
    record's write included), then the CRC-32C table of the pushed pages (`checksums`,
    little-endian uint32, layer-major; empty when the reservation asked for none). With
    `table_key` the record carries the tag of its fields and table for the reservation
    whose immediate is `imm`."""
    if len(checksums) % CHECKSUM_BYTES:
        raise ValueError(f"checksum table of {len(checksums)} bytes is not a whole number of uint32")
    if not 0 < units < 1 << 32:
        raise ValueError(f"a push posts 1 to 2**32 - 1 units (its mailbox write included), not {units}")
    algorithm = CHECKSUM_NONE
    if checksums:
        algorithm = CHECKSUM_CRC32C if table_key is None else CHECKSUM_CRC32C_TAGGED
    fields = struct.pack(_MAILBOX_FORMAT, _MAILBOX_MAGIC, nonce, first_token, prompt_tokens, algorithm,
                         len(checksums) // CHECKSUM_BYTES, units)
    tag = _mailbox_tag(table_key, imm, fields, checksums) if table_key is not None and checksums else b""
    return (fields + tag).ljust(MAILBOX_SLOT_BYTES, b"\0") + checksums


def _mailbox_tag(table_key: bytes, imm: int, fields: bytes, checksums: bytes) -> bytes:
    # Over the record's fields (nonce, first token, prompt length, algorithm, count, units)
    # and the table, and the immediate: a tag is good for one reservation's record only.
    message = _TAG_DOMAIN + struct.pack("<I", imm) + fields + checksums
    return hmac.new(table_key, message, hashlib.sha256).digest()


def mailbox_tag_verifies(raw: bytes, table_key: bytes, imm: int) -> bool:
    """True when the record in `raw` (a mailbox slot) has a tagged table whose tag is the
    one `table_key` gives for it and the reservation's immediate `imm`. False for an
    untagged or foreign record, a slot shorter than its table, or any other tag."""
    if len(raw) < MAILBOX_SLOT_BYTES:
        return False
    magic, _, _, _, algorithm, count, _ = struct.unpack_from(_MAILBOX_FORMAT, raw)
    end = MAILBOX_SLOT_BYTES + count * CHECKSUM_BYTES
    if magic != _MAILBOX_MAGIC or algorithm != CHECKSUM_CRC32C_TAGGED or end > len(raw):
        return False
    tag = raw[_MAILBOX_FIELDS_BYTES:_MAILBOX_FIELDS_BYTES + MAILBOX_TAG_BYTES]
    want = _mailbox_tag(table_key, imm, bytes(raw[:_MAILBOX_FIELDS_BYTES]), bytes(raw[MAILBOX_SLOT_BYTES:end]))
    return hmac.compare_digest(tag, want)


class MailboxRecord(NamedTuple):
    """The fields of a mailbox record (`encode_mailbox`): the reservation's nonce, the first
    token, the prompt's length and the immediate units the push says it posted, its
    mailbox write included."""

    nonce: int
    first_token: int
    prompt_tokens: int
    units: int


def decode_mailbox(raw: bytes) -> MailboxRecord:
    """The record's fields; raises ValueError on a foreign record, naming an older
    release's layout where it is one."""
    magic, nonce, first_token, prompt_tokens, _, _, units = struct.unpack_from(_MAILBOX_FORMAT, raw)
    if magic in _OLDER_MAILBOX_MAGICS:
        raise ValueError(f"the mailbox holds a record of an older kvxfer release's layout "
                         f"({_OLDER_MAILBOX_MAGICS[magic]}, which does not declare the units its push posted): "
                         f"run prefill and decode workers of the same release")
    if magic != _MAILBOX_MAGIC:
        raise ValueError("mailbox slot holds no kvxfer record")
    return MailboxRecord(nonce, first_token, prompt_tokens, int(units))


def mailbox_checksums(raw: bytes) -> bytes:
    """The CRC-32C table a mailbox record carries (b"" when none); ValueError if the record
    is foreign, names another algorithm or claims more than `raw` holds."""
    magic, _, _, _, algorithm, count, _ = struct.unpack_from(_MAILBOX_FORMAT, raw)
    if magic != _MAILBOX_MAGIC:
        raise ValueError("mailbox slot holds no kvxfer record")
    if algorithm == CHECKSUM_NONE:
        return b""
    if algorithm not in (CHECKSUM_CRC32C, CHECKSUM_CRC32C_TAGGED):
        raise ValueError(f"mailbox record names checksum algorithm {algorithm}, this side knows CRC-32C "
                         f"({CHECKSUM_CRC32C}) and tagged CRC-32C ({CHECKSUM_CRC32C_TAGGED})")
    end = MAILBOX_SLOT_BYTES + count * CHECKSUM_BYTES
    if end > len(raw):
        raise ValueError(f"mailbox record claims {count} checksums, the slot holds {(len(raw) - MAILBOX_SLOT_BYTES) // 4}")
    return bytes(raw[MAILBOX_SLOT_BYTES:end])


# ---- abort ------------------------------------------------------------------------------
#
# A control message (engine.send, two-sided) from the prefiller to the decoder: "the push
# of the reservation with this immediate and nonce stopped, and none of its writes is in
# flight any more". A message rather than an immediate: a waiting decoder would need one
# more ImmCounter expectation per request, which the engine cannot withdraw (it would stay
# for every request that was not aborted), and one more counter key per immediate.

_ABORT_MAGIC = 0x4B564142  # "KVAB"
_ABORT_FORMAT = "<IHIQ"  # magic, protocol version, imm, nonce; then the reason, UTF-8
ABORT_MESSAGE_BYTES = 512
_ABORT_HEADER = struct.calcsize(_ABORT_FORMAT)


def encode_abort(imm: int, nonce: int, reason: str) -> bytes:
    """The abort message of one reservation; `reason` is cut to fit `ABORT_MESSAGE_BYTES`."""
    text = reason.encode("utf-8", errors="replace")[: ABORT_MESSAGE_BYTES - _ABORT_HEADER]
    return struct.pack(_ABORT_FORMAT, _ABORT_MAGIC, PROTOCOL_VERSION, imm, nonce) + text


def decode_abort(raw: bytes) -> tuple[int, int, str] | None:
    """(imm, nonce, reason) of an abort message; None for any other message."""
    return _decode_signal(raw, _ABORT_MAGIC)


def _decode_signal(raw: bytes, magic_wanted: int) -> tuple[int, int, str] | None:
    if len(raw) < _ABORT_HEADER or len(raw) > ABORT_MESSAGE_BYTES:
        return None
    magic, version, imm, nonce = struct.unpack_from(_ABORT_FORMAT, raw)
    if magic != magic_wanted or version != PROTOCOL_VERSION:
        return None
    return imm, nonce, raw[_ABORT_HEADER:].decode("utf-8", errors="replace")


# ---- cancel -----------------------------------------------------------------------------
#
# The other direction, for hand-offs the decoder starts (the vLLM connector): "stop pushing
# the reservation with this immediate and nonce". The prefiller answers with the abort
# message above once none of its writes for it is in flight, and from then on the decoder
# may hand the pages to another request.

_CANCEL_MAGIC = 0x4B56434E  # "KVCN"


def encode_cancel(imm: int, nonce: int, reason: str) -> bytes:
    """The cancel message of one reservation (decoder to prefiller)."""
    text = reason.encode("utf-8", errors="replace")[: ABORT_MESSAGE_BYTES - _ABORT_HEADER]
    return struct.pack(_ABORT_FORMAT, _CANCEL_MAGIC, PROTOCOL_VERSION, imm, nonce) + text


def decode_cancel(raw: bytes) -> tuple[int, int, str] | None:
    """(imm, nonce, reason) of a cancel message; None for any other message."""
    return _decode_signal(raw, _CANCEL_MAGIC)


# ---- probe ------------------------------------------------------------------------------
#
# Decoder to prefiller, about no reservation in particular: "are you there?". A decoder
# whose loads see no write for a while sends one to learn whether the prefiller process is
# gone (the send is not delivered) or only slow (it is); the prefiller reads and drops it.

_PROBE_MAGIC = 0x4B565052  # "KVPR"
_PROBE_FORMAT = "<IH"  # magic, protocol version


def encode_probe() -> bytes:
    """The probe message (decoder to prefiller); it carries nothing else."""
    return struct.pack(_PROBE_FORMAT, _PROBE_MAGIC, PROTOCOL_VERSION)


def is_probe(raw: bytes) -> bool:
    """Whether `raw` is a probe message (of this protocol version)."""
    return len(raw) == struct.calcsize(_PROBE_FORMAT) and struct.unpack(_PROBE_FORMAT, raw) == (
        _PROBE_MAGIC, PROTOCOL_VERSION)


# ---- reservation message ----------------------------------------------------------------
#
# When the decoder reserves first and the prefiller learns its pages over the engine (the
# vLLM connector: no HTTP call between the two workers), the reservation travels as one
# control message: a magic, then the reservation's JSON form. JSON, not pickle: the
# receiver parses it with `KVReservation.from_json`, which validates every field once.

_RESERVE_MAGIC = b"KVRS"
#: The engine's bound on one control message.
MAX_CONTROL_MESSAGE_BYTES = 64 * 1024


def encode_reservation_message(reservation: "KVReservation") -> bytes:
    """The reservation as one engine control message; ReservationError if it cannot fit."""
    raw = _RESERVE_MAGIC + json.dumps(reservation.to_json(), separators=(",", ":")).encode()
    if len(raw) > MAX_CONTROL_MESSAGE_BYTES:
        raise ReservationError("pages", f"{len(reservation.pages)} pages do not fit one control message "
                               f"({len(raw)} > {MAX_CONTROL_MESSAGE_BYTES} bytes)")
    return raw


def decode_reservation_message(raw: bytes) -> "KVReservation | None":
    """The reservation a message carries; None for any other message; ReservationError
    (naming the field) for a reservation message that is malformed."""
    if not raw.startswith(_RESERVE_MAGIC):
        return None
    if len(raw) > MAX_CONTROL_MESSAGE_BYTES:
        raise ReservationError("reservation", f"message of {len(raw)} bytes exceeds {MAX_CONTROL_MESSAGE_BYTES}")
    try:
        data = json.loads(raw[len(_RESERVE_MAGIC):].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ReservationError("reservation", f"not JSON: {exc}") from None
    return KVReservation.from_json(data)


# ---- the reservation --------------------------------------------------------------------

class ReservationError(KvxferError, ValueError):
    """A reservation that does not follow this contract; `field` names what is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"malformed reservation: {field}: {problem}")


# An engine may add dash-separated tags after the block size (vLLM's cache adds its
# layout and ISA: "-vllm-lbhnc-avx2"), because raw blocks are only portable between
# instances whose in-block byte order is the same.
_LAYOUT = re.compile(r"^L(\d+)-H(\d+)-D(\d+)-([a-z0-9]+)-bs(\d+)((?:-[a-z0-9_]+)*)$")
_MAX_ID_CHARS = 256
_MAX_DESCRIPTOR_BYTES = 64 * 1024
_MAX_PAGES = 1 << 24
_MAX_NONCE = (1 << 63) - 1


def _version(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value != PROTOCOL_VERSION:
        raise ReservationError("version", f"unsupported version {value!r:.40} (this side speaks {PROTOCOL_VERSION})")
    return value


def _int(field: str, value: Any, low: int, high: int) -> int:
    # bool is an int subclass in Python; a reservation field is never a bool.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReservationError(field, f"must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= high:
        raise ReservationError(field, f"must be in {low}..{high}, got {value}")
    return value


def _str(field: str, value: Any, max_chars: int) -> str:
    if not isinstance(value, str):
        raise ReservationError(field, f"must be a string, got {type(value).__name__}")
    if not value or len(value) > max_chars:
        raise ReservationError(field, f"must have 1..{max_chars} characters, got {len(value)}")
    return value


def _bytes(field: str, value: Any) -> bytes:
    if not isinstance(value, bytes) or not 0 < len(value) <= _MAX_DESCRIPTOR_BYTES:
        raise ReservationError(field, f"must be 1..{_MAX_DESCRIPTOR_BYTES} bytes")
    return value


def _hex(field: str, value: Any) -> bytes:
    if not isinstance(value, str):
        raise ReservationError(field, f"must be a hex string, got {type(value).__name__}")
    try:
        # fromhex skips whitespace; a descriptor in JSON has none, so refuse it.
        if not value.isascii() or any(c.isspace() for c in value):
            raise ValueError("non-hex characters")
        raw = bytes.fromhex(value)
    except ValueError as exc:
        raise ReservationError(field, f"not a hex string ({exc}): {value!r:.40}") from None
    return _bytes(field, raw)


@dataclass(frozen=True)
class KVReservation:
    """Where a prefiller must push one request's KV on a decode worker.

    `descriptor` covers the decoder's whole KV cache tensor (`num_pages` pages per layer);
    `pages` are the request's page ids in block-table order; `meta_descriptor` and
    `meta_offset` locate its mailbox slot; `imm` and `expected_count` gate admission;
    `fence_timeout_s` is how long the decoder keeps the pages after giving up on the
    request without the prefiller's word that its writes stopped (a prefiller whose
    transfer deadline is not shorter refuses the reservation). `first_page` counts the
    prompt's leading pages the decoder already holds (a prefix-cache hit): the prefiller
    pushes prompt pages `first_page...` into `pages` in order, and `expected_count` counts
    only those. With a mailbox and `first_page > 0` (the builtin decoder's prefix cache),
    `pages` holds exactly the prompt pages to push, no decode pages: a prefiller written
    before prefix reuse, which pushes every prompt page from page 0, finds the reservation
    shorter than its prompt and refuses it (409) instead of writing block 0 into the page of
    block `first_page`; its `version` stays 1 so every other reservation reads as before.
    Without a `mailbox` (an
    engine whose decoder recomputes the last prompt token, as vLLM does) the meta fields
    are unused and `expected_count` is exactly layers x pages. `checksums` asks the
    prefiller to append the CRC-32C of every pushed (layer, page) to the mailbox write (an
    optional field: a reader that does not know it sends none, which a verifying decoder
    fails as `checksums_missing`). `checksum_tag` asks for that table tagged under the
    cluster's table key (`mailbox_tag_verifies`): a decoder with a cluster key asks for it
    and admits no table without it; optional too, and in the JSON form only when true, so
    a decoder without a key hands out the reservation it did before. `group_pages` (vLLM
    with several KV cache groups, no mailbox; optional, in the JSON form only when set)
    names the decoder's page of each prompt page `first_page...` per group, -1 where that
    group keeps none (a sliding window's pages before its window: not pushed); `pages` then
    lists every page the reservation holds, and `expected_count` counts one write per
    layer per pushed page of the layer's group. A reader that does not know the field
    refuses the reservation all the same: its `expected_count` is mostly not layers x
    pages, and the kv_layout of a cache of several groups carries a tag of the groups'
    shape that a one-group cache's never has (the kv_layout check). Construction validates.
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
    fence_timeout_s: float
    version: int = PROTOCOL_VERSION
    first_page: int = 0
    mailbox: bool = True
    checksums: bool = False
    checksum_tag: bool = False
    group_pages: list[list[int]] | None = None

    def __post_init__(self) -> None:
        _version(self.version)
        _str("request_id", self.request_id, _MAX_ID_CHARS)
        _bytes("descriptor", self.descriptor)
        if not isinstance(self.mailbox, bool):
            raise ReservationError("mailbox", f"must be true or false, got {self.mailbox!r:.40}")
        _int("first_page", self.first_page, 0, _MAX_PAGES)
        if self.mailbox or self.meta_descriptor:
            _bytes("meta_descriptor", self.meta_descriptor)
        num_pages = _int("num_pages", self.num_pages, 1, _MAX_PAGES)
        if not isinstance(self.pages, list) or not self.pages:
            raise ReservationError("pages", "must be a non-empty list of page ids")
        for i, page in enumerate(self.pages):
            _int(f"pages[{i}]", page, 0, num_pages - 1)
        if len(set(self.pages)) != len(self.pages):
            raise ReservationError("pages", "holds a page id twice")
        imm = _int("imm", self.imm, 1, (1 << 32) - 1)
        try:
            decode_imm(imm)
        except ValueError as exc:
            raise ReservationError("imm", str(exc)) from None
        _int("nonce", self.nonce, 0, _MAX_NONCE)
        offset = _int("meta_offset", self.meta_offset, 0, (1 << 48))
        if offset % MAILBOX_SLOT_BYTES:
            raise ReservationError("meta_offset", f"must be a multiple of {MAILBOX_SLOT_BYTES}, got {offset}")
        match = _LAYOUT.match(_str("kv_layout", self.kv_layout, 128))
        if match is None:
            raise ReservationError("kv_layout", f"not a layout string like 'L2-H2-D16-float32-bs16': {self.kv_layout!r:.60}")
        num_layers = int(match.group(1))
        if self.group_pages is not None:
            self._check_group_pages(num_layers)
        elif not self.mailbox:
            if self.expected_count != num_layers * len(self.pages):
                raise ReservationError("expected_count", f"{self.expected_count!r:.40} is not {num_layers} layers x "
                                       f"{len(self.pages)} pages (no mailbox)")
        else:
            expected = _int("expected_count", self.expected_count, 2, num_layers * len(self.pages) + 1)
            if (expected - 1) % max(num_layers, 1):
                raise ReservationError("expected_count", f"{expected} is not {num_layers} layers x pages + 1 (the mailbox)")
            if self.first_page and (expected - 1) // num_layers != len(self.pages):
                raise ReservationError("pages", f"with first_page {self.first_page} the pages are exactly the "
                                       f"{(expected - 1) // num_layers} prompt pages to push, got {len(self.pages)}")
        fence = self.fence_timeout_s
        if isinstance(fence, bool) or not isinstance(fence, (int, float)) or not (math.isfinite(fence) and fence > 0):
            raise ReservationError("fence_timeout_s", f"must be a positive number of seconds, got {fence!r:.40}")
        if not isinstance(self.checksums, bool):
            raise ReservationError("checksums", f"must be true or false, got {type(self.checksums).__name__}")
        if not isinstance(self.checksum_tag, bool):
            raise ReservationError("checksum_tag", f"must be true or false, got {type(self.checksum_tag).__name__}")

    def _check_group_pages(self, num_layers: int) -> None:
        groups = self.group_pages
        if self.mailbox:
            raise ReservationError("group_pages", "only without a mailbox (vLLM's decoder)")
        if not isinstance(groups, list) or len(groups) < 2 or not all(isinstance(g, list) for g in groups):
            raise ReservationError("group_pages", "must be a list of at least two lists of page ids")
        width = len(groups[0])
        if width < 1 or any(len(g) != width for g in groups):
            raise ReservationError("group_pages", "every group must name the same number of prompt pages (>= 1)")
        held = set(self.pages)
        named: list[int] = []
        for g, ids in enumerate(groups):
            for i, page in enumerate(ids):
                if _int(f"group_pages[{g}][{i}]", page, -1, self.num_pages - 1) >= 0:
                    named.append(page)
        if len(set(named)) != len(named) or set(named) != held:
            raise ReservationError("group_pages", "must name each of `pages` exactly once, in one group")
        # Each layer of the geometry may hold a layer of every group.
        _int("expected_count", self.expected_count, 1, num_layers * len(groups) * width)

    @property
    def num_layers(self) -> int:
        """Layers of the decoder's model, read from `kv_layout`."""
        match = _LAYOUT.match(self.kv_layout)
        assert match is not None  # validated in __post_init__
        return int(match.group(1))

    @property
    def prompt_pages(self) -> int:
        """Pages the prefiller writes per layer (per group: prompt pages, pushed or not)."""
        if self.group_pages is not None:
            return len(self.group_pages[0])
        if not self.mailbox:
            return len(self.pages)
        return (self.expected_count - 1) // self.num_layers

    def to_json(self) -> dict[str, Any]:
        """JSON form used by the HTTP API (bytes as hex)."""
        data: dict[str, Any] = {
            "version": self.version,
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
            "fence_timeout_s": self.fence_timeout_s,
            "first_page": self.first_page,
            "mailbox": self.mailbox,
            "checksums": self.checksums,
        }
        if self.checksum_tag:
            data["checksum_tag"] = True
        if self.group_pages is not None:
            data["group_pages"] = [list(g) for g in self.group_pages]
        return data

    @classmethod
    def from_json(cls, data: Any, *, request_id: str | None = None) -> "KVReservation":
        """Parses the HTTP form; every defect raises `ReservationError` naming the field.

        With `request_id`, the reservation must be for that request (a missing
        `request_id` field takes it). Fields this version does not know are ignored (the
        router adds `engine_address`); a different `version` is refused before anything else.
        """
        if not isinstance(data, dict):
            raise ReservationError("reservation", f"must be a JSON object, got {type(data).__name__}")
        if "version" not in data:
            raise ReservationError("version", f"missing (this side speaks version {PROTOCOL_VERSION})")
        version = _version(data["version"])

        def get(name: str) -> Any:
            if name not in data:
                if name == "request_id" and request_id is not None:
                    return request_id
                raise ReservationError(name, "missing")
            return data[name]

        rid = _str("request_id", get("request_id"), _MAX_ID_CHARS)
        if request_id is not None and rid != request_id:
            raise ReservationError("request_id", f"reservation is for request {rid!r}, not {request_id!r}")
        pages = get("pages")
        if not isinstance(pages, list):
            raise ReservationError("pages", f"must be a list of page ids, got {type(pages).__name__}")
        return cls(
            request_id=rid,
            descriptor=_hex("descriptor", get("descriptor")),
            pages=list(pages),
            num_pages=get("num_pages"),
            imm=get("imm"),
            expected_count=get("expected_count"),
            kv_layout=get("kv_layout"),
            meta_descriptor=_hex("meta_descriptor", get("meta_descriptor")) if data.get("mailbox", True) is not False
            else (_hex("meta_descriptor", data["meta_descriptor"]) if data.get("meta_descriptor") else b""),
            meta_offset=get("meta_offset"),
            nonce=get("nonce"),
            fence_timeout_s=get("fence_timeout_s"),
            version=version,
            first_page=data.get("first_page", 0),
            mailbox=data.get("mailbox", True),
            checksums=data.get("checksums", False),
            checksum_tag=data.get("checksum_tag", False),
            group_pages=data.get("group_pages"),
        )
