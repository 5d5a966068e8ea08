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

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch  # noqa: E402
from support.connector_halves import halves_engine  # noqa: E402
from support.vllm_kv_caches import TOKENS, Cache, attention_spec, mla_spec, same_bytes, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.cache_paths import StagedLanding, StagedWrites  # noqa: E402
from kvxfer.integrations.vllm.kv_checksums import decode_table  # noqa: E402
from kvxfer.integrations.vllm.kv_pusher import KVPusher  # noqa: E402
from kvxfer.integrations.vllm.kv_receiver import KVReceiver  # noqa: E402
from kvxfer.integrations.vllm.kv_region import region_from_kv_caches  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.integrations.vllm.sliced_reservation import SliceTarget, decode_sliced_reservation  # noqa: E402
from kvxfer.integrations.vllm.tensor_parallel import (  # noqa: E402
    TensorParallelPlace,
    encode_rank_addresses,
    head_sources,
)
from kvxfer.kv.protocol import decode_abort, decode_cancel  # noqa: E402
from kvxfer.metrics import ConnectorMetrics  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
SRC_BLOCKS, DST_BLOCKS, LANDING_BLOCKS, STAGING_ROWS = 6, 9, 8, 32
SRC, DST = [1, 2, 4], [7, 3, 5]
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    out = [halves_engine(PROVIDER) for _ in range(6)]
    try:
        yield out
    finally:
        for engine in out:
            engine.close()


@dataclass
class Rank:
    """One rank's engine and cache (staged halves over it once made)."""

    engine: TransferEngine
    cache: Cache
    place: TensorParallelPlace
    pusher: KVPusher | None = None
    receiver: KVReceiver | None = None


def _ranks(engines: list[TransferEngine], tp: int, kv_heads: int, blocks: int, seed: int, layout: str = "LBHNC",
           mla: bool = False, tokens: int = TOKENS) -> list[Rank]:
    spec = mla_spec(tokens) if mla else attention_spec(heads=max(1, kv_heads // tp), tokens=tokens)
    return [Rank(engines[r], vllm_cache(KVCacheLayout[layout], spec, blocks, seed=seed + r),
                 TensorParallelPlace(r, tp, kv_heads)) for r in range(tp)]


def _hand_off(prefill: list[Rank], decode: list[Rank], tid: str,
              groups: tuple[list[list[int]], list[list[int]]] | None = None) -> dict[int, str]:
    """One request from every prefill rank into every decode rank, each through the staged
    path, as the worker halves run under vLLM (with `groups`: every KV cache group's blocks,
    prefill side then decode side); each decode rank's outcome ("" admitted, else why it
    failed)."""
    src_groups, dst_groups = groups if groups is not None else (None, None)
    dst = [b for g in dst_groups for b in g if b >= 0] if dst_groups is not None else DST
    src = src_groups[0] if src_groups is not None else SRC
    pages = len(src)
    settings = ConnectorSettings(provider=PROVIDER)
    kv_heads = prefill[0].place.total_kv_heads
    for p in prefill:
        p.pusher = KVPusher(settings, p.engine, p.cache.region, None, ConnectorMetrics("kv_producer"),
                            writes=StagedWrites(p.engine, p.cache.region, staging_rows=STAGING_ROWS), place=p.place)
    prefill_addresses = [p.engine.address for p in prefill]
    for d in decode:
        landing = StagedLanding(d.engine, d.cache.region, landing_blocks=LANDING_BLOCKS)
        d.receiver = KVReceiver(settings, d.engine, d.cache.region, None, ConnectorMetrics("kv_consumer"),
                                landing=landing)
        sources = head_sources(kv_heads, len(prefill), len(decode), d.place.rank)
        heads = d.cache.region.geometry.num_heads
        parts = [(prefill_addresses[s.src_rank], SliceTarget(d.place.rank, len(decode), s, heads)) for s in sources]
        d.receiver.start(LoadSpec(f"d-{tid}", tid, encode_rank_addresses(prefill_addresses), list(dst), 0,
                                  group_block_ids=dst_groups), parts)
    decode_engines = encode_rank_addresses([d.engine.address for d in decode])
    tokens = pages * TOKENS
    for p in prefill:
        assert p.pusher is not None
        p.pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"p-{tid}", tid, decode_engines, tokens, list(src),
                                                             tokens, group_block_ids=src_groups)]))
        for layer in range(p.cache.region.num_layers):
            p.pusher.save_layer(layer)
    outcome: dict[int, str] = {}
    end = time.monotonic() + DEADLINE_S
    while len(outcome) < len(decode) and time.monotonic() < end:
        for p in prefill:
            assert p.pusher is not None
            raw = p.engine.recv(0.0)
            sliced = decode_sliced_reservation(bytes(raw), p.place.rank) if raw is not None else None
            if sliced is not None:
                p.pusher.on_reservation(sliced[1], sliced[0])
            cancel = decode_cancel(bytes(raw)) if raw is not None and sliced is None else None
            if cancel is not None:
                p.pusher.on_cancel(*cancel)
            p.pusher.poll(set())
        for d in decode:
            assert d.receiver is not None
            raw = d.engine.recv(0.0)
            table = decode_table(bytes(raw)) if raw is not None else None
            if table is not None:
                d.receiver.on_checksum_table(table)
            stopped = decode_abort(bytes(raw)) if raw is not None else None
            if stopped is not None:
                d.receiver.on_prefill_stopped(*stopped)
            reason = d.receiver.failure(f"d-{tid}")  # read before the poll that reports (and forgets) it
            finished, failed = d.receiver.poll(set())
            if f"d-{tid}" in finished:
                outcome[d.place.rank] = (reason or "failed") if failed else ""
        time.sleep(0.001)
    assert len(outcome) == len(decode), f"decode ranks got no outcome within {DEADLINE_S} s: {outcome}"
    return outcome


def _assert_heads_landed(prefill: list[Rank], decode: list[Rank], before: list[np.ndarray]) -> None:
    """Every decode rank's heads are the prefill heads of the same global index (MLA: the
    one latent slot every rank holds), byte for byte, and nothing else of its cache changed."""
    for d, untouched in zip(decode, before):
        d0, d1 = d.place.heads
        moved = np.zeros(untouched.size, dtype=bool)
        for layer in range(d.cache.region.num_layers):
            for s, block in zip(SRC, DST):
                for head in range(d0, d1):
                    p = next(p for p in prefill if p.place.heads[0] <= head < p.place.heads[1])
                    local = 0 if d.cache.region.geometry.latent else head - d0
                    remote = 0 if p.cache.region.geometry.latent else head - p.place.heads[0]
                    assert same_bytes(d.cache.views[layer][block, local], p.cache.views[layer][s, remote]), \
                        (layer, block, head)
                for offset, length in d.cache.cells(layer, block):
                    moved[offset:offset + length] = True
        assert (d.cache.host_bytes()[~moved] == untouched[~moved]).all()


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
    _assert_heads_landed(prefill, decode, before)
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
    layout = KVCacheLayout.LBHNC
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(FULL), layout)
    size = len(FULL) * num_blocks * spec.page_size_bytes
    raw = torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, size, dtype=np.int8))
    views: dict[str, torch.Tensor] = {}
    for names in (FULL, WINDOW):
        tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride,
                               offset=0)
        views.update(zip(names, create_kv_cache_views(raw, spec, num_blocks, layout, tensor)))
    region = region_from_kv_caches(views, layout, isa="test", groups=[FULL, WINDOW])
    return Cache(raw, [views[name] for name in FULL + WINDOW], region)


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
