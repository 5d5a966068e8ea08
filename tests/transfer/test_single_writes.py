"""Single writes land byte for byte and count one immediate, however they are sharded.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_pairs import (
    KIB,
    MIB,
    PAIR_BYTES,
    WAIT_S,
    PairPool,
    assert_carried_by_every_rail,
    assert_same_bytes,
    assert_zero,
    bytes_completed_per_path,
    fresh_imm,
)
from support.engine_peer import (
    seeded_bytes,
)

# -- single writes ----------------------------------------------------------------------


@pytest.mark.parametrize("rails", [1, 2])
@pytest.mark.parametrize("size", [1, 4 * KIB + 3, 1 * MIB], ids=["1B", "4KiB+3", "1MiB"])
def test_single_write_lands_byte_for_byte_and_counts_one_immediate(
    pairs: PairPool, rails: int, size: int
) -> None:
    pair = pairs.get(rails)
    imm, src_offset, dst_offset, margin = fresh_imm(), 13, 8 * KIB + 5, 4 * KIB
    data = seeded_bytes(size, size)
    pair.src[src_offset : src_offset + size] = data

    pair.engine.write(pair.mr, src_offset, pair.descriptor, dst_offset, size, imm).wait(WAIT_S)

    pair.wait_target_count(imm, 1)
    expected = np.zeros(size + 2 * margin, dtype=np.uint8)
    expected[margin : margin + size] = data
    landed = pair.target_bytes(dst_offset - margin, size + 2 * margin)
    assert_same_bytes(landed, expected, f"{size}-byte write and its surroundings")


def test_64_mib_write_lands_byte_for_byte(pairs: PairPool) -> None:
    pair = pairs.get(1)
    imm, size, dst_offset = fresh_imm(), 64 * MIB, 32 * KIB
    data = seeded_bytes(64, size)
    pair.src[:size] = data

    transfer = pair.engine.write(pair.mr, 0, pair.descriptor, dst_offset, size, imm)
    transfer.wait(WAIT_S)

    assert transfer.bytes == size
    pair.wait_target_count(imm, 1)
    target = pair.target_bytes(0, PAIR_BYTES[1])
    assert_zero(target[:dst_offset], "bytes before the write")
    assert_same_bytes(target[dst_offset : dst_offset + size], data, "64 MiB write")
    assert_zero(target[dst_offset + size :], "bytes after the write")


def test_single_write_over_two_rails_is_sharded_yet_counts_exactly_one_immediate(
    pairs: PairPool, provider: str
) -> None:
    pair = pairs.get(2)
    imm, size = fresh_imm(), 8 * MIB
    data = seeded_bytes(8, size)
    pair.src[:size] = data
    before = bytes_completed_per_path(pair.engine)

    pair.engine.write(pair.mr, 0, pair.descriptor, 0, size, imm).wait(WAIT_S)

    pair.wait_target_count(imm, 1)
    landed = pair.target_bytes(0, size + 64 * KIB)
    assert_same_bytes(landed[:size], data, "sharded write")
    assert_zero(landed[size:], "bytes after the sharded write")
    assert_carried_by_every_rail(pair.engine, before, size, provider)
