"""The push plan (kvxfer.handoff.push_plan): which pages of a layer go now, where they land
and at which byte offsets, for both senders. The transfer itself is tested with real
processes (tests/workers, tests/integrations)."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.handoff.push_plan import PushPlan, PushPlanError, whole_page_geometry
from kvxfer.kv.cache_geometry import CacheGeometry, GeometryError, PagedRun
from kvxfer.kv.protocol import KVReservation, encode_imm

LAYERS, PAGE = 3, 4096
LOCAL_PAGES, DECODER_PAGES = 40, 64
#: Prompt blocks 0..5 live in these local pages; the decoder holds blocks 0 and 1.
LOCAL = np.array([7, 3, 9, 1, 30, 12], dtype=np.int64)
RESERVED = [50, 51, 20, 8]  # blocks 2, 3, 4, 5


def reservation(first_page: int = 2, pages: list[int] = RESERVED, layout: str = "L3-H2-D64-float32-bs16") -> KVReservation:
    return KVReservation(request_id="r1", descriptor=b"d", pages=list(pages), num_pages=DECODER_PAGES,
                         imm=encode_imm(0, 1), expected_count=LAYERS * len(pages), kv_layout=layout,
                         meta_descriptor=b"", meta_offset=0, nonce=1, fence_timeout_s=15.0, mailbox=False,
                         first_page=first_page)


def whole_pages() -> PushPlan:
    return PushPlan(reservation(), whole_page_geometry("pages", LAYERS, LOCAL_PAGES, PAGE))


def test_blocks_the_decoder_holds_are_never_planned_and_block_b_lands_in_reserved_page_b_minus_first_page() -> None:
    plan = whole_pages()
    pages = plan.blocks(1, 0, 4, LOCAL)  # a chunk of blocks 0..3: 0 and 1 are the decoder's
    assert pages is not None
    assert (pages.layer, pages.first_block, pages.end_block) == (1, 2, 4)
    assert pages.local.tolist() == [9, 1] and pages.remote.tolist() == [50, 51]
    assert pages.table_columns == slice(0, 2)
    assert plan.blocks(1, 0, 2, LOCAL) is None  # only held blocks: nothing to push


def test_final_pages_go_once_each_as_they_become_final_and_the_plan_completes_with_the_last() -> None:
    plan = whole_pages()
    sent: dict[int, list[tuple[int, int]]] = {layer: [] for layer in range(LAYERS)}
    for final in (3, 3, 5, 6, 6):  # pages of the prompt final after each step
        for layer in range(LAYERS):
            pages = plan.final(layer, final, LOCAL)
            if pages is not None:
                sent[layer] += list(zip(pages.local.tolist(), pages.remote.tolist()))
                plan.posted(pages)
        assert plan.complete == (final == 6)
    assert sent == {layer: [(9, 50), (1, 51), (30, 20), (12, 8)] for layer in range(LAYERS)}


def test_a_block_table_shorter_than_the_final_pages_is_refused_by_name() -> None:
    with pytest.raises(PushPlanError, match="the request has 4 blocks, fewer than its computed pages"):
        whole_pages().final(0, 6, [7, 3, 9, 1])


def test_whole_page_writes_read_and_land_at_each_sides_layer_origin() -> None:
    plan = whole_pages()
    assert plan.runs(2) == [PagedRun(src_offset=2 * LOCAL_PAGES * PAGE, dst_offset=2 * DECODER_PAGES * PAGE,
                                     length=PAGE, src_stride=PAGE, dst_stride=PAGE)]


def test_a_head_slice_moves_the_heads_it_names_into_the_decode_ranks_heads() -> None:
    # LBHNC, 4 heads of 16 tokens x 128 B; this rank gives heads 2..4 to a decode rank of 2 heads.
    geometry = CacheGeometry.dense("LBHNC", (0, 1, 2, 3, 4), LAYERS, LOCAL_PAGES, 4, 16, 128)
    plan = PushPlan(reservation(), geometry, src_heads=(2, 4), dst_heads=(0, 2), dst_num_heads=2)
    head = 16 * 128
    assert plan.runs(1) == [PagedRun(src_offset=1 * LOCAL_PAGES * 4 * head + 2 * head,
                                     dst_offset=1 * DECODER_PAGES * 2 * head, length=2 * head,
                                     src_stride=4 * head, dst_stride=2 * head)]


def test_a_head_slice_the_layout_cuts_into_several_runs_is_refused_when_planned() -> None:
    # LBNHC: a block's heads interleave token by token, so two heads are 16 runs.
    geometry = CacheGeometry.dense("LBNHC", (0, 1, 3, 2, 4), LAYERS, LOCAL_PAGES, 4, 16, 128)
    plan = PushPlan(reservation(), geometry, src_heads=(2, 4), dst_heads=(0, 2), dst_num_heads=2)
    with pytest.raises(GeometryError, match="a head slice of layout LBNHC is 16 runs per block"):
        plan.runs(0)
