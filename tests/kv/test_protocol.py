"""The hand-off contract of kvxfer.kv.protocol: one validated, versioned reservation type."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvxfer.kv.protocol import (
    IMM_TABLE_BUDGET,
    MAX_SLOTS,
    PROTOCOL_VERSION,
    KVReservation,
    ReservationError,
    decode_abort,
    decode_imm,
    encode_abort,
    encode_imm,
    expected_imm_count,
    generations_per_slot,
)


def good() -> dict[str, Any]:
    return KVReservation(
        request_id="r1", descriptor=b"\x01\x02", pages=[5, 3, 9], num_pages=16, imm=encode_imm(2, 7),
        expected_count=expected_imm_count(2, 40, 16), kv_layout="L2-H2-D16-float32-bs16",
        meta_descriptor=b"\x0a", meta_offset=128, nonce=42, fence_timeout_s=15.0,
    ).to_json()


def test_round_trip_and_version() -> None:
    data = good()
    assert data["version"] == PROTOCOL_VERSION
    parsed = KVReservation.from_json(data, request_id="r1")
    assert parsed.to_json() == data
    assert parsed.prompt_pages == 3 and parsed.num_layers == 2


@pytest.mark.parametrize("field, value, words", [
    ("version", 2, "unsupported version 2"),
    ("version", True, "version"),
    ("request_id", "other", "not 'r1'"),
    ("descriptor", "zz", "hex"),
    ("descriptor", "0a b1", "hex"),
    ("descriptor", "é0", "hex"),
    ("descriptor", 12, "hex string"),
    ("descriptor", "", "bytes"),
    ("pages", "1,2", "list"),
    ("pages", [], "non-empty"),
    ("pages", [1, True, 2], "pages[1]"),
    ("pages", [1, 16, 2], "pages[1]"),
    ("pages", [1, 1, 2], "twice"),
    ("num_pages", 0, "num_pages"),
    ("num_pages", 1.5, "integer"),
    ("imm", 0, "imm"),
    ("imm", True, "imm"),
    ("imm", 1 << 31 | 5, "imm"),
    ("imm", 1 << 16, "slot field 0"),
    ("expected_count", 8, "expected_count"),  # more than 2 layers x 3 pages + 1
    ("expected_count", 4, "layers x pages"),
    ("kv_layout", "float32", "kv_layout"),
    ("meta_offset", 65, "multiple"),
    ("meta_offset", -64, "meta_offset"),
    ("nonce", -1, "nonce"),
    ("nonce", "1", "integer"),
    ("fence_timeout_s", 0, "fence_timeout_s"),
    ("fence_timeout_s", float("nan"), "fence_timeout_s"),
    ("checksums", 1, "true or false"),
    ("fence_timeout_s", False, "fence_timeout_s"),
])
def test_every_malformed_field_is_named(field: str, value: Any, words: str) -> None:
    data = {**good(), field: value}
    with pytest.raises(ReservationError) as info:
        KVReservation.from_json(data, request_id="r1")
    assert info.value.field.startswith(field.split("[")[0]), info.value
    assert words in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("field", sorted(good()))
def test_missing_field_is_named(field: str) -> None:
    data = good()
    del data[field]
    if field == "request_id":
        assert KVReservation.from_json(data, request_id="r1").request_id == "r1"
        return
    if field in ("first_page", "mailbox"):
        # Optional, with the defaults of a version-1 reservation written before they existed.
        parsed = KVReservation.from_json(data)
        assert (parsed.first_page, parsed.mailbox) == (0, True)
        return
    if field == "checksums":  # optional: a reservation from before it asks for none
        assert KVReservation.from_json(data).checksums is False
        return
    with pytest.raises(ReservationError, match=field):
        KVReservation.from_json(data)


def test_not_an_object() -> None:
    for data in (None, [], "x"):
        with pytest.raises(ReservationError, match="JSON object"):
            KVReservation.from_json(data)


def test_immediates_carry_slot_and_generation() -> None:
    seen = {encode_imm(slot, gen) for slot in (0, 1, MAX_SLOTS - 1) for gen in range(4)}
    assert len(seen) == 12 and 0 not in seen and all(imm < 1 << 31 for imm in seen)
    assert decode_imm(encode_imm(300, 5)) == (300, 5)
    # Generations wrap so the engine's never-shrinking counter table is not exhausted.
    assert 1024 * generations_per_slot(1024) <= IMM_TABLE_BUDGET
    assert generations_per_slot(MAX_SLOTS) == 2


def test_abort_message_round_trip() -> None:
    raw = encode_abort(encode_imm(3, 1), 99, "cancelled " * 100)
    imm, nonce, why = decode_abort(raw)
    assert (imm, nonce) == (encode_imm(3, 1), 99) and why.startswith("cancelled")
    assert len(raw) <= 512
    assert decode_abort(b"hello") is None and decode_abort(b"\0" * 40) is None


def test_protocol_imports_no_torch() -> None:
    """The router imports the protocol and has no torch."""
    code = "import sys, kvxfer.kv.protocol; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_reservation_without_mailbox_expects_exactly_layers_times_pages() -> None:
    data = good()
    data.update(mailbox=False, meta_descriptor="", meta_offset=0, first_page=3,
                kv_layout="L2-H2-D64-bfloat16-bs32-vllm-lbhnc-avx2")
    data["expected_count"] = 2 * len(data["pages"])
    parsed = KVReservation.from_json(data)
    assert (parsed.prompt_pages, parsed.first_page, parsed.num_layers) == (len(data["pages"]), 3, 2)
    assert KVReservation.from_json(parsed.to_json()) == parsed
    data["expected_count"] += 1  # a mailbox unit where there is no mailbox
    with pytest.raises(ReservationError, match="expected_count"):
        KVReservation.from_json(data)


def test_reservation_message_round_trips_and_rejects_foreign_or_malformed_bytes() -> None:
    from kvxfer.kv.protocol import (decode_cancel, decode_reservation_message, encode_abort, encode_cancel,
                                    encode_reservation_message)

    res = KVReservation.from_json(good())
    assert decode_reservation_message(encode_reservation_message(res)) == res
    assert decode_reservation_message(encode_abort(res.imm, res.nonce, "x")) is None
    for raw in (b"KVRS{not json", b"KVRS\xff\xfe", b"KVRS[]", b"KVRS" + b"1" * (70 * 1024)):
        with pytest.raises(ReservationError):
            decode_reservation_message(raw)
    cancel = encode_cancel(res.imm, res.nonce, "client went away")
    assert decode_cancel(cancel) == (res.imm, res.nonce, "client went away")
    assert decode_cancel(encode_abort(res.imm, res.nonce, "x")) is None
def test_mailbox_carries_the_checksum_table_after_the_record() -> None:
    from kvxfer.kv.protocol import (
        MAILBOX_SLOT_BYTES,
        decode_mailbox,
        encode_mailbox,
        mailbox_checksums,
        mailbox_slot_bytes,
    )

    table = bytes(range(24))  # 6 checksums: 2 layers x 3 pages
    stride = mailbox_slot_bytes(2, 3)
    assert stride % MAILBOX_SLOT_BYTES == 0 and stride >= MAILBOX_SLOT_BYTES + 24
    record = encode_mailbox(42, 7, 40, table, units=7)
    slot = record.ljust(stride, b"\0")
    record_fields = decode_mailbox(slot)
    assert record_fields[:3] == (42, 7, 40)
    assert record_fields.units == 7  # 2 layers x 3 pages, and the mailbox write
    assert mailbox_checksums(slot) == table
    assert mailbox_checksums(encode_mailbox(42, 7, 40, units=7)) == b""  # none asked for, none sent
    with pytest.raises(ValueError, match="claims 6 checksums"):
        mailbox_checksums(record[:-4])  # the slot is shorter than the record claims
    with pytest.raises(ValueError, match="whole number"):
        encode_mailbox(42, 7, 40, b"abc", units=7)
    for units in (0, 1 << 32):  # the mailbox write alone is one unit; the field is a uint32
        with pytest.raises(ValueError, match="units"):
            encode_mailbox(42, 7, 40, table, units=units)


def test_a_record_of_the_layout_without_units_is_no_record() -> None:
    """A prefiller of the release before `units` writes magic "KVMB": read as foreign
    (the decoder answers mailbox_mismatch), never as a units field made of its tag."""
    import struct

    from kvxfer.kv.protocol import MAILBOX_SLOT_BYTES, decode_mailbox

    old = struct.pack("<IQiiII", 0x4B564D42, 42, 7, 40, 0, 0).ljust(MAILBOX_SLOT_BYTES, b"\0")
    # The decoder's answer says why, so a fleet of mixed releases is told what to fix.
    with pytest.raises(ValueError, match="older kvxfer release's layout"):
        decode_mailbox(old)
    with pytest.raises(ValueError, match="no kvxfer record"):
        decode_mailbox(struct.pack("<IQiiII", 0x12345678, 42, 7, 40, 0, 0).ljust(MAILBOX_SLOT_BYTES, b"\0"))
