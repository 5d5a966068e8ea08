"""Head slices between tensor parallel sizes, with the connector's worker halves between real
engines and no vLLM process: a prefill rank's `KVPusher` and a decode rank's `KVReceiver`
per rank, over caches vLLM's own code lays out (LBHNC, 4 KV heads in all), the sliced
reservations, writes and checksum tables travelling over the fabric as in production.
The oracle is vLLM's views: every decode rank's heads equal the prefill heads of the same
global index, and no other byte of its cache changed. Real vLLM ranks run the same path in
test_vllm_tp.py (opt-in)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import halves_engine  # noqa: E402
from support.vllm_kv_caches import TOKENS, Cache, attention_spec, same_bytes, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.cache_paths import DirectLanding, DirectWrites  # noqa: E402
from kvxfer.integrations.vllm.kv_checksums import decode_table  # noqa: E402
from kvxfer.integrations.vllm.kv_pusher import KVPusher  # noqa: E402
from kvxfer.integrations.vllm.kv_receiver import KVReceiver  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.integrations.vllm.sliced_reservation import SliceTarget, decode_sliced_reservation  # noqa: E402
from kvxfer.integrations.vllm.tensor_parallel import (  # noqa: E402
    TensorParallelPlace,
    encode_rank_addresses,
    head_sources,
    rank_heads,
)
from kvxfer.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvxfer.kv.protocol import decode_abort  # noqa: E402
from kvxfer.metrics import ConnectorMetrics  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
KV_HEADS, SRC_BLOCKS, DST_BLOCKS = 4, 6, 9
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
    """One rank's engine and cache; its pusher or receiver once made."""

    engine: TransferEngine
    cache: Cache
    place: TensorParallelPlace
    pusher: KVPusher | None = None
    receiver: KVReceiver | None = None


def _ranks(engines: list[TransferEngine], tp: int, blocks: int, seed: int) -> list[Rank]:
    spec = attention_spec(heads=KV_HEADS // tp)
    return [Rank(engines[r], vllm_cache(KVCacheLayout.LBHNC, spec, blocks, seed=seed + r),
                 TensorParallelPlace(r, tp, KV_HEADS)) for r in range(tp)]


def _hand_off(prefill: list[Rank], decode: list[Rank], tid: str) -> set[str]:
    """One request from every prefill rank into every decode rank, as the worker halves run
    under vLLM; the decode ranks' failure reasons (empty: every rank admitted)."""
    settings = ConnectorSettings(provider=PROVIDER)
    for p in prefill:
        writes = DirectWrites(p.engine, p.engine.register(p.cache.region.buffer), p.cache.region.geometry)
        p.pusher = KVPusher(settings, p.engine, p.cache.region, None, ConnectorMetrics("kv_producer"),
                            writes=writes, place=p.place)
    prefill_addresses = [p.engine.address for p in prefill]
    for d in decode:
        landing = DirectLanding(d.engine.register(d.cache.region.buffer), d.cache.region.geometry)
        d.receiver = KVReceiver(settings, d.engine, d.cache.region, None, ConnectorMetrics("kv_consumer"),
                                landing=landing)
        sources = head_sources(KV_HEADS, len(prefill), len(decode), d.place.rank)
        parts = [(prefill_addresses[s.src_rank], SliceTarget(d.place.rank, len(decode), s, KV_HEADS // len(decode)))
                 for s in sources]
        d.receiver.start(LoadSpec(f"d-{tid}", tid, encode_rank_addresses(prefill_addresses), list(DST), 0), parts)
    decode_engines = encode_rank_addresses([d.engine.address for d in decode])
    tokens = len(SRC) * TOKENS
    for p in prefill:
        assert p.pusher is not None
        p.pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"p-{tid}", tid, decode_engines, tokens, list(SRC),
                                                             tokens)]))
        for layer in range(p.cache.region.num_layers):
            p.pusher.save_layer(layer)
    pending = {d.place.rank for d in decode}
    failures: set[str] = set()
    end = time.monotonic() + DEADLINE_S
    while pending and time.monotonic() < end:
        for p in prefill:
            assert p.pusher is not None
            raw = p.engine.recv(0.0)
            sliced = decode_sliced_reservation(bytes(raw), p.place.rank) if raw is not None else None
            if sliced is not None:
                p.pusher.on_reservation(sliced[1], sliced[0])
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
                pending.discard(d.place.rank)
                if failed:
                    failures.add(d.receiver.failure(f"d-{tid}") or reason or "failed")
        time.sleep(0.001)
    assert not pending, f"decode ranks {pending} got no outcome within {DEADLINE_S} s"
    return failures


def _assert_heads_landed(prefill: list[Rank], decode: list[Rank], before: list[np.ndarray]) -> None:
    """Every decode rank's heads are the prefill heads of the same global index, byte for
    byte (vLLM's views), and nothing else of its cache changed."""
    for d, untouched in zip(decode, before):
        d0, d1 = d.place.heads
        moved = np.zeros(untouched.size, dtype=bool)
        for layer in range(d.cache.region.num_layers):
            for s, block in zip(SRC, DST):
                for head in range(d0, d1):
                    p = next(p for p in prefill if p.place.heads[0] <= head < p.place.heads[1])
                    got = d.cache.views[layer][block, head - d0]
                    want = p.cache.views[layer][s, head - p.place.heads[0]]
                    assert same_bytes(got, want), (layer, block, head)
                for offset, length in d.cache.cells(layer, block):
                    moved[offset:offset + length] = True
        after = d.cache.host_bytes()
        assert (after[~moved] == untouched[~moved]).all()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_each_decode_rank_receives_exactly_its_heads_from_the_prefill_ranks_that_hold_them(
        engines: list[TransferEngine], prefill_tp: int, decode_tp: int) -> None:
    # (Equal sizes move whole blocks with the protocol's own reservation: test_vllm_tp.py.)
    prefill = _ranks(engines[:prefill_tp], prefill_tp, SRC_BLOCKS, seed=31)
    decode = _ranks(engines[prefill_tp:prefill_tp + decode_tp], decode_tp, DST_BLOCKS, seed=41)
    before = [d.cache.host_bytes().copy() for d in decode]
    assert _hand_off(prefill, decode, f"tp{prefill_tp}{decode_tp}") == set()
    _assert_heads_landed(prefill, decode, before)
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
        worker.bind(KvxferStepMetadata(loads=[LoadSpec("r1", "tp-3-into-2", three_ranks, list(DST), 0)]))
        assert worker.receiver is not None
        worker.start_load_kv()
        reason = worker.receiver.failure("r1")
        _, finished, failed = worker.get_finished(set())
    finally:
        worker.shutdown()
    assert finished == failed == {"r1"}
    assert "cannot be mapped" in reason and "tensor parallel size 3" in reason, reason
