"""A decoder's cancel of one load does not break another load's writes from the same
prefiller, and a cancelled load's blocks are freed only once none of its writes can land.

libfabric's net provider refuses an op whose header names a revoked registration by
dropping the whole connection: every write queued behind it to that peer, another load's
too, then fails ("Transport endpoint is not connected"). So the decoder keeps a cancelled
load's registration open until its prefiller confirms that none of its writes is in
flight (then revokes and frees), or `cancel_confirm_timeout_s` passes (then revokes, and
frees at `fence_timeout_s`, as before).

Both worker halves are the connector's `WorkerSide`, each over its own engine (real
libfabric over loopback, each engine with its own progress thread) and a vLLM-laid-out
cache, driven as vLLM's workers drive them (`save_kv_layer` per layer, `get_finished`
polls), as in test_kv_cancel_confirmation.py. The loads are large (LAYERS x 1 MiB each)
so that writes of both are still queued on the one connection when the cancel comes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import worker_half  # noqa: E402
from support.vllm_kv_caches import Cache, same_bytes, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.errors import TransferError  # noqa: E402
from kvxfer.handoff.decode_ledger import DeadlineSetting  # noqa: E402
from kvxfer.handoff.push_state import PushState  # noqa: E402
from kvxfer.handoff.reservation_state import ReservationState as Res  # noqa: E402
from kvxfer.integrations.vllm.kv_receiver import DecodeLoad  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorConfigError, ConnectorSettings  # noqa: E402
from kvxfer.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvxfer.kv.protocol import decode_reservation_message  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
#: 64 KiB per (layer, block): a load's layer (BLOCKS_PER_LOAD blocks) is one 1 MiB op.
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
LAYERS, BLOCKS_PER_LOAD = 24, 16
#: Layers posted for both loads before the decoder cancels A: many MiB still queued then.
LAYERS_BEFORE_CANCEL = 16
TOKENS = BLOCKS_PER_LOAD * SPEC.block_size
DEADLINE_S = 30.0
NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]


def _reserved(prefill: WorkerSide, engine: TransferEngine, loads: int, end: float) -> None:
    """Hands the decoder's `loads` reservations to the prefill half (as its worker does)."""
    assert prefill.pusher is not None
    taken = 0
    while taken < loads and time.monotonic() < end:
        raw = engine.recv(0.05)
        reservation = decode_reservation_message(bytes(raw)) if raw is not None else None
        if reservation is not None:
            prefill.pusher.on_reservation(reservation)
            taken += 1
    assert taken == loads, "the reservations did not reach the prefiller"


def _blocks_bytes(cache: Cache, blocks: list[int]) -> np.ndarray:
    """A copy of every layer's bytes of `blocks` (LBHNC: one run per (layer, block))."""
    return np.concatenate([cache.views[layer][b].contiguous().view(torch.uint8).numpy().ravel()
                           for layer in range(LAYERS) for b in blocks])


def _blocks_equal(dst: Cache, dst_blocks: list[int], src: Cache, src_blocks: list[int]) -> bool:
    return all(same_bytes(dst.views[layer][d], src.views[layer][s])
               for layer in range(LAYERS) for d, s in zip(dst_blocks, src_blocks))


def test_a_cancel_keeps_another_loads_writes_on_the_same_connection_and_frees_after_the_confirmation(
        decoder_engine: TransferEngine, prefill_engine: TransferEngine) -> None:
    settings = ConnectorSettings(provider=PROVIDER)
    blocks = 2 * BLOCKS_PER_LOAD
    prefill_cache = vllm_cache(KVCacheLayout.LBHNC, SPEC, blocks, seed=21, layers=LAYERS)
    decode_cache = vllm_cache(KVCacheLayout.LBHNC, SPEC, blocks, seed=22, layers=LAYERS)
    prefill = worker_half("kv_producer", prefill_engine, prefill_cache.region, settings)
    decode = worker_half("kv_consumer", decoder_engine, decode_cache.region, settings)
    assert prefill.pusher is not None and decode.receiver is not None
    src = {"a": list(range(BLOCKS_PER_LOAD)), "b": list(range(BLOCKS_PER_LOAD, blocks))}
    dst = {"a": list(range(BLOCKS_PER_LOAD, blocks)), "b": list(range(BLOCKS_PER_LOAD))}

    # One prefill step computing both prompts; the decoder reserved both loads first.
    prefill.bind(KvxferStepMetadata(pushes=[PushSpec(f"p-{r}", f"t-{r}", decoder_engine.address, TOKENS,
                                                     src[r], TOKENS) for r in ("a", "b")]))
    for r in ("a", "b"):
        decode.receiver.start(LoadSpec(f"d-{r}", f"t-{r}", prefill_engine.address, dst[r], 0))
    end = time.monotonic() + DEADLINE_S
    _reserved(prefill, prefill_engine, 2, end)
    (push_a,), (push_b,) = prefill.pusher._by_request["p-a"], prefill.pusher._by_request["p-b"]
    assert push_a.state is PushState.PUSHING and push_b.state is PushState.PUSHING

    for layer in range(LAYERS_BEFORE_CANCEL):
        prefill.save_kv_layer(NAMES[layer])
    # vLLM aborts request A on the decoder while writes of both loads are queued on the
    # one connection: A is fenced and the cancel sent, its registration still open.
    queued_a = sum(not write.done() for write in push_a.writes.posted)
    queued_b = sum(not write.done() for write in push_b.writes.posted)
    decode.get_finished({"d-a"})
    (load_a,) = decode.receiver._loads["d-a"]
    assert load_a.state is Res.FENCED and "aborted" in load_a.reason
    while load_a.cancel_sent is not None and time.monotonic() < end:  # the prefiller reads it at its next layer
        decode.get_finished(set())
        time.sleep(0.005)
    assert load_a.cancel_sent is None, "the cancel was not delivered"

    freed_a: np.ndarray | None = None
    b_done = False
    for layer in range(LAYERS_BEFORE_CANCEL, LAYERS):  # the rest of the step: B only
        prefill.save_kv_layer(NAMES[layer])
    prefill.get_finished({"p-a", "p-b"})  # the step ends; vLLM finished both on the prefill side
    while (freed_a is None or not b_done) and time.monotonic() < end:
        _, recving, failed = decode.get_finished(set())
        assert "d-b" not in failed, f"load B failed; its push's first failed write: {push_b.writes.first_error}"
        if "d-a" in recving:
            assert "d-a" not in failed  # vLLM's own abort: nothing to report failed
            # Freed on the prefiller's word: none of A's writes may be in flight any more.
            assert all(write.done() for write in push_a.writes.posted)
            freed_a = _blocks_bytes(decode_cache, dst["a"])  # B's blocks may still be landing
        b_done = b_done or "d-b" in recving
        prefill.get_finished(set())
        time.sleep(0.005)
    assert b_done, "load B was never admitted"
    assert freed_a is not None, "load A was never freed"
    assert push_b.state is PushState.DONE and push_b.writes.first_error is None, push_b.writes.first_error
    assert _blocks_equal(decode_cache, dst["b"], prefill_cache, src["b"]), "load B's blocks differ"
    # A stopped at the cancel; nothing of it landed after the decoder freed its blocks.
    assert push_a.writes.writes_posted < LAYERS
    while "p-a" in prefill.pusher._by_request and time.monotonic() < end:
        prefill.get_finished(set())
        time.sleep(0.01)
    assert (_blocks_bytes(decode_cache, dst["a"]) == freed_a).all()
    print(f"writes queued at the cancel: A {queued_a}, B {queued_b} (1 MiB each)")


def test_a_cancel_never_confirmed_is_revoked_at_its_bound_and_freed_after_the_fence(
        decoder_engine: TransferEngine, prefill_engine: TransferEngine) -> None:
    settings = ConnectorSettings(provider=PROVIDER, transfer_timeout_s=1.5, fence_timeout_s=3.0,
                                 cancel_confirm_timeout_s=1.0, dead_prefiller_fence_s=1.0)
    prefill_cache = vllm_cache(KVCacheLayout.LBHNC, SPEC, BLOCKS_PER_LOAD, seed=31, layers=LAYERS)
    decode_cache = vllm_cache(KVCacheLayout.LBHNC, SPEC, BLOCKS_PER_LOAD, seed=32, layers=LAYERS)
    prefill = worker_half("kv_producer", prefill_engine, prefill_cache.region, settings)
    decode = worker_half("kv_consumer", decoder_engine, decode_cache.region, settings)
    assert prefill.pusher is not None and decode.receiver is not None
    blocks = list(range(BLOCKS_PER_LOAD))
    prefill.bind(KvxferStepMetadata(pushes=[PushSpec("p-c", "t-c", decoder_engine.address, TOKENS, blocks,
                                                     TOKENS)]))
    decode.receiver.start(LoadSpec("d-c", "t-c", prefill_engine.address, blocks, 0))
    end = time.monotonic() + DEADLINE_S
    _reserved(prefill, prefill_engine, 1, end)
    (push,) = prefill.pusher._by_request["p-c"]
    prefill.save_kv_layer(NAMES[0])
    push.writes.posted[0].wait(DEADLINE_S)
    # The prefill half is never driven again (a frozen worker): the cancel is never read.
    decode.get_finished({"d-c"})
    (load,) = decode.receiver._loads["d-c"]
    entry = load.entry
    assert entry is not None and load.state is Res.FENCED
    assert entry.deadline_setting is DeadlineSetting.CANCEL_CONFIRM and load.scope is not None
    fenced_at = entry.history[-1][1]

    revoked_at: float | None = None
    freed_at: float | None = None
    while freed_at is None and time.monotonic() < end:
        _, recving, failed = decode.get_finished(set())
        now = time.monotonic()
        if revoked_at is None and load.scope is None:
            revoked_at = now
            assert entry.deadline_setting is DeadlineSetting.FENCE  # the rest of the fence, as before
            assert "d-c" not in recving  # revoked, not freed
            _assert_revoked(prefill_engine, load)
        if "d-c" in recving:
            freed_at = now
        time.sleep(0.01)
    assert revoked_at is not None and freed_at is not None, "the load was not revoked and freed"
    # Bounds, not speeds: not revoked before cancel_confirm_timeout_s, not freed before the fence.
    assert revoked_at - fenced_at >= settings.cancel_confirm_timeout_s
    assert freed_at - fenced_at >= settings.fence_timeout_s


def _assert_revoked(engine: TransferEngine, load: DecodeLoad) -> None:
    """A write with the load's descriptor now fails at the writer (from a throwaway engine:
    the refusal drops the connection it came on)."""
    assert load.reservation is not None
    with TransferEngine(PROVIDER, same_host=False, bind_host="127.0.0.1", transfer_timeout_s=5.0) as outsider:
        source = outsider.register(np.zeros(1 << 16, dtype=np.uint8))
        with pytest.raises(TransferError):
            outsider.write(source, 0, load.reservation.descriptor, 0, 1 << 16).wait(10)


def test_the_confirm_bound_leaves_the_dead_prefiller_grace_inside_the_fence() -> None:
    # The default (10 s) is cut where the fence is short; a value set above it is refused.
    short = ConnectorSettings.from_extra_config({"transfer_timeout_s": 2.0, "fence_timeout_s": 3.0})
    assert short.cancel_confirm_bound_s == 3.0 - short.dead_prefiller_fence_s
    assert ConnectorSettings().cancel_confirm_bound_s == 10.0
    with pytest.raises(ConnectorConfigError, match="cancel_confirm_timeout_s"):
        ConnectorSettings.from_extra_config({"transfer_timeout_s": 2.0, "fence_timeout_s": 3.0,
                                             "cancel_confirm_timeout_s": 2.5})
