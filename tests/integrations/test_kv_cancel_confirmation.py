"""A decoder that cancels a load mid-push gets the prefiller's "stopped" word within a
layer of the prefiller's compute, not at the end of its step, and no byte lands in its
blocks after it freed them.

Both worker halves are the connector's `WorkerSide`, each over its own engine (real
libfabric over loopback, each engine with its own progress thread) and a vLLM-laid-out
cache: the prefill half is driven as vLLM's worker drives it through one long step,
`save_kv_layer` per layer with a pause between layers (the cancel is read there, as in
production); the decode half polls `get_finished` as vLLM's worker does between its steps.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import worker_half  # noqa: E402
from support.vllm_kv_caches import attention_spec, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.handoff.push_state import PushState  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.kv.protocol import decode_reservation_message  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
#: Layers of the step: the cancel comes after CANCEL_AFTER_LAYER, many layers are still to compute.
LAYERS, CANCEL_AFTER_LAYER = 8, 1
BLOCKS, PROMPT_BLOCKS = 12, 4
#: How long the decoder polls between two layers of the prefiller (the pause of a long
#: layer); the word is expected at one of the remaining layers, not after the step.
LAYER_PAUSE_S = 1.0
DEADLINE_S = 20.0


def test_a_cancel_mid_push_is_confirmed_before_the_prefill_step_ends_and_nothing_lands_after(
        decoder_engine: TransferEngine, prefill_engine: TransferEngine) -> None:
    settings = ConnectorSettings(provider=PROVIDER)
    tokens = PROMPT_BLOCKS * attention_spec().block_size
    prefill_cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), BLOCKS, seed=11, layers=LAYERS)
    decode_cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), BLOCKS, seed=12, layers=LAYERS)
    prefill = worker_half("kv_producer", prefill_engine, prefill_cache.region, settings)
    decode = worker_half("kv_consumer", decoder_engine, decode_cache.region, settings)
    assert prefill.pusher is not None and decode.receiver is not None
    names = [f"model.layers.{i}.attn" for i in range(LAYERS)]

    # One long prefill step of the whole prompt; the decoder reserved its blocks first.
    prefill.bind(KvxferStepMetadata(pushes=[PushSpec("p-1", "t-1", decoder_engine.address, tokens,
                                                     list(range(PROMPT_BLOCKS)), tokens)]))
    decode.receiver.start(LoadSpec("d-1", "t-1", prefill_engine.address, list(range(4, 4 + PROMPT_BLOCKS)), 0))
    end = time.monotonic() + DEADLINE_S
    (push,) = prefill.pusher._by_request["p-1"]
    while push.state is PushState.WAITING_FOR_RESERVATION and time.monotonic() < end:
        raw = prefill_engine.recv(0.05)
        reservation = decode_reservation_message(bytes(raw)) if raw is not None else None
        if reservation is not None:
            prefill.pusher.on_reservation(reservation)
    assert push.state is PushState.PUSHING, "the reservation did not reach the prefiller"

    for layer in range(CANCEL_AFTER_LAYER + 1):
        prefill.save_kv_layer(names[layer])
    assert push.writes.writes_posted == CANCEL_AFTER_LAYER + 1
    (load,) = decode.receiver._loads["d-1"]
    assert load.reservation is not None
    while decoder_engine.imm_count(load.reservation.imm) < (CANCEL_AFTER_LAYER + 1) * PROMPT_BLOCKS \
            and time.monotonic() < end:
        time.sleep(0.005)
    # vLLM aborts the request on the decoder mid-load: it fences the load and sends a cancel,
    # which reaches the prefiller while it computes the next layer.
    decode.get_finished({"d-1"})
    assert "aborted" in decode.receiver.failure("d-1")
    while load.cancel_sent is not None and time.monotonic() < end:
        decode.get_finished(set())
        time.sleep(0.005)
    assert load.cancel_sent is None, "the cancel was not delivered"

    freed_at_layer: int | None = None
    freed_bytes = None
    posted_when_freed = -1
    for layer in range(CANCEL_AFTER_LAYER + 1, LAYERS):
        prefill.save_kv_layer(names[layer])
        pause_end = time.monotonic() + LAYER_PAUSE_S
        while freed_at_layer is None and time.monotonic() < pause_end:
            recving, _ = decode.get_finished(set())[1:]
            if "d-1" in recving:
                freed_at_layer = layer
                # What the decoder now reuses; and the prefiller's word meant nothing can land.
                freed_bytes = decode_cache.host_bytes().copy()
                posted_when_freed = push.writes.writes_posted
                assert all(write.done() for write in push.writes.posted)
            time.sleep(0.005)
    prefill.get_finished({"p-1"})  # the prefill step ends here
    assert freed_at_layer is not None, "the decoder was told only once the prefill step ended"
    assert freed_at_layer < LAYERS - 1
    assert decode.receiver.pending == 0

    # The rest of the step posted nothing for the stopped push, and nothing landed later.
    while "p-1" in prefill.pusher._by_request and time.monotonic() < end:
        prefill.get_finished(set())
        time.sleep(0.01)
    assert "p-1" not in prefill.pusher._by_request, "the stopped push was never reported finished"
    assert push.writes.writes_posted == posted_when_freed == CANCEL_AFTER_LAYER + 1
    assert push.state is PushState.DONE
    assert (decode_cache.host_bytes() == freed_bytes).all()
