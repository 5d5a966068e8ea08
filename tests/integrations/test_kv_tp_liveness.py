"""A killed tensor parallel prefill instance is noticed through its one liveness port (rank
0's, prefiller_liveness.py) by every part of a decode load, also the parts drawn from the
other ranks: the decode rank's `WorkerSide` keeps the instance's liveness address on every
part, and when that connection closes each rank's parts are revoked and that rank's
connections severed, so every part is freed at once, not after fence_timeout_s.

The prefill instance is two real processes (SilentPrefiller: a real engine each, which
takes the sliced reservations and never pushes), rank 0 with the liveness listener and its
keeper, as a vLLM TP prefill instance has; the decoder is one decode rank (TP 2 into TP 1),
the connector's worker half over a vLLM-laid-out cache, driven as vLLM's worker would."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import started_load  # noqa: E402
from support.late_probes import watch_severs  # noqa: E402
from support.silent_prefiller import SilentPrefiller  # noqa: E402
from support.vllm_kv_caches import attention_spec, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.handoff.reservation_state import ReservationState as Res  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.integrations.vllm.tensor_parallel import TensorParallelPlace, encode_rank_addresses  # noqa: E402
from kvxfer.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvxfer.transfer.engine import available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
KV_HEADS, BLOCKS = 4, 8
#: The fences a part freed within FREED_WITHIN_S cannot have waited out: the regular one, and
#: the short one a gone prefiller's part keeps where its sever proves nothing.
FENCE_OUT_OF_REACH_S, DEAD_FENCE_OUT_OF_REACH_S = 30.0, 20.0
#: Probes so late that within the test only the liveness connection can free a part.
PROBES_OUT_OF_REACH_S = 60.0
#: Bounds of the waits below (a bound on a hang, far below the fences; no speed assertion).
FREED_WITHIN_S = 5.0
STARTUP_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def decode_rank() -> Iterator[WorkerSide]:
    """One decode rank of TP 1 (all KV_HEADS heads), its cache registered, probes out of reach."""
    settings = ConnectorSettings(provider=PROVIDER, same_host=False, bind_host="127.0.0.1",
                                 prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 fence_timeout_s=FENCE_OUT_OF_REACH_S,
                                 dead_prefiller_fence_s=DEAD_FENCE_OUT_OF_REACH_S)
    worker = WorkerSide(settings, "kv_consumer", "m", place=TensorParallelPlace(0, 1, KV_HEADS))
    cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(heads=KV_HEADS), BLOCKS, seed=61)
    try:
        worker.register_kv_caches({f"layers.{i}.attn": view for i, view in enumerate(cache.views)})
        yield worker
    finally:
        worker.shutdown()


@pytest.fixture
def prefill_instance() -> Iterator[list[SilentPrefiller]]:
    """A TP 2 prefill instance: rank 0 with the instance's liveness listener, rank 1 without."""
    ranks: list[SilentPrefiller] = []
    try:
        ranks.append(SilentPrefiller(PROVIDER, liveness_max_held=8, wait_s=STARTUP_DEADLINE_S))
        ranks.append(SilentPrefiller(PROVIDER, wait_s=STARTUP_DEADLINE_S))
        yield ranks
    finally:
        for rank in ranks:
            rank.stop()


def test_every_part_of_a_killed_tp_prefill_instance_is_freed_at_once_by_its_liveness_connection(
        decode_rank: WorkerSide, prefill_instance: list[SilentPrefiller], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rank0, rank1 = prefill_instance
    assert decode_rank.receiver is not None and decode_rank.engine is not None
    receiver = decode_rank.receiver
    # As the router hands it over: every prefill rank's engine address, the instance's liveness port.
    spec = LoadSpec("d-tp", "tp-liveness", encode_rank_addresses([rank0.address, rank1.address]), [1, 2, 3], 0,
                    prefill_liveness=rank0.liveness)
    reason, _, failed = started_load(decode_rank, spec)
    assert not reason and not failed, reason
    decode_rank.bind(KvxferStepMetadata())  # the next steps schedule nothing new
    parts = receiver._loads["d-tp"]
    assert sorted(p.spec.prefill_engine for p in parts) == sorted([rank0.address, rank1.address])
    end = time.monotonic() + STARTUP_DEADLINE_S
    while (any(p.sent is not None for p in parts)
           or receiver._liveness.phase(rank0.liveness) in ("connecting", "awaiting_held")) and time.monotonic() < end:
        decode_rank.get_finished(set())
        time.sleep(0.005)
    assert all(p.sent is None for p in parts) and not receiver.failure("d-tp"), "a reservation was not delivered"
    watched_before_kill = receiver._liveness.phase(rank0.liveness)  # "" where no part names the port

    severed = watch_severs(decode_rank.engine, monkeypatch)
    caplog.set_level(logging.INFO, logger="kvxfer")
    for rank in (rank1, rank0):  # the whole instance, rank 0's keeper with it
        rank.signal_group(signal.SIGKILL)
        rank.proc.wait(timeout=STARTUP_DEADLINE_S)
    end = time.monotonic() + FREED_WITHIN_S
    finished: set[str] = set()
    while "d-tp" not in finished and time.monotonic() < end:
        _, finished, failed = decode_rank.get_finished(set())
        time.sleep(0.002)
    assert "d-tp" in finished and "d-tp" in failed, \
        f"not freed within {FREED_WITHIN_S} s: {[(p.spec.prefill_engine.hex()[:16], p.state) for p in parts]}"
    assert watched_before_kill == "held"
    assert all(p.state is Res.FREE and p.writer_severed for p in parts)
    assert sorted(severed) == sorted([rank0.address, rank1.address])
    gone = [r.getMessage() for r in caplog.records if "(request d-tp)" in r.getMessage()
            and "the prefiller process is gone: its liveness connection was" in r.getMessage()]
    assert len(gone) >= 2, gone  # each part, not only rank 0's
    assert receiver.pending == 0
