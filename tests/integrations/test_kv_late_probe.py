"""A probe that times out is not proof that the prefiller is gone: a decoder never severs a
live prefiller for it, and a load of that prefiller still receiving completes byte-exact.

Under CPU overload a live prefiller's probe was once not delivered within
prefiller_probe_timeout_s; declaring it gone then severed its connections and cut the other
load it was serving. Here the delay is injected from outside: the decoder engine's `send`
holds probes back (support/late_probes.py: a probe never delivered), and its `sever_peer`
is watched. Both worker halves are the connector's (KVPusher, KVReceiver), each over its
own real engine on loopback, each with a vLLM-laid-out cache; the prefiller pushes one load
layer by layer across the probe's timeout and holds the other load's reservation without
pushing (a long prefill).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import decode_half, deliver_to_receiver, prefill_half  # noqa: E402
from support.late_probes import hold_back_probes, watch_severs  # noqa: E402
from support.vllm_kv_caches import attention_spec, same_bytes, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.handoff.reservation_state import ReservationState as Res  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.kv.protocol import decode_reservation_message  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
LAYERS, BLOCKS, PROMPT_BLOCKS = 8, 12, 3
#: Probes soon and judged soon, so that the pushed load's layers span a probe's timeout.
PROBE_AFTER_S, PROBE_TIMEOUT_S = 0.2, 0.5
#: The prefiller's compute of one layer: LAYERS of it outlast PROBE_TIMEOUT_S twice over.
LAYER_PAUSE_S = 0.15
DEADLINE_S = 20.0


def test_a_live_prefillers_late_probe_severs_nothing_and_its_receiving_load_completes_byte_exact(
        decoder_engine: TransferEngine, prefill_engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    probes_held = hold_back_probes(decoder_engine, monkeypatch)
    severed = watch_severs(decoder_engine, monkeypatch)
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBE_AFTER_S,
                                 prefiller_probe_timeout_s=PROBE_TIMEOUT_S)
    tokens = PROMPT_BLOCKS * attention_spec().block_size
    prefill_cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), BLOCKS, seed=21, layers=LAYERS)
    decode_cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), BLOCKS, seed=22, layers=LAYERS)
    pusher = prefill_half(prefill_engine, prefill_cache.region, settings, staged=False)
    receiver = decode_half(decoder_engine, decode_cache.region, settings, staged=False)
    src, dst = list(range(PROMPT_BLOCKS)), list(range(4, 4 + PROMPT_BLOCKS))

    # Two loads from one prefiller: "pushed" is computed and pushed, "held" waits (its prefill is long).
    receiver.start(LoadSpec("d-held", "t-held", prefill_engine.address, list(range(8, 8 + PROMPT_BLOCKS)), 0))
    receiver.start(LoadSpec("d-pushed", "t-pushed", prefill_engine.address, dst, 0))
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec("p-pushed", "t-pushed", decoder_engine.address, tokens,
                                                       src, tokens)]))
    end = time.monotonic() + DEADLINE_S
    reserved = False
    while not (reserved and probes_held) and time.monotonic() < end:
        raw = prefill_engine.recv(0.01)
        reservation = decode_reservation_message(bytes(raw)) if raw is not None else None
        if reservation is not None and reservation.request_id == "t-pushed":
            pusher.on_reservation(reservation)
            reserved = True
        receiver.poll(set())
    assert reserved and probes_held, "no reservation reached the prefiller, or no probe was sent"

    # The prefiller computes and pushes a layer at a time; the probe's timeout passes meanwhile.
    finished: set[str] = set()
    failed: set[str] = set()

    def poll_both() -> None:
        """One round of both halves' polls, as vLLM's steps would make them."""
        pusher.poll(set())
        deliver_to_receiver(receiver, decoder_engine.recv(0.0))
        done, bad = receiver.poll(set())
        finished.update(done)
        failed.update(bad)
        time.sleep(0.002)

    for layer in range(LAYERS):
        pusher.save_layer(layer)
        pause_end = time.monotonic() + LAYER_PAUSE_S
        while time.monotonic() < pause_end:
            poll_both()
    assert time.monotonic() - probes_held[0] > 2 * PROBE_TIMEOUT_S  # the probe was late while the load received
    while "d-pushed" not in finished and time.monotonic() < end:
        poll_both()
    assert "d-pushed" in finished and "d-pushed" not in failed, receiver.failure("d-pushed")
    assert severed == [], "a live prefiller's connections were severed for a late probe"
    for layer in range(LAYERS):
        for s, d in zip(src, dst):
            assert same_bytes(decode_cache.views[layer][d], prefill_cache.views[layer][s]), (layer, s, d)

    # The load that stays silent past a late probe fails with the regular fence (the
    # prefiller may be alive): fenced, not severed, not freed early.
    (held,) = receiver._loads["d-held"]
    while held.state is not Res.FENCED and time.monotonic() < end:
        receiver.poll(set())
        time.sleep(0.005)
    assert held.state is Res.FENCED
    assert "prefiller_probe_timeout_s" in held.reason and "fence_timeout_s" in held.reason, held.reason
    assert held.entry is not None and not held.entry.writer_gone and not held.writer_severed
    assert severed == []
