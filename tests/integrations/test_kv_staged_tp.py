"""Head slices between tensor parallel sizes on the staged path, the one device (CUDA) caches
take: each prefill rank copies its head slice of every block into pinned staging rows and
posts it from there (`StagedWrites`), each decode rank lands the slices of every prefill rank
its heads come from in its landing blocks and copies them into its cache once all landed
(`StagedLanding`). Driven here with host tensors (the same code as on a GPU, with host
copies), the worker halves between real engines as in test_kv_tp_halves.py, over caches
vLLM's own code lays out. The oracle is vLLM's views: every decode rank's blocks hold
exactly its heads, taken from the prefill rank that holds each, and no other byte of its
cache changed (with two KV cache groups too, each layer's pages in its group's blocks);
where one prefill rank's part fails, nothing is copied into the cache at all.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import halves_engines  # noqa: E402
from support.sliced_halves import Rank, StagedPath, assert_heads_landed, sliced_hand_off  # noqa: E402
from support.vllm_kv_caches import (  # noqa: E402
    TOKENS,
    Cache,
    OverlaidGroupsCache,
    attention_spec,
    mla_spec,
    same_bytes,
    vllm_cache,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.kv_region import region_from_kv_caches  # noqa: E402
from kvxfer.integrations.vllm.tensor_parallel import TensorParallelPlace  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
SRC_BLOCKS, DST_BLOCKS, LANDING_BLOCKS, STAGING_ROWS = 6, 9, 8, 32
SRC, DST = [1, 2, 4], [7, 3, 5]
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    with halves_engines(PROVIDER, 6) as out:
        yield out


def _ranks(engines: list[TransferEngine], tp: int, kv_heads: int, blocks: int, seed: int, layout: str = "LBHNC",
           mla: bool = False, tokens: int = TOKENS) -> list[Rank]:
    spec = mla_spec(tokens) if mla else attention_spec(heads=max(1, kv_heads // tp), tokens=tokens)
    return [Rank(engines[r], vllm_cache(KVCacheLayout[layout], spec, blocks, seed=seed + r),
                 TensorParallelPlace(r, tp, kv_heads)) for r in range(tp)]


def _hand_off(prefill: list[Rank], decode: list[Rank], tid: str,
              groups: tuple[list[list[int]], list[list[int]]] | None = None) -> dict[int, str]:
    """One request from every prefill rank into every decode rank through the staged path
    (with `groups`: every KV cache group's blocks, prefill side then decode side); each
    decode rank's outcome ("" admitted, else why it failed)."""
    return sliced_hand_off(prefill, decode, tid, SRC, DST, PROVIDER, DEADLINE_S,
                           StagedPath(STAGING_ROWS, LANDING_BLOCKS), groups)


#: (prefill TP, decode TP, KV heads, layout, MLA content)
CASES = [(1, 2, 4, "LBHNC", False), (2, 1, 4, "LBHNC", False), (1, 2, 4, "BLHNC", False),
         (2, 4, 2, "LBHNC", False), (1, 2, 1, "LBHNC", True)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_heads", "layout", "mla"), CASES,
                         ids=["1into2", "2into1", "1into2-blhnc", "2into4-replicated-gqa", "1into2-mla"])
def test_each_staged_decode_rank_receives_exactly_its_heads_through_its_landing_blocks(
        engines: list[TransferEngine], prefill_tp: int, decode_tp: int, kv_heads: int, layout: str,
        mla: bool) -> None:
    # MLA's latent has no head axis: every decode rank takes the whole block from one
    # prefill rank, as vLLM replicates MLA's KV over its ranks.
    prefill = _ranks(engines[:prefill_tp], prefill_tp, kv_heads, SRC_BLOCKS, 61, layout, mla)
    decode = _ranks(engines[prefill_tp:], decode_tp, kv_heads, DST_BLOCKS, 71, layout, mla)
    before = [d.cache.host_bytes().copy() for d in decode]
    outcome = _hand_off(prefill, decode, f"staged-{prefill_tp}{decode_tp}{kv_heads}{layout}{mla}")
    assert outcome == {d.place.rank: "" for d in decode}
    assert_heads_landed(prefill, decode, before, SRC, DST)
    for d in decode:  # every landing block handed back once the load was reported
        assert d.receiver is not None and len(d.receiver.landing._free) == LANDING_BLOCKS


def test_a_failed_part_fences_the_other_and_nothing_is_copied_into_the_cache(engines: list[TransferEngine]) -> None:
    # Prefill rank 1's blocks hold 2 tokens, not 4: it refuses the reservation (layout
    # mismatch) and tells the decoder, while rank 0's slices land in the landing blocks.
    # Those must never reach the cache, and the landing blocks come back only after rank 0
    # confirmed no write of it is in flight.
    prefill = _ranks(engines, 2, 4, SRC_BLOCKS, 81)
    prefill[1].cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(heads=2, tokens=2), SRC_BLOCKS, seed=82)
    decode = _ranks(engines[2:3], 1, 4, DST_BLOCKS, 91)
    before = decode[0].cache.host_bytes().copy()
    outcome = _hand_off(prefill, decode, "staged-part-fails")
    assert "KV layout mismatch" in outcome[0], outcome
    assert (decode[0].cache.host_bytes() == before).all()
    receiver = decode[0].receiver
    assert receiver is not None and len(receiver.landing._free) == LANDING_BLOCKS


# Two KV cache groups over one allocation, as vLLM's hybrid manager lays them out (full and
# sliding-window attention, every group's views from byte 0; one block pool, so no block id
# in both groups; the window keeps the last two of five pages only, -1 before).
FULL, WINDOW = [f"model.layers.{i}.attn" for i in (1, 3)], [f"model.layers.{i}.attn" for i in (0, 2)]
GROUP_SRC = [[1, 2, 3, 4, 5], [-1, -1, -1, 6, 7]]
GROUP_DST = [[9, 3, 11, 5, 2], [-1, -1, -1, 8, 12]]


def _grouped_cache(heads: int, num_blocks: int, seed: int) -> Cache:
    """One rank's two-group cache of `heads` heads (views by layer name in `Cache.views`
    order: FULL then WINDOW)."""
    spec = attention_spec(heads=heads)
    groups = OverlaidGroupsCache([(FULL, spec), (WINDOW, spec)], spec, num_blocks, seed)
    region = region_from_kv_caches(groups.views, KVCacheLayout.LBHNC, isa="test", groups=[FULL, WINDOW])
    return Cache(groups.raw, [groups.views[name] for name in FULL + WINDOW], region)


def test_two_kv_cache_groups_reach_each_staged_decode_rank_head_sliced_in_their_own_blocks(
        engines: list[TransferEngine]) -> None:
    # Prefill TP 1 into decode TP 2: each decode rank's landing blocks take its heads of
    # every group's pages, copied whole into the blocks of each page's group.
    prefill = [Rank(engines[0], _grouped_cache(4, 8, 101), TensorParallelPlace(0, 1, 4))]
    decode = [Rank(engines[1 + r], _grouped_cache(2, 16, 111 + r), TensorParallelPlace(r, 2, 4)) for r in range(2)]
    before = [d.cache.host_bytes().copy() for d in decode]
    assert _hand_off(prefill, decode, "staged-groups-1into2", (GROUP_SRC, GROUP_DST)) == {0: "", 1: ""}
    for d, untouched in zip(decode, before):
        d0 = d.place.heads[0]
        moved = np.zeros(untouched.size, dtype=bool)
        for index, group in enumerate([0] * len(FULL) + [1] * len(WINDOW)):
            for src, dst in zip(GROUP_SRC[group], GROUP_DST[group]):
                if dst < 0:
                    continue  # the window keeps no block for this page: nothing pushed
                for head in range(2):
                    got = d.cache.views[index][dst, head]
                    assert same_bytes(got, prefill[0].cache.views[index][src, d0 + head]), (index, dst, head)
                    start = got.data_ptr() - d.cache.raw.data_ptr()
                    moved[start:start + got.numel() * got.element_size()] = True
        assert (d.cache.host_bytes()[~moved] == untouched[~moved]).all()
