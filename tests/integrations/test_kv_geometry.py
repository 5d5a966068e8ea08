"""The connector's KV geometry against vLLM's own views, in each of vLLM's six KV cache
layouts, for attention content (K and V per head) and MLA content (one latent vector).

vLLM builds the caches here exactly as its workers do (`compute_layout_strides`,
`create_kv_cache_views` on one seeded int8 allocation), so its per-layer views say where a
kernel reads each (layer, block, head, token). The geometry must name the same bytes, and
copying the runs it names from one cache into another (different block ids, a different
number of blocks, a head slice into a narrower cache) must make the destination's views
equal the source's for the moved blocks and leave every other byte untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch  # noqa: E402
from support.vllm_kv_caches import (  # noqa: E402
    HEAD_SIZE,
    HEADS,
    LATENT,
    LAYERS,
    TOKENS,
    Cache,
    attention_spec,
    mask_of,
    mla_spec,
    same_bytes,
    vllm_cache,
)
from vllm.v1.kv_cache_interface import KVCacheSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.kv_region import KVRegionError, region_from_kv_caches  # noqa: E402
from kvxfer.kv.cache_geometry import CacheGeometry, GeometryError  # noqa: E402
from kvxfer.kv.write_windows import reservation_windows  # noqa: E402

#: Blocks of the source and destination caches, and the blocks one request moves.
SRC_BLOCKS, DST_BLOCKS = 6, 9
MOVED = [(1, 7), (2, 3), (4, 5)]  # (source block, destination block)
CONTENTS = ["attention", "mla"]


def _spec(content: str) -> KVCacheSpec:
    return mla_spec() if content == "mla" else attention_spec()


def head_slices(content: str) -> list[tuple[int, int]]:
    return [(0, 1)] if content == "mla" else [(0, HEADS), (1, 3), (3, 4)]


def copy(src: Cache, dst: Cache, pairs: list[tuple[int, int]], src_heads: tuple[int, int] | None = None) -> None:
    """Moves `pairs`' blocks of every layer as the pusher does: the geometry's paged writes,
    each applied page by page at its strides (what the engine's paged write does)."""
    s_geo, d_geo = src.region.geometry, dst.region.geometry
    plan = s_geo.copy_plan(d_geo, src_heads)
    s_buf, d_buf = src.raw.numpy().view(np.uint8), dst.raw.numpy().view(np.uint8)
    for layer in range(LAYERS):
        for run in s_geo.layer_writes(layer, d_geo, plan):
            for s, d in pairs:
                at, to = run.src_offset + s * run.src_stride, run.dst_offset + d * run.dst_stride
                d_buf[to:to + run.length] = s_buf[at:at + run.length]


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_every_byte_of_a_block_and_of_a_head_slice_is_where_vllm_reads_it(layout: KVCacheLayout,
                                                                           content: str) -> None:
    cache = vllm_cache(layout, _spec(content), SRC_BLOCKS, seed=1)
    geometry, size = cache.region.geometry, cache.raw.numel()
    assert geometry.layout == layout.name and geometry.latent == (content == "mla")
    for layer in range(LAYERS):
        for block in range(SRC_BLOCKS):
            for heads in head_slices(content):
                cells = [cache.cell(layer, block, h, n) for h in range(*heads) for n in range(TOKENS)]
                assert all(geometry.offset(layer, block, h, n) == cache.cell(layer, block, h, n)[0]
                           for h in range(*heads) for n in range(TOKENS))
                runs = geometry.runs(layer, block, heads)
                assert (mask_of(runs, size) == mask_of(cells, size)).all(), (layer, block, heads, runs)
            data = cache.raw.numpy().view(np.uint8)
            in_address_order = b"".join(bytes(data[o:o + n]) for o, n in sorted(cache.cells(layer, block)))
            assert cache.region.page_bytes(layer, block) == in_address_order


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_copying_the_named_runs_moves_the_blocks_and_touches_nothing_else(layout: KVCacheLayout,
                                                                          content: str) -> None:
    spec = _spec(content)
    src = vllm_cache(layout, spec, SRC_BLOCKS, seed=2)
    dst = vllm_cache(layout, spec, DST_BLOCKS, seed=3)
    before = dst.raw.clone()
    copy(src, dst, MOVED)
    moved = np.zeros(dst.raw.numel(), dtype=bool)
    for layer in range(LAYERS):
        for s, d in MOVED:
            assert same_bytes(dst.views[layer][d], src.views[layer][s]), (layer, s, d)
            moved |= mask_of(dst.cells(layer, d), dst.raw.numel())
    assert torch.equal(dst.raw[torch.from_numpy(~moved)], before[torch.from_numpy(~moved)])
    # The reservation's windows are exactly the moved blocks' bytes, and what the decoder
    # counts is what the plan posts: one immediate per paged write per block.
    windows = dst.region.geometry.windows([d for _, d in MOVED])
    assert (mask_of(windows, dst.raw.numel()) == moved).all()
    s_geo, d_geo = src.region.geometry, dst.region.geometry
    assert len(s_geo.layer_writes(0, d_geo, s_geo.copy_plan(d_geo))) == len(d_geo.block_runs())


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_a_head_slice_lands_in_a_narrower_cache_as_vllm_reads_it_there(layout: KVCacheLayout) -> None:
    # A decode rank serving heads 2..3 of a prefill rank's 4 (tensor parallel 1 into 2).
    src = vllm_cache(layout, _spec("attention"), SRC_BLOCKS, seed=4)
    narrow = attention_spec(heads=HEADS // 2)
    dst = vllm_cache(layout, narrow, DST_BLOCKS, seed=5)
    before = dst.raw.clone()
    copy(src, dst, MOVED, src_heads=(2, 4))
    moved = np.zeros(dst.raw.numel(), dtype=bool)
    for layer in range(LAYERS):
        for s, d in MOVED:
            assert same_bytes(dst.views[layer][d], src.views[layer][s, 2:4]), (layer, s, d)
            moved |= mask_of(dst.cells(layer, d), dst.raw.numel())
    assert torch.equal(dst.raw[torch.from_numpy(~moved)], before[torch.from_numpy(~moved)])


def test_the_cpu_layout_is_one_write_per_layer_and_keeps_its_windows_and_kv_layout() -> None:
    # vLLM's CPU backend (LBHNC): a request's blocks of one layer are one paged write, the
    # reservation's windows are those of kvxfer's layer-major cache, the kv_layout unchanged.
    cache = vllm_cache(KVCacheLayout.LBHNC, _spec("attention"), SRC_BLOCKS, seed=6)
    geometry = cache.region.geometry
    page = HEADS * TOKENS * 2 * HEAD_SIZE * 2
    assert geometry.copy_plan(geometry) == ((0, 0, page),)
    assert geometry.windows([1, 2, 4]) == reservation_windows([1, 2, 4], LAYERS, SRC_BLOCKS, page)
    assert cache.region.kv_layout == f"L{LAYERS}-H{HEADS}-D{HEAD_SIZE}-bfloat16-bs{TOKENS}-vllm-lbhnc-test"


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_the_layout_read_from_the_strides_addresses_the_same_bytes(layout: KVCacheLayout, content: str) -> None:
    # Without vLLM's word for the layout, the strides name one that places every byte the
    # same (with one head slot, several of the six are the same placement).
    cache = vllm_cache(layout, _spec(content), SRC_BLOCKS, seed=7)
    guessed = region_from_kv_caches(dict(enumerate(cache.views)), latent=content == "mla", isa="test").geometry
    given = cache.region.geometry
    assert all(guessed.offset(lyr, b, h, n) == given.offset(lyr, b, h, n) for lyr in range(LAYERS)
               for b in range(SRC_BLOCKS) for h in range(given.num_heads) for n in range(TOKENS))


def test_views_that_are_not_the_named_layout_are_refused() -> None:
    cache = vllm_cache(KVCacheLayout.BLHNC, _spec("attention"), SRC_BLOCKS, seed=8)
    with pytest.raises(KVRegionError, match="not layout LBHNC packed densely"):
        region_from_kv_caches(dict(enumerate(cache.views)), KVCacheLayout.LBHNC)


def test_latent_content_has_no_head_axis_to_split() -> None:
    geometry = CacheGeometry.dense("LBHNC", KVCacheLayout.LBHNC.value, LAYERS, SRC_BLOCKS, 1, TOKENS, 2 * LATENT,
                                latent=True)
    with pytest.raises(GeometryError, match="no head axis to split"):
        geometry.runs(0, 0, (0, 0))
    heads = CacheGeometry.dense("LBHNC", KVCacheLayout.LBHNC.value, LAYERS, SRC_BLOCKS, HEADS, TOKENS, 32)
    with pytest.raises(GeometryError, match="not a slice"):
        heads.runs(0, 0, (2, 5))
