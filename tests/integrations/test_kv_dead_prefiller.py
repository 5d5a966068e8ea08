"""A decode worker half whose prefiller process dies frees the load's blocks in seconds, not
at load_stall_timeout_s plus fence_timeout_s, where the death is proven; one whose prefiller
is only frozen keeps the full fence. The prefiller is a real process holding a real engine
(it takes the reservation and pushes nothing), SIGKILLed or SIGSTOPped once the reservation
reached it; the decoder is the connector's `KVReceiver` over a vLLM-laid-out cache, polled
as vLLM's worker would. Without a liveness port the probes judge: a late probe proves
nothing by itself, so a killed prefiller is freed at once only with the same-host proof
(every thread of its process exiting), and otherwise keeps the regular fence."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import decode_half  # noqa: E402
from support.silent_prefiller import SilentPrefiller  # noqa: E402
from support.vllm_kv_caches import attention_spec, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.handoff.reservation_state import ReservationState as Res  # noqa: E402
from kvxfer.integrations.vllm.kv_receiver import KVReceiver  # noqa: E402
from kvxfer.integrations.vllm.metadata import LoadSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
#: Without the probes a dead prefiller's load waits load_stall_timeout_s (30 s) plus
#: fence_timeout_s (15 s); with the same-host proof prefiller_probe_after_s +
#: prefiller_probe_timeout_s (2.5 s), then it is freed at once.
FREED_WITHIN_S = 5.0
#: How long the frozen prefiller's load is watched: longer than the dead one's whole path.
FROZEN_WATCH_S = 4.0
STARTUP_DEADLINE_S = 30.0
#: Settings that end the unproven path soon: a late probe, then the regular fence (short here).
SHORT_FENCE = dict(prefiller_probe_after_s=0.2, prefiller_probe_timeout_s=0.5, transfer_timeout_s=0.5,
                   fence_timeout_s=1.5)

@pytest.fixture
def prefiller() -> Iterator[SilentPrefiller]:
    pf = SilentPrefiller(PROVIDER, wait_s=STARTUP_DEADLINE_S)
    try:
        yield pf
    finally:
        pf.stop()


@pytest.fixture
def same_host_prefiller() -> Iterator[SilentPrefiller]:
    pf = SilentPrefiller(PROVIDER, wait_s=STARTUP_DEADLINE_S, same_host=True)
    try:
        yield pf
    finally:
        pf.stop()


def _reserve(engine: TransferEngine, address: bytes, settings: ConnectorSettings, tid: str) -> KVReceiver:
    """A receiver with one load reserved at `address`, once the reservation was delivered."""
    cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), 8, seed=7)
    receiver = decode_half(engine, cache.region, settings, staged=False)
    receiver.start(LoadSpec(f"d-{tid}", tid, address, [1, 2, 3], 0))
    end = time.monotonic() + STARTUP_DEADLINE_S
    load = receiver._loads[f"d-{tid}"][0]
    while load.sent is not None and time.monotonic() < end:
        receiver.poll(set())
        time.sleep(0.01)
    assert load.sent is None and not receiver.failure(f"d-{tid}"), "the reservation was not delivered"
    return receiver


def _poll_until_finished(receiver: KVReceiver, request: str, within_s: float) -> tuple[set[str], float]:
    """Polls as vLLM's worker does until `request` is reported or `within_s` passes:
    (the failed set it was reported with, empty if it was not; seconds taken)."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        finished, failed = receiver.poll(set())
        if request in finished:
            return failed | {"finished"}, time.monotonic() - start
        time.sleep(0.01)
    return set(), time.monotonic() - start


def test_a_killed_same_host_prefillers_late_probe_proves_it_gone_and_frees_its_blocks_at_once(
        same_host_decoder: TransferEngine, same_host_prefiller: SilentPrefiller,
        caplog: pytest.LogCaptureFixture) -> None:
    proc, address = same_host_prefiller.proc, same_host_prefiller.address
    receiver = _reserve(same_host_decoder, address, ConnectorSettings(provider=PROVIDER), "killed")
    caplog.set_level(logging.INFO, logger="kvxfer")
    proc.kill()
    proc.wait(timeout=STARTUP_DEADLINE_S)
    reported, took = _poll_until_finished(receiver, "d-killed", FREED_WITHIN_S)
    assert reported == {"finished", "d-killed"}, f"not reported failed within {FREED_WITHIN_S} s"
    assert receiver.pending == 0  # reported, so vLLM frees its blocks
    freed = [r.getMessage() for r in caplog.records if "(request d-killed)" in r.getMessage()]
    assert freed and "prefiller_probe_timeout_s" in freed[-1] and "no byte of it can land" in freed[-1], freed


def test_a_killed_prefiller_without_proof_fails_at_the_late_probe_and_keeps_the_regular_fence(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    proc, address = prefiller.proc, prefiller.address
    severed: list[bytes] = []
    monkeypatch.setattr(decoder_engine, "sever_peer", lambda peer: severed.append(peer) or False)
    settings = ConnectorSettings(provider=PROVIDER, **SHORT_FENCE)
    receiver = _reserve(decoder_engine, address, settings, "unproven")
    proc.kill()
    proc.wait(timeout=STARTUP_DEADLINE_S)
    (load,) = receiver._loads["d-unproven"]
    end = time.monotonic() + FREED_WITHIN_S
    while load.state is not Res.FENCED and time.monotonic() < end:
        receiver.poll(set())
        time.sleep(0.01)
    assert load.state is Res.FENCED and "prefiller_probe_timeout_s" in load.reason, load.reason
    assert load.entry is not None and not load.entry.writer_gone  # the regular fence, not dead_prefiller_fence_s
    caplog.set_level(logging.INFO, logger="kvxfer")
    reported, _ = _poll_until_finished(receiver, "d-unproven", FREED_WITHIN_S)
    assert reported == {"finished", "d-unproven"}, f"not freed at fence_timeout_s within {FREED_WITHIN_S} s"
    freed = [r.getMessage() for r in caplog.records if "(request d-unproven)" in r.getMessage()]
    assert freed and "fence_timeout_s=1.5 passed" in freed[-1], freed
    assert severed == []


def test_a_load_reserved_at_an_already_killed_prefiller_fails_at_the_late_probe(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller) -> None:
    proc, address = prefiller.proc, prefiller.address
    decoder_engine.send(address, b"hello").wait(STARTUP_DEADLINE_S)  # connected, as after an earlier hand-off
    proc.kill()
    proc.wait(timeout=STARTUP_DEADLINE_S)
    cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), 8, seed=7)
    settings = ConnectorSettings(provider=PROVIDER, **SHORT_FENCE)
    receiver = decode_half(decoder_engine, cache.region, settings, staged=False)
    receiver.start(LoadSpec("d-dead", "dead", address, [1, 2, 3], 0))
    reported, _ = _poll_until_finished(receiver, "d-dead", FREED_WITHIN_S)
    assert reported == {"finished", "d-dead"}, f"not reported failed within {FREED_WITHIN_S} s"


def test_a_frozen_prefillers_load_keeps_the_full_fence(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller) -> None:
    proc, address = prefiller.proc, prefiller.address
    # A short stall timeout sends the load to FENCING soon; the fence (15 s) must then hold.
    settings = ConnectorSettings(provider=PROVIDER, load_stall_timeout_s=1.0)
    receiver = _reserve(decoder_engine, address, settings, "frozen")
    proc.send_signal(signal.SIGSTOP)
    reported, _ = _poll_until_finished(receiver, "d-frozen", FROZEN_WATCH_S)
    assert not reported, "a frozen (live) prefiller's load was freed before fence_timeout_s"
    assert "load_stall_timeout_s" in receiver.failure("d-frozen")  # fencing, not waiting
    assert receiver.pending == 1
