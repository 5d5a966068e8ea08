"""Device (CUDA) caches move through pinned host staging: every page lands where its index
says, byte for byte, staging slots are reused only after the write that read them, and bad
input posts nothing.

Between two processes over net (tests/support/engine_peer.py holds the receiver). The cache
is a CUDA tensor where this machine has a GPU, and a CPU tensor everywhere (the same code
path with host copies), so CI without a GPU still runs every step of the module.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from support.engine_pairs import DEAD_PEER_TIMEOUT_S, FAIL_BOUND_S, WAIT_S, PeerProcess, fresh_imm, ops_posted
from support.engine_peer import seeded_bytes

from kvxfer.errors import BoundsError, EngineError, TransferError, TransferTimeout
from kvxfer.transfer.device_staging import DevicePageSender, StagingExhausted, StagingRing, page_rows
from kvxfer.transfer.engine import TransferEngine, available_providers

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROVIDER = "net" if "net" in available_providers() else "tcp"
PAGE = 16 * 1024
CACHE_PAGES = 256
LANDING_PAGES = 128


def digest(row: np.ndarray) -> str:
    return hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest()


@pytest.fixture(scope="module")
def sender_engine() -> Iterator[TransferEngine]:
    engine = TransferEngine(provider=PROVIDER, same_host=False, bind_host="127.0.0.1", transfer_timeout_s=WAIT_S)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture()
def receiver(tmp_path: Path) -> Iterator[PeerProcess]:
    peer = PeerProcess(PROVIDER, 1, 4096, tmp_path, transfer_timeout_s=WAIT_S)
    try:
        yield peer
    finally:
        peer.close()


def staging_receiver(peer: PeerProcess, device: str) -> bytes:
    """Gives the peer a zeroed cache on `device` and a DevicePageReceiver; its descriptor."""
    return bytes.fromhex(peer.call("staging_receiver", device=device, page_bytes=PAGE, cache_pages=CACHE_PAGES,
                                   landing_pages=LANDING_PAGES)["descriptor"])


def seeded_cache(device: str, seed: int) -> torch.Tensor:
    return torch.from_numpy(seeded_bytes(seed, CACHE_PAGES * PAGE).copy()).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_pages_of_a_device_cache_land_byte_for_byte_in_the_receivers_cache_through_a_small_ring(
    sender_engine: TransferEngine, receiver: PeerProcess, device: str
) -> None:
    # 100 pages through 24 staging slots in chunks of 8: the ring wraps four times, so slots
    # are reused while earlier chunks may still be on the fabric.
    desc = staging_receiver(receiver, device)
    cache = seeded_cache(device, seed=5)
    sender = DevicePageSender(sender_engine, cache, PAGE, staging_pages=24, chunk_pages=8)
    rng = np.random.default_rng(11)
    count, imm = 100, fresh_imm()
    src = rng.permutation(CACHE_PAGES)[:count]
    # A run of 50 consecutive landing pages (one copy to the device) and 50 scattered ones.
    landing = np.concatenate([np.arange(10, 60), rng.permutation(np.arange(60, LANDING_PAGES))[:50]])
    final = rng.permutation(CACHE_PAGES)[:count]

    push = sender.push(src, desc, landing, imm=imm)
    assert len(push.transfers) == 13 and push.bytes == count * PAGE
    push.wait(WAIT_S)
    receiver.call("staging_land", imm=imm, count=count, landing_pages=landing.tolist(),
                  cache_pages=final.tolist(), timeout_s=WAIT_S)

    got = receiver.call("staging_digests")["digests"]
    source_rows = cache.view(-1, PAGE).cpu().numpy()
    zero = digest(np.zeros(PAGE, dtype=np.uint8))
    expected = [zero] * CACHE_PAGES
    for s, f in zip(src, final):
        expected[f] = digest(source_rows[s])
    wrong = [p for p in range(CACHE_PAGES) if got[p] != expected[p]]
    assert not wrong, f"{len(wrong)} cache pages differ from what was pushed, first {wrong[:5]}"
    assert sender.quarantined_pages == 0
    sender.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_push_naming_a_page_outside_the_receivers_landing_pages_posts_nothing(
    sender_engine: TransferEngine, receiver: PeerProcess, device: str
) -> None:
    desc = staging_receiver(receiver, device)
    sender = DevicePageSender(sender_engine, seeded_cache(device, seed=6), PAGE, staging_pages=16, chunk_pages=4)
    before = ops_posted(sender_engine)
    # The bad page sits in the last chunk: a check per chunk would have posted the first ones.
    with pytest.raises(BoundsError, match=f"page {LANDING_PAGES} outside"):
        sender.push(list(range(12)), desc, list(range(11)) + [LANDING_PAGES], imm=fresh_imm())
    with pytest.raises(BoundsError, match=f"page {CACHE_PAGES} outside"):
        sender.push([0, CACHE_PAGES], desc, [0, 1])
    with pytest.raises(BoundsError, match="2 pages, dst_pages 1"):
        sender.push([0, 1], desc, [0])
    assert ops_posted(sender_engine) == before
    sender.close()


def test_a_dead_receiver_fails_the_push_in_bounded_time_and_its_slots_are_never_reused(
    tmp_path: Path,
) -> None:
    # The failed write may still have parts on the fabric, so its slots are quarantined; the
    # sender keeps serving a healthy receiver around them, byte for byte.
    engine = TransferEngine(provider=PROVIDER, same_host=False, bind_host="127.0.0.1",
                            transfer_timeout_s=DEAD_PEER_TIMEOUT_S)
    dead, alive = PeerProcess(PROVIDER, 1, 4096, tmp_path), PeerProcess(PROVIDER, 1, 4096, tmp_path)
    try:
        descs = [staging_receiver(p, "cpu") for p in (dead, alive)]
        cache = seeded_cache("cpu", seed=8)
        sender = DevicePageSender(engine, cache, PAGE, staging_pages=32, chunk_pages=16)
        dead.kill()
        started = time.monotonic()
        with pytest.raises(TransferError):
            sender.push(list(range(16)), descs[0], list(range(16)), imm=fresh_imm()).wait(FAIL_BOUND_S)
        assert time.monotonic() - started < FAIL_BOUND_S

        imm = fresh_imm()
        sender.push(list(range(16, 48)), descs[1], list(range(32)), imm=imm).wait(WAIT_S)
        assert sender.quarantined_pages == 16
        alive.call("staging_land", imm=imm, count=32, landing_pages=list(range(32)),
                   cache_pages=list(range(32)), timeout_s=WAIT_S)
        got = alive.call("staging_digests")["digests"]
        rows = cache.view(-1, PAGE).numpy()
        assert got[:32] == [digest(rows[16 + i]) for i in range(32)]
        sender.close()
    finally:
        dead.close()
        alive.close()
        engine.close()


def test_a_cache_that_is_not_a_whole_number_of_pages_is_refused() -> None:
    with pytest.raises(BoundsError, match="not a whole number"):
        page_rows(torch.zeros(PAGE + 1, dtype=torch.uint8), PAGE)
    with pytest.raises(BoundsError, match="contiguous"):
        page_rows(torch.zeros(4, PAGE, dtype=torch.uint8).t(), PAGE)
    # A bf16 cache is pages of its bytes.
    assert page_rows(torch.zeros(4, PAGE // 2, dtype=torch.bfloat16), PAGE).shape == (4, PAGE)


def test_registering_a_cuda_tensor_points_at_device_staging(sender_engine: TransferEngine) -> None:
    class CudaLike:  # the duck-typed parts of a CUDA tensor the engine looks at
        is_cuda = True

        def data_ptr(self) -> int:
            return 4096

        def is_contiguous(self) -> bool:
            return True

    with pytest.raises(EngineError, match="device_staging"):
        sender_engine.register(CudaLike())


# -- the staging ring, with stand-ins for transfers (what the ring does with their states) --


class FakeTransfer:
    """A transfer whose end the test decides: pending, done, failed or timed out."""

    def __init__(self) -> None:
        self.status = "pending"
        self.waited = False

    def done(self) -> bool:
        return self.status != "pending"

    def wait(self, timeout: float) -> None:
        self.waited = True
        if self.status == "pending":
            time.sleep(min(timeout, 0.01))
            raise TransferTimeout(None, "not complete")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.status != "done":
            raise TransferError(None, self.status)


def test_the_ring_reuses_a_slot_only_after_the_write_that_read_it_completed() -> None:
    ring = StagingRing(8)
    first, second = FakeTransfer(), FakeTransfer()
    ring.lease(ring.acquire(4, time.monotonic() + 1), 4, first)
    ring.lease(ring.acquire(4, time.monotonic() + 1), 4, second)
    # Full: the next run must wait for the oldest write, and gives up at the deadline.
    with pytest.raises(StagingExhausted, match="in-flight"):
        ring.acquire(2, time.monotonic() + 0.05)
    assert first.waited and ring.leased_slots == 8
    first.status = "done"
    assert ring.acquire(2, time.monotonic() + 1) == 0
    assert ring.leased_slots == 4  # the second write still holds its slots


def test_slots_of_a_failed_write_are_never_reused_and_a_full_quarantine_is_an_error() -> None:
    ring = StagingRing(8)
    failed, ok = FakeTransfer(), FakeTransfer()
    ring.lease(ring.acquire(4, time.monotonic() + 1), 4, failed)
    ring.lease(ring.acquire(4, time.monotonic() + 1), 4, ok)
    failed.status, ok.status = "failed", "done"
    ring.reap()
    assert ring.quarantined_slots == 4 and ring.leased_slots == 0
    # Runs go around the quarantined slots 0..3, never into them.
    for _ in range(3):
        start = ring.acquire(4, time.monotonic() + 1)
        assert start == 4
        done = FakeTransfer()
        done.status = "done"
        ring.lease(start, 4, done)
    with pytest.raises(StagingExhausted, match="quarantined"):
        ring.acquire(5, time.monotonic() + 1)
