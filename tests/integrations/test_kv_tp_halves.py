"""Head slices between tensor parallel sizes, with the connector's worker halves between real
engines and no vLLM process: a prefill rank's `KVPusher` and a decode rank's `KVReceiver`
per rank, over caches vLLM's own code lays out (LBHNC, 4 KV heads in all), the sliced
reservations, writes and checksum tables travelling over the fabric as in production.
The oracle is vLLM's views: every decode rank's heads equal the prefill heads of the same
global index, and no other byte of its cache changed. Real vLLM ranks run the same path in
test_vllm_tp.py (opt-in)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import halves_engines, started_load  # noqa: E402
from support.sliced_halves import Rank, assert_heads_landed, sliced_hand_off  # noqa: E402
from support.vllm_kv_caches import attention_spec, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.metadata import LoadSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.integrations.vllm.tensor_parallel import (  # noqa: E402
    TensorParallelPlace,
    encode_rank_addresses,
    rank_heads,
)
from kvxfer.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
KV_HEADS, SRC_BLOCKS, DST_BLOCKS = 4, 6, 9
SRC, DST = [1, 2, 4], [7, 3, 5]
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    with halves_engines(PROVIDER, 6) as out:
        yield out


def _ranks(engines: list[TransferEngine], tp: int, blocks: int, seed: int) -> list[Rank]:
    spec = attention_spec(heads=KV_HEADS // tp)
    return [Rank(engines[r], vllm_cache(KVCacheLayout.LBHNC, spec, blocks, seed=seed + r),
                 TensorParallelPlace(r, tp, KV_HEADS)) for r in range(tp)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_each_decode_rank_receives_exactly_its_heads_from_the_prefill_ranks_that_hold_them(
        engines: list[TransferEngine], prefill_tp: int, decode_tp: int) -> None:
    # (Equal sizes move whole blocks with the protocol's own reservation: test_vllm_tp.py.)
    prefill = _ranks(engines[:prefill_tp], prefill_tp, SRC_BLOCKS, seed=31)
    decode = _ranks(engines[prefill_tp:prefill_tp + decode_tp], decode_tp, DST_BLOCKS, seed=41)
    before = [d.cache.host_bytes().copy() for d in decode]
    outcome = sliced_hand_off(prefill, decode, f"tp{prefill_tp}{decode_tp}", SRC, DST, PROVIDER, DEADLINE_S)
    assert outcome == {d.place.rank: "" for d in decode}
    assert_heads_landed(prefill, decode, before, SRC, DST)
    assert [rank_heads(KV_HEADS, decode_tp, r) for r in range(decode_tp)] == [d.place.heads for d in decode]


def test_a_decode_rank_fails_a_load_whose_prefill_heads_cannot_be_mapped_with_the_reason(
        engines: list[TransferEngine]) -> None:
    # The router never pairs these (compatible()); a connector handed one anyway fails the
    # request, with the sizes in the reason, and reserves nothing.
    cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(heads=1), DST_BLOCKS, seed=51)
    worker = WorkerSide(ConnectorSettings(provider=PROVIDER, same_host=False, bind_host="127.0.0.1"),
                        "kv_consumer", "m", place=TensorParallelPlace(1, 2, 2))
    try:
        worker.register_kv_caches({f"layers.{i}.attn": view for i, view in enumerate(cache.views)})
        three_ranks = encode_rank_addresses([engines[0].address, engines[1].address, engines[2].address])
        reason, finished, failed = started_load(worker, LoadSpec("r1", "tp-3-into-2", three_ranks, list(DST), 0))
    finally:
        worker.shutdown()
    assert finished == failed == {"r1"}
    assert "cannot be mapped" in reason and "tensor parallel size 3" in reason, reason
