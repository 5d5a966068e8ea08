"""The vLLM connector's worker halves without vLLM: a prefill `KVPusher` and a decode
`KVReceiver`, each with its own engine and cache, driven step by step as vLLM's worker
would (the step metadata, `save_kv_layer` per layer, `get_finished` polls), with the
reservation and the prefiller's messages travelling over the fabric as in production.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvxfer.integrations.vllm.cache_paths import DirectLanding, DirectWrites, StagedLanding, StagedWrites
from kvxfer.integrations.vllm.kv_checksums import decode_table
from kvxfer.integrations.vllm.kv_pusher import KVPusher
from kvxfer.integrations.vllm.kv_receiver import KVReceiver
from kvxfer.integrations.vllm.kv_region import KVRegion
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.worker_side import WorkerSide
from kvxfer.kv.protocol import decode_abort, decode_reservation_message
from kvxfer.metrics import ConnectorMetrics
from kvxfer.transfer.engine import TransferEngine

#: Rows of staging and blocks of landing cache the staged halves get (small caches).
STAGING_ROWS, LANDING_BLOCKS = 64, 16


def halves_engine(provider: str) -> TransferEngine:
    """An engine as the worker half makes one (claimed immediates), on loopback."""
    return TransferEngine(provider, same_host=False, bind_host="127.0.0.1", imm_admission="claimed")


@contextmanager
def halves_engines(provider: str, count: int) -> Iterator[list[TransferEngine]]:
    """`count` engines as `halves_engine` makes them, closed on exit (a module's fixture)."""
    engines = [halves_engine(provider) for _ in range(count)]
    try:
        yield engines
    finally:
        for engine in engines:
            engine.close()


def prefill_half(engine: TransferEngine, region: KVRegion, settings: ConnectorSettings, staged: bool,
                 staging_rows: int = STAGING_ROWS) -> KVPusher:
    """A pusher over `region`: reading the registered host cache in place, or through staging."""
    if staged:
        writes: DirectWrites | StagedWrites = StagedWrites(engine, region, staging_rows=staging_rows)
    else:
        writes = DirectWrites(engine, engine.register(region.buffer), region.geometry)
    return KVPusher(settings, engine, region, None, ConnectorMetrics("kv_producer"), writes=writes)


def decode_half(engine: TransferEngine, region: KVRegion, settings: ConnectorSettings, staged: bool,
                landing_blocks: int = LANDING_BLOCKS) -> KVReceiver:
    """A receiver over `region`: landing in the registered host cache, or in landing blocks."""
    if staged:
        landing: DirectLanding | StagedLanding = StagedLanding(engine, region, landing_blocks=landing_blocks)
    else:
        landing = DirectLanding(engine.register(region.buffer), region.geometry)
    return KVReceiver(settings, engine, region, None, ConnectorMetrics("kv_consumer"), landing=landing)


def worker_half(role: str, engine: TransferEngine, region: KVRegion, settings: ConnectorSettings) -> WorkerSide:
    """A worker half over `engine` and `region`, as register_kv_caches leaves it (no
    registry): a pusher for "kv_producer", else a receiver, on the host cache in place."""
    side = WorkerSide(settings, role, "test-model")
    side.engine, side.region = engine, region
    if role == "kv_producer":
        side.pusher = prefill_half(engine, region, settings, staged=False)
    else:
        side.receiver = decode_half(engine, region, settings, staged=False)
    return side


def deliver_to_receiver(receiver: KVReceiver, raw: bytes | bytearray | memoryview | None) -> None:
    """Hands a message the decode half's engine received (None: none) to the receiver, as the
    worker half does: the prefiller's checksum table (kv_integrity), or its notice that it
    stopped the push."""
    if raw is None:
        return
    table = decode_table(bytes(raw))
    if table is not None:
        receiver.on_checksum_table(table)
    stopped = decode_abort(bytes(raw))
    if stopped is not None:
        receiver.on_prefill_stopped(*stopped)


def started_load(worker: WorkerSide, load: LoadSpec) -> tuple[str | None, set[str], set[str]]:
    """Binds a step holding `load` on a decode worker half, starts its loads and polls once,
    as vLLM's worker does: (the load's failure reason, the finished and the failed requests)."""
    worker.bind(KvxferStepMetadata(loads=[load]))
    assert worker.receiver is not None
    worker.start_load_kv()
    reason = worker.receiver.failure(load.request_id)  # read before the poll that reports (and forgets) it
    _, finished, failed = worker.get_finished(set())
    return reason, finished, failed


@dataclass
class HandOff:
    """What one hand-off ended in."""

    admitted: bool
    failed: bool
    reason: str


def hand_off(pusher: KVPusher, receiver: KVReceiver, src_blocks: list[int], dst_blocks: list[int], tokens: int,
             transfer_id: str, deadline_s: float = 20.0) -> HandOff:
    """One request's prompt blocks from the prefill half into the decode half: the decoder
    reserves, the prefiller computes every layer (save_kv_layer) and pushes, both poll until
    the decoder reports the load finished or `deadline_s` passes."""
    request = f"decode-{transfer_id}"
    receiver.start(LoadSpec(request, transfer_id, pusher.engine.address, list(dst_blocks), 0))
    reason = receiver.failure(request)
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"prefill-{transfer_id}", transfer_id,
                                                        receiver.engine.address, tokens, list(src_blocks), tokens)]))
    end = time.monotonic() + deadline_s
    reserved = False
    while not reserved and time.monotonic() < end and not reason:
        raw = pusher.engine.recv(0.05)
        reservation = decode_reservation_message(bytes(raw)) if raw is not None else None
        if reservation is not None:
            pusher.on_reservation(reservation)
            reserved = True
    for layer in range(pusher.region.num_layers):
        pusher.save_layer(layer)
    while time.monotonic() < end:
        pusher.poll(set())
        deliver_to_receiver(receiver, receiver.engine.recv(0.0))
        reason = receiver.failure(request) or reason
        finished, failed = receiver.poll(set())
        if request in finished:
            return HandOff(request not in failed, request in failed, reason)
        time.sleep(0.002)
    return HandOff(False, False, f"no outcome within {deadline_s} s ({reason})")
