"""Worker halves per tensor parallel rank, without vLLM: a prefill `KVPusher` or a decode
`KVReceiver` per rank over its own engine and cache, and one request handed from every
prefill rank into every decode rank through sliced reservations, as the connector's worker
halves run under vLLM. Shared by the head-slice modules (direct and staged paths)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from support.connector_halves import deliver_to_receiver
from support.vllm_kv_caches import TOKENS, Cache, same_bytes

from kvxfer.integrations.vllm.cache_paths import DirectLanding, DirectWrites, StagedLanding, StagedWrites
from kvxfer.integrations.vllm.kv_pusher import KVPusher
from kvxfer.integrations.vllm.kv_receiver import KVReceiver
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.sliced_reservation import SliceTarget, decode_sliced_reservation
from kvxfer.integrations.vllm.tensor_parallel import TensorParallelPlace, encode_rank_addresses, head_sources
from kvxfer.kv.protocol import decode_cancel
from kvxfer.metrics import ConnectorMetrics
from kvxfer.transfer.engine import TransferEngine


@dataclass
class Rank:
    """One rank's engine and cache; its pusher or receiver once a hand-off made it."""

    engine: TransferEngine
    cache: Cache
    place: TensorParallelPlace
    pusher: KVPusher | None = None
    receiver: KVReceiver | None = None


@dataclass(frozen=True)
class StagedPath:
    """The staged (device cache) path's sizes: staging rows per pusher, landing blocks per receiver."""

    staging_rows: int
    landing_blocks: int


def _make_pusher(p: Rank, settings: ConnectorSettings, staged: StagedPath | None) -> KVPusher:
    region = p.cache.region
    if staged is not None:
        writes: DirectWrites | StagedWrites = StagedWrites(p.engine, region, staging_rows=staged.staging_rows)
    else:
        writes = DirectWrites(p.engine, p.engine.register(region.buffer), region.geometry)
    return KVPusher(settings, p.engine, region, None, ConnectorMetrics("kv_producer"), writes=writes, place=p.place)


def _make_receiver(d: Rank, settings: ConnectorSettings, staged: StagedPath | None) -> KVReceiver:
    region = d.cache.region
    if staged is not None:
        landing: DirectLanding | StagedLanding = StagedLanding(d.engine, region, landing_blocks=staged.landing_blocks)
    else:
        landing = DirectLanding(d.engine.register(region.buffer), region.geometry)
    return KVReceiver(settings, d.engine, region, None, ConnectorMetrics("kv_consumer"), landing=landing)


def sliced_hand_off(prefill: list[Rank], decode: list[Rank], tid: str, src: list[int], dst: list[int],
                    provider: str, deadline_s: float, staged: StagedPath | None = None,
                    groups: tuple[list[list[int]], list[list[int]]] | None = None) -> dict[int, str]:
    """One request of the blocks `src` from every prefill rank into the blocks `dst` of every
    decode rank (with `groups`: every KV cache group's blocks, prefill side then decode side,
    in place of `src`/`dst`), through the direct path or, with `staged`, the staged one;
    each decode rank's outcome ("" admitted, else why it failed), within `deadline_s`."""
    src_groups, dst_groups = groups if groups is not None else (None, None)
    if dst_groups is not None and src_groups is not None:
        dst = [b for g in dst_groups for b in g if b >= 0]
        src = src_groups[0]
    settings = ConnectorSettings(provider=provider)
    kv_heads = prefill[0].place.total_kv_heads
    for p in prefill:
        p.pusher = _make_pusher(p, settings, staged)
    prefill_addresses = [p.engine.address for p in prefill]
    for d in decode:
        d.receiver = _make_receiver(d, settings, staged)
        sources = head_sources(kv_heads, len(prefill), len(decode), d.place.rank)
        heads = d.cache.region.geometry.num_heads
        parts = [(prefill_addresses[s.src_rank], SliceTarget(d.place.rank, len(decode), s, heads)) for s in sources]
        d.receiver.start(LoadSpec(f"d-{tid}", tid, encode_rank_addresses(prefill_addresses), list(dst), 0,
                                  group_block_ids=dst_groups), parts)
    decode_engines = encode_rank_addresses([d.engine.address for d in decode])
    tokens = len(src) * TOKENS
    for p in prefill:
        assert p.pusher is not None
        p.pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"p-{tid}", tid, decode_engines, tokens, list(src),
                                                             tokens, group_block_ids=src_groups)]))
        for layer in range(p.cache.region.num_layers):
            p.pusher.save_layer(layer)
    outcome: dict[int, str] = {}
    end = time.monotonic() + deadline_s
    while len(outcome) < len(decode) and time.monotonic() < end:
        for p in prefill:
            _poll_prefill_rank(p)
        for d in decode:
            reason = _poll_decode_rank(d, f"d-{tid}")
            if reason is not None:
                outcome[d.place.rank] = reason
        time.sleep(0.001)
    assert len(outcome) == len(decode), f"decode ranks got no outcome within {deadline_s} s: {outcome}"
    return outcome


def _poll_prefill_rank(p: Rank) -> None:
    assert p.pusher is not None
    raw = p.engine.recv(0.0)
    sliced = decode_sliced_reservation(bytes(raw), p.place.rank) if raw is not None else None
    if sliced is not None:
        p.pusher.on_reservation(sliced[1], sliced[0])
    cancel = decode_cancel(bytes(raw)) if raw is not None and sliced is None else None
    if cancel is not None:
        p.pusher.on_cancel(*cancel)
    p.pusher.poll(set())


def _poll_decode_rank(d: Rank, request: str) -> str | None:
    """None while the load is open; "" once admitted, else why it failed."""
    assert d.receiver is not None
    deliver_to_receiver(d.receiver, d.engine.recv(0.0))
    reason = d.receiver.failure(request)  # read before the poll that reports (and forgets) it
    finished, failed = d.receiver.poll(set())
    if request not in finished:
        return None
    return (d.receiver.failure(request) or reason or "failed") if failed else ""


def assert_heads_landed(prefill: list[Rank], decode: list[Rank], before: list[np.ndarray], src: list[int],
                        dst: list[int]) -> None:
    """Every decode rank's heads in the blocks `dst` are the prefill heads of the same global
    index in the blocks `src` (MLA: the one latent slot every rank holds), byte for byte
    (vLLM's views), and nothing else of its cache changed since `before`."""
    for d, untouched in zip(decode, before):
        d0, d1 = d.place.heads
        moved = np.zeros(untouched.size, dtype=bool)
        for layer in range(d.cache.region.num_layers):
            for s, block in zip(src, dst):
                for head in range(d0, d1):
                    p = next(p for p in prefill if p.place.heads[0] <= head < p.place.heads[1])
                    local = 0 if d.cache.region.geometry.latent else head - d0
                    remote = 0 if p.cache.region.geometry.latent else head - p.place.heads[0]
                    assert same_bytes(d.cache.views[layer][block, local], p.cache.views[layer][s, remote]), \
                        (layer, block, head)
                for offset, length in d.cache.cells(layer, block):
                    moved[offset:offset + length] = True
        assert (d.cache.host_bytes()[~moved] == untouched[~moved]).all()
