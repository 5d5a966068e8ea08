"""The vLLM connector's push (kv_pusher.py over kvxfer.handoff's push core) when the
decoder's reservation arrives after the push already failed: it is never revived (its
blocks may be gone), nothing is posted, and the decoder is told at once. Driven with an
engine that records what would be sent (no transfer)."""

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

LAYOUT = "L2-H2-D64-bfloat16-bs32-vllm-lbhnc-avx2"
BLOCKS, PAGE = 8, 16384


class _Done:
    completed_at_s = 1.0

    def done(self) -> bool:
        return True

    def wait(self, timeout: float = 30.0) -> None:
        return None


class RecordingEngine:
    """Counts paged writes and keeps every control message sent."""

    def __init__(self) -> None:
        self.writes = 0
        self.sent: list[bytes] = []

    def write_paged(self, *args: Any, **kwargs: Any) -> _Done:
        self.writes += 1
        return _Done()

    def send(self, target: bytes, payload: bytes) -> _Done:
        self.sent.append(payload)
        return _Done()


@pytest.fixture
def pusher_and_engine() -> tuple[KVPusher, RecordingEngine]:
    geometry = CacheGeometry.dense("LBHNC", (0, 1, 2, 3, 4), 2, BLOCKS, 2, 32, PAGE // 64)
    region = KVRegion(["layer0", "layer1"], geometry, np.zeros(2 * BLOCKS * PAGE, np.uint8), [], "bfloat16", 2, "avx2")
    assert region.kv_layout == LAYOUT
    engine = RecordingEngine()
    pusher = KVPusher(ConnectorSettings(), engine, region, SimpleNamespace(),  # type: ignore[arg-type]
                      ConnectorMetrics("kv_producer"))
    return pusher, engine


def test_a_reservation_for_a_push_preempted_before_it_came_posts_nothing_and_tells_the_decoder(
    pusher_and_engine: tuple[KVPusher, RecordingEngine],
) -> None:
    pusher, engine = pusher_and_engine
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec("r1", "t1", b"d", 64, [0, 1], 64)]))
    for layer in range(2):
        pusher.save_layer(layer)  # computed before the decoder reserved
    pusher.on_step(KvxferStepMetadata(preempted=["r1"]))
    reservation = KVReservation(request_id="t1", descriptor=b"d", pages=[5, 6], num_pages=BLOCKS,
                                imm=encode_imm(0, 1), expected_count=4, kv_layout=LAYOUT, meta_descriptor=b"",
                                meta_offset=0, nonce=9, fence_timeout_s=15.0, mailbox=False)
    pusher.on_reservation(reservation)
    pusher.poll(set())
    (push,) = pusher._by_request["r1"]
    assert push.state is PushState.FAILED
    assert engine.writes == 0
    assert [decode_abort(m)[:2] for m in engine.sent] == [(reservation.imm, reservation.nonce)]
