"""Paged writes place every page where its index says and count one unit per page.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from support.engine_pairs import (
    KIB,
    MIB,
    STRAY_ARRIVAL_GRACE_S,
    WAIT_S,
    PairPool,
    assert_carried_by_every_rail,
    assert_same_bytes,
    bytes_completed_per_path,
    fresh_imm,
)
from support.engine_peer import (
    seeded_bytes,
)

# -- paged writes -----------------------------------------------------------------------


def page_lists(seed: int, pages_per_side: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` distinct source and destination pages in random order: runs of 4 pages that
    stay adjacent on both sides (coalescable) and runs scattered within themselves."""
    rng = np.random.default_rng(seed)
    runs = count // 4
    src_runs = rng.permutation(pages_per_side // 4)[:runs] * 4
    dst_runs = rng.permutation(pages_per_side // 4)[:runs] * 4
    src, dst = [], []
    for k, (s, d) in enumerate(zip(src_runs, dst_runs)):
        order = np.arange(4) if k % 2 == 0 else rng.permutation(4)
        src.extend(s + order)
        dst.extend(d + np.arange(4))
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


@pytest.mark.parametrize("rails", [1, 2])
def test_writes_without_an_immediate_land_and_count_nothing_not_even_immediate_0(
    pairs: PairPool, rails: int
) -> None:
    # Such writes still carry CQ data (a marker that keeps the target's worker polling,
    # rail_group.hpp): it must never reach a counter. Its immediate field is 0.
    pair = pairs.get(rails)
    page, count = 16 * KIB, 64
    data = seeded_bytes(7 + rails, 2 * MIB)
    pair.src[: data.size] = data
    single = pair.engine.write(pair.mr, 0, pair.descriptor, 0, 1 * MIB)
    paged = pair.engine.write_paged(
        pair.mr, list(range(64, 64 + count)), pair.descriptor,
        list(range(count - 1, -1, -1)), page, dst_offset=1 * MIB,
    )
    single.wait(WAIT_S)
    paged.wait(WAIT_S)

    expected = data.copy()
    for i in range(count):
        d = count - 1 - i
        expected[MIB + d * page : MIB + (d + 1) * page] = data[(64 + i) * page : (65 + i) * page]
    assert_same_bytes(pair.target_bytes(0, 2 * MIB), expected, "writes without immediates")
    time.sleep(STRAY_ARRIVAL_GRACE_S)
    assert pair.target_count(0) == 0


@pytest.mark.parametrize("rails", [1, 2])
def test_paged_write_with_random_permutations_lands_every_page_and_counts_one_per_page(
    pairs: PairPool, provider: str, rails: int
) -> None:
    pair = pairs.get(rails)
    imm, page, pages_per_side, count = fresh_imm(), 16 * KIB, 512, 300
    src_pages, dst_pages = page_lists(rails, pages_per_side, count)
    region = pages_per_side * page
    data = seeded_bytes(100 + rails, region)
    pair.src[:region] = data
    before = bytes_completed_per_path(pair.engine)

    transfer = pair.engine.write_paged(
        pair.mr, src_pages, pair.descriptor, dst_pages, page, imm=imm
    )
    transfer.wait(WAIT_S)

    assert transfer.bytes == len(src_pages) * page
    pair.wait_target_count(imm, len(src_pages))
    expected = np.zeros(region + 64 * KIB, dtype=np.uint8)
    for s, d in zip(src_pages, dst_pages):
        expected[d * page : (d + 1) * page] = data[s * page : (s + 1) * page]
    assert_same_bytes(pair.target_bytes(0, expected.size), expected, "paged target")
    assert_carried_by_every_rail(pair.engine, before, len(src_pages) * page, provider)


@pytest.mark.parametrize("rails", [1, 2])
def test_paged_write_places_page_p_at_offset_plus_p_times_stride_on_each_side(
    pairs: PairPool, rails: int
) -> None:
    pair = pairs.get(rails)
    imm, page = fresh_imm(), 4 * KIB + 100
    src_stride, dst_stride, src_offset, dst_offset = 2 * page, 3 * page + 1, 1000, 5003
    src_pages, dst_pages = np.array([5, 0, 7, 3, 1]), np.array([2, 9, 0, 4, 6])
    data = seeded_bytes(31, 8 * src_stride + src_offset)
    pair.src[: data.size] = data

    pair.engine.write_paged(
        pair.mr, src_pages, pair.descriptor, dst_pages, page,
        src_stride=src_stride, dst_stride=dst_stride, src_offset=src_offset,
        dst_offset=dst_offset, imm=imm,
    ).wait(WAIT_S)

    pair.wait_target_count(imm, len(src_pages))
    expected = np.zeros(dst_offset + 11 * dst_stride, dtype=np.uint8)
    for s, d in zip(src_pages, dst_pages):
        at, frm = dst_offset + d * dst_stride, src_offset + s * src_stride
        expected[at : at + page] = data[frm : frm + page]
    assert_same_bytes(pair.target_bytes(0, expected.size), expected, "strided pages")
