"""A decode worker half frees a dead prefiller's loads at once where it severed the
prefiller's connections after revoking their registrations (TransferEngine.sever_peer), and
keeps `dead_prefiller_fence_s` where the sever proves nothing. The prefiller is a real
process holding a real engine and a liveness listener (killed, so the liveness connection
tells the decoder); the decoder is the connector's `KVReceiver` over a vLLM-laid-out cache,
polled as vLLM's worker would. What a sever stops on the wire is measured in
test_kv_revoked_write_in_progress.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import decode_half  # noqa: E402
from support.silent_prefiller import SilentPrefiller  # noqa: E402
from support.vllm_kv_caches import attention_spec, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.handoff.decode_ledger import DeadlineSetting  # noqa: E402
from kvxfer.handoff.reservation_state import ReservationState as Res  # noqa: E402
from kvxfer.integrations.vllm.kv_receiver import KVReceiver  # noqa: E402
from kvxfer.integrations.vllm.metadata import LoadSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
#: Probes so late that within a test only the liveness connection can free a load.
PROBES_OUT_OF_REACH_S = 60.0
#: A fence far beyond REPORTED_WITHIN_S: a load reported within it was not freed by the timer.
FENCE_OUT_OF_REACH_S = 60.0
#: A fence the second test does not see end: shorter than fence_timeout_s (writer_gone
#: only shortens a fence), far beyond the few polls that test makes after the death.
UNPROVEN_FENCE_S = 5.0
#: Bounds of the waits below (generous: the machine is shared); none is a speed assertion.
REPORTED_WITHIN_S = 10.0
STARTUP_DEADLINE_S = 30.0
MAX_HELD = 4


@pytest.fixture
def prefiller() -> Iterator[SilentPrefiller]:
    pf = SilentPrefiller(PROVIDER, liveness_max_held=MAX_HELD, wait_s=STARTUP_DEADLINE_S)
    try:
        yield pf
    finally:
        pf.stop()


def _reserved(engine: TransferEngine, prefiller: SilentPrefiller, settings: ConnectorSettings,
              tid: str) -> KVReceiver:
    """A receiver with one load reserved at the prefiller, once the reservation (the first
    message between the two: our connection) was delivered and the liveness watch is held."""
    cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), 8, seed=11)
    receiver = decode_half(engine, cache.region, settings, staged=False)
    receiver.start(LoadSpec(f"d-{tid}", tid, prefiller.address, [1, 2, 3], 0, prefill_liveness=prefiller.liveness))
    load = receiver._loads[f"d-{tid}"][0]
    end = time.monotonic() + STARTUP_DEADLINE_S
    while (load.sent is not None or receiver._liveness.phase(prefiller.liveness) != "held") \
            and time.monotonic() < end:
        receiver.poll(set())
        time.sleep(0.005)
    assert load.sent is None and receiver._liveness.phase(prefiller.liveness) == "held"
    return receiver


def _freed_because(receiver: KVReceiver, caplog: pytest.LogCaptureFixture, request: str) -> str:
    """Polls as vLLM's worker does until `request` is reported (at most REPORTED_WITHIN_S)
    and returns the log line that freed it ("" if it was not reported)."""
    end = time.monotonic() + REPORTED_WITHIN_S
    while time.monotonic() < end:
        finished, _ = receiver.poll(set())
        if request in finished:
            freed = [r.getMessage() for r in caplog.records
                     if f"(request {request})" in r.getMessage() and "prefiller process is gone" in r.getMessage()]
            return freed[-1] if freed else "reported, no log line"
        time.sleep(0.002)
    return ""


def test_a_killed_prefillers_load_is_freed_without_the_fence_once_no_connection_of_it_is_left(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture) -> None:
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 dead_prefiller_fence_s=FENCE_OUT_OF_REACH_S)
    receiver = _reserved(decoder_engine, prefiller, settings, "severed")
    caplog.set_level(logging.INFO, logger="kvxfer")
    prefiller.signal_group(9)
    prefiller.proc.wait(timeout=STARTUP_DEADLINE_S)
    why = _freed_because(receiver, caplog, "d-severed")
    assert "no connection of it is left open after the revoke" in why, why or "not freed: the fence timer was kept"
    assert receiver.pending == 0


def test_a_prefiller_whose_sever_proves_nothing_keeps_the_fence(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The sever proves nothing (a connection the prefiller opened, a reset one with unread
    # bytes, a same-host peer: test_kv_revoked_write_in_progress.py and the C++ tests): the
    # load is fenced for dead_prefiller_fence_s, not freed.
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 dead_prefiller_fence_s=UNPROVEN_FENCE_S)
    receiver = _reserved(decoder_engine, prefiller, settings, "unproven")
    monkeypatch.setattr(decoder_engine, "sever_peer", lambda address: False)
    caplog.set_level(logging.INFO, logger="kvxfer")
    prefiller.signal_group(9)
    prefiller.proc.wait(timeout=STARTUP_DEADLINE_S)
    load = receiver._loads["d-unproven"][0]
    end = time.monotonic() + REPORTED_WITHIN_S
    while not (load.entry is not None and load.entry.writer_gone) and time.monotonic() < end:
        finished, _ = receiver.poll(set())
        assert "d-unproven" not in finished, "freed although the sever proved nothing"
        time.sleep(0.002)
    assert load.entry is not None and load.entry.writer_gone, "the prefiller's death was not noticed"
    assert (load.state, load.entry.deadline_setting, load.writer_severed) == \
        (Res.FENCED, DeadlineSetting.WRITER_GONE, False)
    finished, _ = receiver.poll(set())
    assert "d-unproven" not in finished
