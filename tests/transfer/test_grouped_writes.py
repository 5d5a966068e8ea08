"""Writes submitted many at a time (write_many, write_paged_many) land byte for byte, count
their immediates, and finish into one CompletionCounter; a bad request refuses the whole
call before anything is posted.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_pairs import (
    KIB,
    LOOPBACK,
    MIB,
    WAIT_S,
    EnginePair,
    NothingPosted,
    assert_same_bytes,
    fresh_imm,
)
from support.engine_peer import engine_options, seeded_bytes

from kvxfer.errors import BoundsError
from kvxfer.transfer.engine import TransferEngine


def test_write_many_lands_every_write_in_its_place_and_counts_one_immediate_each(
    pair: EnginePair,
) -> None:
    # More writes than one rail keeps in flight (256), submitted in two calls into one
    # counter, the second only once the window has room, as a deep-window user would.
    imm, size, count = fresh_imm(), 4 * KIB + 8, 400
    data = seeded_bytes(31, count * size)
    pair.src[: data.size] = data
    src_offsets = np.arange(count, dtype=np.int64) * size
    dst_offsets = np.random.default_rng(32).permutation(count).astype(np.int64) * size
    counter = pair.engine.completion_counter()

    assert (
        pair.engine.write_many(
            pair.mr, src_offsets[:300], pair.descriptor, dst_offsets[:300], size, imm, counter=counter
        )
        == 300
    )
    counter.wait(300 - 200, WAIT_S)
    pair.engine.write_many(pair.mr, src_offsets[300:], pair.descriptor, dst_offsets[300:], size, imm, counter=counter)
    counter.wait(timeout=WAIT_S)

    assert (counter.submitted, counter.finished, counter.failed) == (count, count, 0)
    pair.wait_target_count(imm, count)
    expected = np.zeros(count * size, dtype=np.uint8)
    for s, d in zip(src_offsets, dst_offsets):
        expected[d : d + size] = data[s : s + size]
    assert_same_bytes(pair.target_bytes(0, expected.size), expected, "write_many")


def test_write_paged_many_lands_every_page_and_counts_one_per_page(pair: EnginePair) -> None:
    imm, page, lists, per_list = fresh_imm(), 16 * KIB, 6, 40
    rng = np.random.default_rng(41)
    data = seeded_bytes(42, 512 * page)
    pair.src[: data.size] = data
    src_lists = [rng.choice(512, per_list, replace=False).astype(np.int64) for _ in range(lists)]
    dst_all = rng.permutation(lists * per_list).astype(np.int64)
    dst_lists = [dst_all[i * per_list : (i + 1) * per_list] for i in range(lists)]
    counter = pair.engine.completion_counter()

    pair.engine.write_paged_many(
        pair.mr,
        src_lists,
        pair.descriptor,
        dst_lists,
        page,
        dst_offset=1 * MIB,
        imm=imm,
        counter=counter,
    )
    counter.wait(timeout=WAIT_S)

    assert (counter.finished, counter.failed) == (lists, 0)
    pair.wait_target_count(imm, lists * per_list)
    expected = np.zeros(lists * per_list * page, dtype=np.uint8)
    for src, dst in zip(src_lists, dst_lists):
        for s, d in zip(src, dst):
            expected[d * page : (d + 1) * page] = data[s * page : (s + 1) * page]
    assert_same_bytes(pair.target_bytes(1 * MIB, expected.size), expected, "write_paged_many")


def test_one_bad_request_refuses_the_whole_call_and_posts_nothing(pair: EnginePair) -> None:
    imm = fresh_imm()
    counter = pair.engine.completion_counter()
    good = np.arange(8, dtype=np.int64) * 4 * KIB
    bad_dst = good.copy()
    bad_dst[5] = 1 << 40  # far past the target's region
    pages = np.arange(4, dtype=np.int64)
    out_of_bounds = np.array([0, 1, 2, 1 << 30], dtype=np.int64)
    with NothingPosted(pair, imm):
        with pytest.raises(BoundsError):
            pair.engine.write_many(pair.mr, good, pair.descriptor, bad_dst, 4 * KIB, imm, counter=counter)
        with pytest.raises(BoundsError):  # the second list's last page is out of bounds
            pair.engine.write_paged_many(
                pair.mr,
                [pages, pages],
                pair.descriptor,
                [pages, out_of_bounds],
                4 * KIB,
                imm=imm,
                counter=counter,
            )
        with pytest.raises(BoundsError):  # lists of different lengths
            pair.engine.write_paged_many(
                pair.mr,
                [pages, pages],
                pair.descriptor,
                [pages, pages[:3]],
                4 * KIB,
                imm=imm,
                counter=counter,
            )
    assert (counter.submitted, counter.finished) == (0, 0)


def test_caller_driven_engine_waits_on_a_counter_by_making_progress(pair: EnginePair, provider: str) -> None:
    imm, size, count = fresh_imm(), 8 * KIB, 64
    data = seeded_bytes(51, count * size)
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK, progress="caller") as engine:
        mr = engine.register(data.copy())
        counter = engine.completion_counter()
        offsets = np.arange(count, dtype=np.int64) * size
        engine.write_many(mr, offsets, pair.descriptor, offsets, size, imm, counter=counter)
        counter.wait(timeout=WAIT_S)
        assert (counter.finished, counter.failed) == (count, 0)
    pair.wait_target_count(imm, count)
    assert_same_bytes(pair.target_bytes(0, data.size), data, "caller-driven write_many")
