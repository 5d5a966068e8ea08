"""The prefill pusher's plan, driven step by step with a recording engine (no transfer:
what pages of which layer go where, and when). The transfer path itself is tested with
real vLLM processes in test_vllm_connector.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from kvxfer.integrations.vllm.kv_pusher import KVPusher  # noqa: E402
from kvxfer.integrations.vllm.kv_region import KVRegion  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.kv.cache_geometry import CacheGeometry  # noqa: E402
from kvxfer.kv.protocol import KVReservation, encode_imm  # noqa: E402
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
    """Records each paged write as (layer, source blocks, destination pages)."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, list[int], list[int]]] = []

    def write_paged(self, mr: Any, src: list[int], descriptor: bytes, dst: list[int], page: int, *,
                    src_stride: int, dst_stride: int, src_offset: int, dst_offset: int, imm: int,
                    request_id: str) -> _Done:
        self.writes.append((src_offset // (BLOCKS * PAGE), list(src), list(dst)))
        return _Done()

    def send(self, target: bytes, payload: bytes) -> _Done:
        return _Done()


def run(arrival: tuple[int, int] | None) -> list[tuple[int, list[int], list[int]]]:
    """A 150-token prompt prefilled in chunks ending at 64, 128, 150; the reservation comes
    before layer `arrival[1]` of step `arrival[0]` (None: before the first step)."""
    geometry = CacheGeometry.dense("LBHNC", (0, 1, 2, 3, 4), 4, BLOCKS, 2, 32, PAGE // 64)
    region = KVRegion([f"layer{i}" for i in range(4)], geometry, np.zeros(4 * BLOCKS * PAGE, np.uint8), [], "bfloat16",
                      2, "avx2")
    assert region.kv_layout == LAYOUT
    engine = RecordingEngine()
    pusher = KVPusher(ConnectorSettings(), engine, region, SimpleNamespace(), ConnectorMetrics("kv_producer"))  # type: ignore[arg-type]
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
