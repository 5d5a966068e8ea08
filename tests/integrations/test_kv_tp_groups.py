"""Several KV cache groups under tensor parallelism, through the connector's worker halves
(`WorkerSide`, one per rank, each with its own engine) and no vLLM process.

Every rank's cache is laid out as vLLM's workers lay out a hybrid model's two groups (full
and sliding-window attention) over one allocation, with its share of 4 KV heads (LBHNC).
The decode ranks reserve as the connector does: at equal sizes whole blocks at their
same-rank prefill peer, otherwise sliced reservations at each prefill rank holding some of
their heads; every reservation names each group's blocks (`group_pages`, -1 where the
sliding window keeps none). The step metadata is the same on every rank, as vLLM sends
it. The oracle is vLLM's views: on every decode rank each layer's pages of its group hold
the prefill heads of the same global index from the prefiller's blocks of that group, the
sliding-window layers only their window's pages, and no other byte of the cache changed;
`kv_integrity` full checks each part's heads on the way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch  # noqa: E402
from support.vllm_kv_caches import OverlaidGroupsCache, same_bytes  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.integrations.vllm.sliced_reservation import (  # noqa: E402
    SliceTarget,
    decode_sliced_reservation,
    encode_sliced_reservation,
)
from kvxfer.integrations.vllm.tensor_parallel import (  # noqa: E402
    HeadSlice,
    TensorParallelPlace,
    encode_rank_addresses,
)
from kvxfer.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvxfer.kv.protocol import KVReservation  # noqa: E402
from kvxfer.transfer.engine import available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
KV_HEADS, TOKENS, HEAD_SIZE, LAYERS_PER_GROUP = 4, 4, 8, 2
FULL = [f"model.layers.{i}.attn" for i in (1, 3)]
WINDOW = [f"model.layers.{i}.attn" for i in (0, 2)]
#: The order vLLM's forward computes (and saves) the layers in.
FORWARD = sorted(FULL + WINDOW, key=lambda name: int(name.split(".")[2]))
PROMPT_PAGES = 5
# Per group (full, window), the block of each prompt page (one pool: no id in both
# groups); the window keeps the last two pages only, on both sides.
SRC = [[1, 2, 3, 4, 5], [-1, -1, -1, 6, 7]]
DST = [[9, 3, 11, 5, 2], [-1, -1, -1, 8, 12]]
SRC_BLOCKS, DST_BLOCKS = 8, 16
DEADLINE_S = 20.0


class GroupedCache(OverlaidGroupsCache):
    """One rank's cache: two KV cache groups of `heads` heads over one seeded allocation."""

    def __init__(self, heads: int, num_blocks: int, seed: int) -> None:
        spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        super().__init__([(FULL, spec), (WINDOW, spec)], spec, num_blocks, seed)


@dataclass
class Rank:
    """One tensor parallel rank: its cache and its worker half."""

    cache: GroupedCache
    place: TensorParallelPlace
    worker: WorkerSide


def _ranks(tp: int, role: str, num_blocks: int, seed: int) -> list[Rank]:
    settings = ConnectorSettings(provider=PROVIDER, same_host=False, bind_host="127.0.0.1", kv_integrity="full")
    ranks: list[Rank] = []
    for r in range(tp):
        place = TensorParallelPlace(r, tp, KV_HEADS)
        cache = GroupedCache(KV_HEADS // tp, num_blocks, seed + r)
        worker = WorkerSide(settings, role, "m", place=place)
        ranks.append(Rank(cache, place, worker))
        worker.register_kv_caches(cache.views, KVCacheLayout.LBHNC, groups=[FULL, WINDOW])
    return ranks


@pytest.fixture
def shut_down() -> Iterator[list[Rank]]:
    """The ranks a test made, shut down (engines closed) once it is over."""
    made: list[Rank] = []
    yield made
    for rank in made:
        rank.worker.shutdown()


def _hand_off(prefill: list[Rank], decode: list[Rank], tid: str) -> dict[int, str]:
    """One request of PROMPT_PAGES pages from every prefill rank into every decode rank, as
    vLLM drives the worker halves: the decode ranks start the load, the prefill ranks
    compute every layer in one step (before any reservation came: caught up), then both
    poll. Returns each decode rank's failure reason (empty: every rank admitted)."""
    prefill_engines = encode_rank_addresses([p.worker.engine.address for p in prefill])  # type: ignore[union-attr]
    decode_engines = encode_rank_addresses([d.worker.engine.address for d in decode])  # type: ignore[union-attr]
    request = f"decode-{tid}"
    loaded = [b for group in DST for b in group if b >= 0]
    for d in decode:
        d.worker.bind(KvxferStepMetadata(loads=[LoadSpec(request, tid, prefill_engines, loaded, 0,
                                                         group_block_ids=[list(g) for g in DST])]))
        d.worker.start_load_kv()
        d.worker.bind(KvxferStepMetadata())
    tokens = PROMPT_PAGES * TOKENS
    for p in prefill:
        p.worker.bind(KvxferStepMetadata(pushes=[PushSpec(f"prefill-{tid}", tid, decode_engines, tokens,
                                                          list(SRC[0]), tokens,
                                                          group_block_ids=[list(g) for g in SRC])]))
        for name in FORWARD:
            p.worker.save_kv_layer(name)
        p.worker.bind(KvxferStepMetadata())
    outcome: dict[int, str] = {}
    reasons = {d.place.rank: "" for d in decode}
    end = time.monotonic() + DEADLINE_S
    while len(outcome) < len(decode) and time.monotonic() < end:
        for p in prefill:
            p.worker.get_finished(set())
        for d in decode:
            if d.place.rank in outcome:
                continue
            assert d.worker.receiver is not None
            # Read before the poll that reports (and forgets) the load.
            reasons[d.place.rank] = d.worker.receiver.failure(request) or reasons[d.place.rank]
            _, finished, failed = d.worker.get_finished(set())
            if request in finished:
                outcome[d.place.rank] = (reasons[d.place.rank] or "failed") if request in failed else ""
        time.sleep(0.001)
    assert len(outcome) == len(decode), f"decode ranks without an outcome within {DEADLINE_S} s: {reasons}"
    return {rank: why for rank, why in outcome.items() if why}


def _assert_groups_landed(prefill: list[Rank], decode: list[Rank], before: list[np.ndarray]) -> None:
    """Each decode rank's pages of every layer hold, head by head, the prefill heads of the
    same global index from the prefiller's block of the layer's group; a sliding-window
    layer only its window's pages; no other byte changed."""
    for d, untouched in zip(decode, before):
        d0, d1 = d.place.heads
        moved = np.zeros(untouched.size, dtype=bool)
        for names, group in ((FULL, 0), (WINDOW, 1)):
            for name in names:
                for src, dst in zip(SRC[group], DST[group]):
                    if dst < 0:
                        continue  # the window keeps no block for this page: nothing pushed
                    for head in range(d0, d1):
                        p = next(p for p in prefill if p.place.heads[0] <= head < p.place.heads[1])
                        got = d.cache.views[name][dst, head - d0]
                        want = p.cache.views[name][src, head - p.place.heads[0]]
                        assert same_bytes(got, want), (d.place.rank, name, dst, head)
                        start, length = d.cache.head_range(name, dst, head - d0)
                        moved[start:start + length] = True
        after = d.cache.host_bytes()
        assert (after[~moved] == untouched[~moved]).all(), f"decode rank {d.place.rank}: bytes outside its pages moved"
        pages = sum(1 for group in (0, 1) for page in DST[group] if page >= 0) * LAYERS_PER_GROUP
        assert moved.sum() == pages * d.cache.head_range(FULL[0], 0, 0)[1] * (d1 - d0)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (1, 2), (2, 1)])
def test_each_decode_rank_gets_its_heads_of_every_layers_group_pages_and_nothing_else(
        shut_down: list[Rank], prefill_tp: int, decode_tp: int) -> None:
    prefill = _ranks(prefill_tp, "kv_producer", SRC_BLOCKS, seed=61)
    shut_down += prefill
    decode = _ranks(decode_tp, "kv_consumer", DST_BLOCKS, seed=71)
    shut_down += decode
    before = [d.cache.host_bytes().copy() for d in decode]
    assert _hand_off(prefill, decode, f"groups-tp{prefill_tp}{decode_tp}") == {}
    _assert_groups_landed(prefill, decode, before)


def _reservation(group_pages: list[list[int]] | None) -> KVReservation:
    pages = [p for g in group_pages for p in g if p >= 0] if group_pages else [9, 3]
    return KVReservation(request_id="t", descriptor=b"\x01", pages=pages, num_pages=16, imm=7 << 8 | 1,
                         expected_count=14 if group_pages else 4,
                         kv_layout="L2-H2-D8-bfloat16-bs4-vllm-lbhnc-test" + ("-hma2_0" if group_pages else ""),
                         meta_descriptor=b"", meta_offset=0, nonce=1, fence_timeout_s=10.0, mailbox=False,
                         group_pages=group_pages)


def test_a_sliced_reservation_carries_group_pages_and_a_one_group_one_is_as_before() -> None:
    target = SliceTarget(1, 2, HeadSlice(0, (2, 4), (0, 2)), 2)
    grouped = decode_sliced_reservation(encode_sliced_reservation(target, _reservation(DST)), src_rank=0)
    assert grouped is not None and grouped[0] == target and grouped[1].group_pages == DST
    # One group: the header and the reservation's JSON exactly as a peer written before
    # groups sends and reads them (no group_pages key).
    raw = encode_sliced_reservation(target, _reservation(None))
    # version 1, decode rank 1 of 2, heads 2..4 into 0..2 of 2 (little-endian uint16s)
    assert raw[:20] == b"KVHS" + bytes.fromhex("0100" "0100" "0200" "0200" "0400" "0000" "0200" "0200")
    assert raw[20:24] == b"KVRS"
    assert b"group_pages" not in raw
    one = decode_sliced_reservation(raw, src_rank=0)
    assert one is not None and one[1].group_pages is None
