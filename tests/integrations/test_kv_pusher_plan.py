"""The prefill pusher's plan, driven step by step with a recording engine (no transfer:
what pages of which layer go where, and when). The transfer path itself is tested with
real vLLM processes in test_vllm_connector.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from kvxfer.handoff.push_state import PushState  # noqa: E402
from kvxfer.integrations.vllm.kv_pusher import KVPusher  # noqa: E402
from kvxfer.integrations.vllm.kv_region import KVRegion  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.kv.cache_geometry import CacheGeometry  # noqa: E402
from kvxfer.kv.protocol import KVReservation, decode_abort, encode_imm  # noqa: E402
from kvxfer.metrics import ConnectorMetrics  # noqa: E402

LAYOUT = "L4-H2-D64-bfloat16-bs32-vllm-lbhnc-avx2"
BLOCKS, PAGE = 16, 16384


class _Done:
    completed_at_s = 1.0

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> None:
        return None


class RecordingEngine:
    """Records each paged write as (layer, source blocks, destination pages), and every
    control message sent."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, list[int], list[int]]] = []
        self.sent: list[bytes] = []

    def write_paged(self, mr: Any, src: list[int], descriptor: bytes, dst: list[int], page: int, *,
                    src_stride: int, dst_stride: int, src_offset: int, dst_offset: int, imm: int,
                    request_id: str) -> _Done:
        self.writes.append((src_offset // (BLOCKS * PAGE), list(src), list(dst)))
        return _Done()

    def send(self, target: bytes, payload: bytes) -> _Done:
        self.sent.append(payload)
        return _Done()


class _HeldWrite(_Done):
    """A posted write that completes only once the test releases it."""

    def __init__(self) -> None:
        self.released = False

    def done(self) -> bool:
        return self.released


class HoldingEngine(RecordingEngine):
    """A recording engine whose paged writes stay in flight until `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[_HeldWrite] = []

    def write_paged(self, *args: Any, **kwargs: Any) -> _HeldWrite:
        super().write_paged(*args, **kwargs)
        self.held.append(_HeldWrite())
        return self.held[-1]

    def release(self) -> None:
        for write in self.held:
            write.released = True


def make_pusher(layers: int, engine: RecordingEngine | None = None) -> tuple[KVPusher, RecordingEngine]:
    """A pusher over a `layers`-layer LBHNC region of BLOCKS blocks, posting into a recording
    engine (`engine`, or a new one)."""
    geometry = CacheGeometry.dense("LBHNC", (0, 1, 2, 3, 4), layers, BLOCKS, 2, 32, PAGE // 64)
    region = KVRegion([f"layer{i}" for i in range(layers)], geometry, np.zeros(layers * BLOCKS * PAGE, np.uint8), [],
                      "bfloat16", 2, "avx2")
    assert region.kv_layout == LAYOUT.replace("L4-", f"L{layers}-")
    engine = engine or RecordingEngine()
    pusher = KVPusher(ConnectorSettings(), engine, region, SimpleNamespace(), ConnectorMetrics("kv_producer"))  # type: ignore[arg-type]
    return pusher, engine


def run(arrival: tuple[int, int] | None) -> list[tuple[int, list[int], list[int]]]:
    """A 150-token prompt prefilled in chunks ending at 64, 128, 150; the reservation comes
    before layer `arrival[1]` of step `arrival[0]` (None: before the first step)."""
    pusher, engine = make_pusher(4)
    reservation = KVReservation(request_id="t1", descriptor=b"d", pages=[10, 11, 12, 13, 14], num_pages=BLOCKS,
                                imm=encode_imm(0, 1), expected_count=20, kv_layout=LAYOUT, meta_descriptor=b"",
                                meta_offset=0, nonce=1, fence_timeout_s=15.0, mailbox=False)
    if arrival is None:
        pusher.on_reservation(reservation)
    for step, end in enumerate([64, 128, 150]):
        pusher.on_step(KvxferStepMetadata(pushes=[PushSpec("r1", "t1", b"d", 150, [0, 1, 2, 3, 4], end)]))
        for layer in range(4):
            if arrival == (step, layer):
                pusher.on_reservation(reservation)
            pusher.save_layer(layer)
    return engine.writes


def pages_by_layer(writes: list[tuple[int, list[int], list[int]]]) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for layer, src, dst in writes:
        out.setdefault(layer, []).extend(zip(src, dst))
    return out


def test_each_layer_posts_its_final_pages_per_step_once_and_in_place() -> None:
    writes = run(None)
    assert len(writes) == 12  # 4 layers x 3 steps, one paged write each
    assert pages_by_layer(writes) == {layer: [(0, 10), (1, 11), (2, 12), (3, 13), (4, 14)] for layer in range(4)}


@pytest.mark.parametrize("arrival", [(1, 0), (1, 2), (2, 3)])
def test_a_reservation_that_comes_mid_prefill_is_caught_up_and_every_page_goes_once(arrival: tuple[int, int]) -> None:
    assert pages_by_layer(run(arrival)) == {layer: [(0, 10), (1, 11), (2, 12), (3, 13), (4, 14)] for layer in range(4)}


def test_a_reservation_for_a_push_preempted_before_it_came_posts_nothing_and_tells_the_decoder() -> None:
    # Its blocks may be gone: the push is never revived, and the decoder hears at once.
    pusher, engine = make_pusher(2)
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec("r1", "t1", b"d", 64, [0, 1], 64)]))
    for layer in range(2):
        pusher.save_layer(layer)  # computed before the decoder reserved
    pusher.on_step(KvxferStepMetadata(preempted=["r1"]))
    reservation = KVReservation(request_id="t1", descriptor=b"d", pages=[5, 6], num_pages=BLOCKS,
                                imm=encode_imm(0, 1), expected_count=4, kv_layout=LAYOUT.replace("L4-", "L2-"),
                                meta_descriptor=b"", meta_offset=0, nonce=9, fence_timeout_s=15.0, mailbox=False)
    pusher.on_reservation(reservation)
    pusher.poll(set())
    (push,) = pusher._by_request["r1"]
    assert push.state is PushState.FAILED
    assert engine.writes == []
    assert [decode_abort(m)[:2] for m in engine.sent] == [(reservation.imm, reservation.nonce)]


def test_a_cancel_is_confirmed_at_the_first_saved_layer_after_its_writes_complete_never_before() -> None:
    # The decoder may reuse its pages once told: the word waits for every posted write, and
    # goes from the prefill step's next layer, not from the poll at its end.
    engine = HoldingEngine()
    pusher, _ = make_pusher(4, engine)
    reservation = KVReservation(request_id="t1", descriptor=b"d", pages=[10, 11, 12, 13, 14], num_pages=BLOCKS,
                                imm=encode_imm(0, 1), expected_count=20, kv_layout=LAYOUT, meta_descriptor=b"",
                                meta_offset=0, nonce=1, fence_timeout_s=15.0, mailbox=False)
    pusher.on_reservation(reservation)
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec("r1", "t1", b"d", 150, [0, 1, 2, 3, 4], 150)]))
    for layer in range(2):
        pusher.save_layer(layer)
    pusher.on_cancel(reservation.imm, reservation.nonce, "aborted on the decoder")
    pusher.save_layer(2)
    assert engine.sent == []  # two writes may still land
    engine.release()
    pusher.save_layer(3)
    (push,) = pusher._by_request["r1"]
    assert [decode_abort(m)[:2] for m in engine.sent] == [(reservation.imm, reservation.nonce)]
    assert push.state is PushState.DONE
    assert len(engine.writes) == 2  # nothing posted after the cancel
