"""The checksum table's tag (kvxfer.kv.protocol): a mailbox record whose table a holder of
the cluster key tagged for one reservation verifies for that reservation only, and any
change to the record's fields, its table or its tag makes it fail."""

from __future__ import annotations

import secrets
import struct

import pytest

from kvxfer.kv.protocol import (
    MAILBOX_SLOT_BYTES,
    KVReservation,
    ReservationError,
    decode_mailbox,
    encode_imm,
    encode_mailbox,
    expected_imm_count,
    mailbox_checksums,
    mailbox_slot_bytes,
    mailbox_tag_verifies,
)
from kvxfer.registry.signing import checksum_table_key, derive_key

KEY = secrets.token_bytes(32)
IMM = encode_imm(3, 9)
TABLE = struct.pack("<6I", *range(100, 106))  # 2 layers x 3 pages
STRIDE = mailbox_slot_bytes(2, 3)


def slot(record: bytes) -> bytes:
    return record.ljust(STRIDE, b"\0")


def tagged() -> bytes:
    return slot(encode_mailbox(42, 7, 40, TABLE, units=7, table_key=KEY, imm=IMM))


def test_a_tagged_record_verifies_for_its_reservation_and_reads_as_before() -> None:
    raw = tagged()
    assert mailbox_tag_verifies(raw, KEY, IMM)
    assert decode_mailbox(raw) == (42, 7, 40, 7) and mailbox_checksums(raw) == TABLE


@pytest.mark.parametrize("change", ["nonce", "first_token", "prompt_tokens", "algorithm", "count", "units", "tag",
                                    "table"])
def test_any_change_to_a_tagged_record_fails_its_tag(change: str) -> None:
    raw = bytearray(tagged())
    at = {"nonce": 4, "first_token": 12, "prompt_tokens": 16, "algorithm": 20, "count": 24, "units": 28, "tag": 32,
          "table": MAILBOX_SLOT_BYTES + 5}[change]
    raw[at] ^= 0x01
    assert not mailbox_tag_verifies(bytes(raw), KEY, IMM)


def test_a_tag_is_good_for_one_reservation_and_one_key_only() -> None:
    raw = tagged()
    assert not mailbox_tag_verifies(raw, KEY, encode_imm(3, 10))  # the slot's next generation
    assert not mailbox_tag_verifies(raw, secrets.token_bytes(32), IMM)


def test_an_untagged_table_or_a_short_slot_never_verifies() -> None:
    assert not mailbox_tag_verifies(slot(encode_mailbox(42, 7, 40, TABLE, units=7)), KEY, IMM)
    assert not mailbox_tag_verifies(slot(encode_mailbox(42, 7, 40, units=1)), KEY, IMM)  # no table at all
    assert not mailbox_tag_verifies(tagged()[: MAILBOX_SLOT_BYTES + 8], KEY, IMM)  # table cut short
    assert not mailbox_tag_verifies(b"\0" * STRIDE, KEY, IMM)


def test_the_table_key_is_the_cluster_keys_own_purpose() -> None:
    cluster_key = secrets.token_bytes(48)
    key = checksum_table_key(cluster_key)
    assert len(key) == 32 and key == checksum_table_key(cluster_key) != checksum_table_key(secrets.token_bytes(48))
    assert key not in {derive_key(cluster_key, purpose) for purpose in ("registry", "control", "vllm-api")}


def reservation(**extra: object) -> dict[str, object]:
    data = KVReservation(
        request_id="r1", descriptor=b"\x01", pages=[5, 3, 9], num_pages=16, imm=IMM,
        expected_count=expected_imm_count(2, 40, 16), kv_layout="L2-H2-D16-float32-bs16",
        meta_descriptor=b"\x0a", meta_offset=128, nonce=42, fence_timeout_s=15.0, checksums=True,
    ).to_json()
    return {**data, **extra}


def test_the_reservation_asks_for_a_tag_only_when_it_says_so() -> None:
    plain = reservation()
    assert "checksum_tag" not in plain  # a decoder without a key hands out what it did before
    assert KVReservation.from_json(plain).checksum_tag is False
    asked = KVReservation.from_json(reservation(checksum_tag=True))
    assert asked.checksum_tag is True and asked.to_json()["checksum_tag"] is True
    with pytest.raises(ReservationError, match="checksum_tag"):
        KVReservation.from_json(reservation(checksum_tag=1))
