"""The tensor parallel plan of the connector without vLLM running: which prefill rank gives
which KV heads to which decode rank (vLLM's split, GQA replication included), the rank
address list an instance publishes, and the router's pairing check. The transfers
themselves run with real vLLM ranks in test_vllm_tp.py."""

from __future__ import annotations

import pytest

from kvxfer.integrations.vllm.tensor_parallel import (
    HeadSlice,
    TensorParallelError,
    decode_rank_addresses,
    encode_rank_addresses,
    head_sources,
    head_targets,
    rank_heads,
)
from kvxfer_router.directory import WorkerView
from kvxfer_router.policies import compatible


def test_ranks_hold_the_heads_vllm_gives_them_replicated_where_ranks_outnumber_heads() -> None:
    assert [rank_heads(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads over 4 ranks: each head on two consecutive ranks (num_kv_head_replicas).
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


@pytest.mark.parametrize(("heads", "src_tp", "dst_tp"), [
    (2, 1, 1), (2, 2, 2), (2, 1, 2), (2, 2, 1), (8, 2, 4), (8, 4, 2), (2, 4, 1), (2, 1, 4), (2, 4, 2), (8, 8, 1),
])
def test_every_decode_head_comes_exactly_once_from_a_prefill_rank_that_holds_it(heads: int, src_tp: int,
                                                                                dst_tp: int) -> None:
    for dst_rank in range(dst_tp):
        d0, d1 = rank_heads(heads, dst_tp, dst_rank)
        got: list[int] = []
        for s in head_sources(heads, src_tp, dst_tp, dst_rank):
            s0, _ = rank_heads(heads, src_tp, s.src_rank)
            assert s.src_heads[1] - s.src_heads[0] == s.dst_heads[1] - s.dst_heads[0] > 0
            got += [s0 + h for h in range(*s.src_heads)]
            assert [d0 + h for h in range(*s.dst_heads)] == [s0 + h for h in range(*s.src_heads)]
        assert got == list(range(d0, d1))
    # Each prefill rank knows which decode ranks ask it, so it waits for exactly their reservations.
    for src_rank in range(src_tp):
        asked = [d for d in range(dst_tp) if any(s.src_rank == src_rank
                                                 for s in head_sources(heads, src_tp, dst_tp, d))]
        assert head_targets(heads, src_tp, dst_tp, src_rank) == asked


def test_one_prefill_rank_of_two_heads_gives_each_decode_rank_of_two_its_own_head() -> None:
    assert head_sources(2, 1, 2, 0) == [HeadSlice(0, (0, 1), (0, 1))]
    assert head_sources(2, 1, 2, 1) == [HeadSlice(0, (1, 2), (0, 1))]
    assert head_sources(2, 2, 1, 0) == [HeadSlice(0, (0, 1), (0, 1)), HeadSlice(1, (0, 1), (1, 2))]
    assert head_sources(8, 2, 1, 0) == [HeadSlice(0, (0, 4), (0, 4)), HeadSlice(1, (0, 4), (4, 8))]


def test_sizes_that_cannot_split_the_heads_are_refused_with_the_reason() -> None:
    with pytest.raises(TensorParallelError, match="cannot be split over tensor parallel size 3"):
        head_sources(2, 3, 1, 0)
    with pytest.raises(TensorParallelError, match="cannot be split over tensor parallel size 3"):
        head_sources(8, 2, 3, 0)


def test_a_lone_address_is_published_as_it_is_and_several_as_a_list() -> None:
    a, b = b"KVXA" + bytes(range(60)), b"KVXA" + bytes(range(100, 170))
    assert encode_rank_addresses([a]) == a
    assert decode_rank_addresses(a) == [a]
    assert decode_rank_addresses(encode_rank_addresses([a, b])) == [a, b]
    with pytest.raises(TensorParallelError, match="truncated"):
        decode_rank_addresses(encode_rank_addresses([a, b])[:-1])


def _vllm(role: str, tp: int, heads: int, layout: str = "L4-H2-D64") -> WorkerView:
    return WorkerView(worker_id=f"{role}-{tp}", role=role, http_url="http://x", model="m",  # type: ignore[arg-type]
                      kv_layout=layout, engine="vllm", tp_size=tp, kv_heads=heads)


def test_the_router_pairs_only_sizes_whose_heads_map() -> None:
    assert compatible(_vllm("decode", 2, 2), _vllm("prefill", 1, 2))
    assert compatible(_vllm("decode", 1, 2), _vllm("prefill", 2, 2))
    assert compatible(_vllm("decode", 4, 2), _vllm("prefill", 2, 2))  # GQA replicated on the decoder
    assert not compatible(_vllm("decode", 3, 2), _vllm("prefill", 1, 2))
    assert not compatible(_vllm("decode", 2, 0), _vllm("prefill", 1, 0))  # heads not said: equal sizes only
    assert not compatible(_vllm("decode", 2, 2), _vllm("prefill", 2, 2, layout="L4-H4-D64"))
