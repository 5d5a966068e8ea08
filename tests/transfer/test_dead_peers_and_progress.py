"""Dead, frozen or killed peers fail writes in bounded time; caller-driven progress.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.engine_pairs import (
    DEAD_PEER_TIMEOUT_S,
    FAIL_BOUND_S,
    KIB,
    LOOPBACK,
    MAX_INFLIGHT_PER_RAIL,
    MIB,
    REPLY_TIMEOUT_S,
    SPARE_BYTES,
    WAIT_S,
    EnginePair,
    OwnPeers,
    PairPool,
    assert_same_bytes,
    freezable,
    fresh_imm,
)
from support.engine_peer import (
    SAME_HOST_MODES,
    engine_options,
    seeded_bytes,
)

from kvxfer.errors import EngineError, TransferError, TransferTimeout
from kvxfer.transfer.engine import TransferEngine

# -- dead peers -------------------------------------------------------------------------


def succeeds_within(transfer: Any, timeout_s: float) -> bool:
    try:
        transfer.wait(timeout_s)
        return True
    except TransferError:
        return False


def assert_fails_within(transfer: Any, bound_s: float, started: float) -> None:
    """The engine itself failed `transfer` (TransferError or TransferTimeout) in time."""
    with pytest.raises(TransferError):
        transfer.wait(bound_s)
    assert transfer.done(), "the engine never failed the transfer; only the wait gave up"
    assert time.monotonic() - started <= bound_s


SHM_GONE_PEER_GAPS = {
    "live": "libfabric 1.17 shm: once a non-inject op (> 4 KiB) to a gone peer is outstanding, "
    "no later non-inject op of that endpoint completes, to any peer",
    "small": "libfabric 1.17 shm: an inject-sized op (<= 4 KiB) completes once copied into the "
    "gone peer's queue, so the engine reports success for data nobody received",
}


# -- caller-driven progress ----------------------------------------------------------------


def caller_engine(provider: str, **extra: Any) -> TransferEngine:
    """An engine without a progress thread: this test's thread drives it."""
    return TransferEngine(
        **engine_options(provider), bind_host=LOOPBACK, progress="caller", **extra
    )


def test_caller_driven_engine_writes_land_byte_for_byte_and_are_counted(
    pair: EnginePair, provider: str
) -> None:
    imm, page, count = fresh_imm(), 16 * KIB, 96
    data = seeded_bytes(61, 4 * MIB)
    with caller_engine(provider) as engine:
        mr = engine.register(data.copy())
        single = engine.write(mr, 0, pair.descriptor, 0, 2 * MIB, imm)
        src_pages = np.random.default_rng(62).permutation(4 * MIB // page)[:count]
        dst_pages = np.random.default_rng(63).permutation(count)
        paged = engine.write_paged(
            mr, src_pages, pair.descriptor, dst_pages, page, dst_offset=2 * MIB, imm=imm
        )
        # Many back-to-back small writes: each submit posts at once, waits drive the rest.
        small = [engine.write(mr, i * 4 * KIB, pair.descriptor, 4 * MIB + i * 4 * KIB, 4 * KIB)
                 for i in range(64)]
        for t in [single, paged, *small]:
            t.wait(WAIT_S)

    pair.wait_target_count(imm, 1 + count)
    expected = np.zeros(4 * MIB + 256 * KIB, dtype=np.uint8)
    expected[: 2 * MIB] = data[: 2 * MIB]
    for s_page, d_page in zip(src_pages, dst_pages):
        off = 2 * MIB + d_page * page
        expected[off : off + page] = data[s_page * page : (s_page + 1) * page]
    expected[4 * MIB : 4 * MIB + 256 * KIB] = data[: 256 * KIB]
    assert_same_bytes(pair.target_bytes(0, expected.size), expected, "caller-driven writes")


def test_caller_driven_engine_refuses_other_threads_and_asyncio_with_engine_error(
    pair: EnginePair, provider: str
) -> None:
    with caller_engine(provider) as engine:
        mr = engine.register(np.zeros(64 * KIB, dtype=np.uint8))
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                engine.write(mr, 0, pair.descriptor, 0, 4 * KIB).wait(WAIT_S)
            except BaseException as e:  # noqa: BLE001 - reported to the test thread
                errors.append(e)

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(WAIT_S)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], EngineError)
        assert "thread that created it" in str(errors[0])

        async def awaited() -> None:
            await engine.write(mr, 0, pair.descriptor, 0, 4 * KIB)

        with pytest.raises(EngineError, match="asyncio"):
            asyncio.run(asyncio.wait_for(awaited(), WAIT_S))
        # The owner still works after both refusals.
        engine.write(mr, 0, pair.descriptor, 0, 4 * KIB).wait(WAIT_S)


def test_caller_driven_waits_end_at_their_deadline_with_nothing_arriving(provider: str) -> None:
    with caller_engine(provider) as engine:
        started = time.monotonic()
        assert engine.recv(0.3) is None
        with pytest.raises(TransferTimeout):
            engine.wait_imm(fresh_imm(), 1, 0.3)
        elapsed = time.monotonic() - started
        assert 0.6 <= elapsed <= 0.6 + 5.0


def test_caller_driven_writes_to_a_gone_peer_fail_in_bounded_time(
    provider: str, peers: OwnPeers
) -> None:
    if not freezable(provider):
        pytest.skip("libfabric 1.17 shm wedges senders to dead peers (see the thread-mode test)")
    gone = peers.spare()
    with caller_engine(provider, transfer_timeout_s=DEAD_PEER_TIMEOUT_S) as engine:
        src = np.zeros(1 * MIB, dtype=np.uint8)
        mr = engine.register(src)
        engine.write(mr, 0, gone.descriptor, 0, 4 * KIB).wait(WAIT_S)
        descriptor = gone.descriptor
        gone.exit()
        started = time.monotonic()
        doomed = [engine.write(mr, 0, descriptor, 0, 1 * MIB) for _ in range(4)]
        for transfer in doomed:
            assert_fails_within(transfer, FAIL_BOUND_S, started)


def test_transfers_to_a_peer_that_is_gone_or_frozen_fail_in_bounded_time_and_others_still_work(
    pairs: PairPool, provider: str, peers: OwnPeers
) -> None:
    live = pairs.get(1)
    gone = peers.spare()
    frozen = peers.spare() if freezable(provider) else None
    imm, size = fresh_imm(), 64 * KIB
    quick = {"bind_host": LOOPBACK, "transfer_timeout_s": DEAD_PEER_TIMEOUT_S}
    # Rail slots held by a frozen peer are what this test is about. The same-host immediate
    # ring holds none: a frozen peer's ring takes immediates until its lane is full
    # (test_same_host_path: test_a_frozen_receivers_ring_...), so it is off here.
    options = {**engine_options(provider), **quick, "same_host_imm_ring": False}
    with TransferEngine(**options) as engine, TransferEngine(**options) as stranger:
        src = np.zeros(1 * MIB, dtype=np.uint8)
        src[:] = seeded_bytes(47, src.size)
        mr = engine.register(src)
        stranger_mr = stranger.register(np.zeros(1 * MIB, dtype=np.uint8))
        # `engine` talks to the peers first; `stranger` tries only once the peer is gone.
        for peer in [gone] + ([frozen] if frozen else []):
            engine.write(mr, 0, peer.descriptor, 0, 4 * KIB, imm).wait(WAIT_S)
            peer.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)
        descriptor, address = gone.descriptor, gone.address
        gone.exit()
        if frozen:
            frozen.proc.send_signal(signal.SIGSTOP)

        started = time.monotonic()
        # Writes the peer must take part in: larger than any provider buffers locally.
        doomed = [
            engine.write(mr, 0, descriptor, 0, size, imm),
            engine.write_paged(mr, [0, 2], descriptor, [1, 3], size, imm=imm),
            stranger.write(stranger_mr, 0, descriptor, 0, size, imm),
        ]
        # Far more than the engine keeps in flight per rail: once socket buffers are full,
        # the frozen peer holds every slot, which the engine must hand back as these expire.
        stalled = [
            engine.write(mr, 0, frozen.descriptor, 0, size, imm)
            for _ in range(3 * MAX_INFLIGHT_PER_RAIL if frozen else 0)
        ]
        small = [
            engine.write(mr, 0, descriptor, 0, 64, imm),
            engine.write_imm(address, imm),
            engine.send(address, b"anyone there?"),
        ]

        async def awaited() -> None:
            with pytest.raises(TransferError):
                await engine.write(mr, 0, descriptor, 0, size, imm)

        asyncio.run(asyncio.wait_for(awaited(), FAIL_BOUND_S + 5))
        for transfer in doomed:
            assert_fails_within(transfer, FAIL_BOUND_S, started)
        # What the kernel buffered before the freeze may have completed; the rest failed.
        failed = sum(not succeeds_within(t, FAIL_BOUND_S) for t in stalled)
        assert all(t.done() for t in stalled) and time.monotonic() - started <= FAIL_BOUND_S
        assert failed >= (MAX_INFLIGHT_PER_RAIL if frozen else 0)

        live_imm = fresh_imm()
        to_live = engine.write(mr, 0, live.descriptor, 5 * KIB, src.size, live_imm)
        gaps = []
        if not succeeds_within(to_live, WAIT_S):
            gaps.append("live")
        if any(succeeds_within(t, FAIL_BOUND_S) for t in small):
            gaps.append("small")
        if provider == "shm" and gaps:
            pytest.xfail("; ".join(SHM_GONE_PEER_GAPS[g] for g in gaps))

        # The same engine still serves a live peer...
        to_live.wait(0)
        live.wait_target_count(live_imm, 1)
        assert_same_bytes(live.target_bytes(5 * KIB, src.size), src, "write to the live peer")
        # ...and even a message or an immediate alone to the gone peer fails.
        for transfer in small:
            assert_fails_within(transfer, FAIL_BOUND_S, started)


# How long the refused-ops test watches the engine, and the most CPU its process may use
# meanwhile, as a share of that time. Spinning on the refused ops took a whole core (0.95+);
# retrying them with growing naps takes a few percent.
REFUSED_WATCH_S = 1.5
REFUSED_CPU_SHARE_MAX = 0.35


def test_ops_a_frozen_peer_refuses_do_not_spin_the_engine_and_a_live_peer_still_gets_its_writes(
    pairs: PairPool, provider: str, peers: OwnPeers
) -> None:
    """A peer frozen before we first wrote to it never answers the provider's connection
    handshake, so the provider refuses every op to it (EAGAIN) until they expire. Those
    refused ops must not keep the progress thread polling at full speed for the whole
    deadline: on shared cores that spin takes the CPU the other peers' traffic and the
    prefill compute need. The peer isolation benchmark lost a quarter of a healthy
    decoder's completions to it (a prefiller's abort message to a frozen decoder)."""
    if not freezable(provider) or provider in SAME_HOST_MODES:
        pytest.skip("shm peers cannot be frozen (see freezable); the same-host path needs no peer handshake")
    live = pairs.get(1)
    frozen = peers.spare()
    descriptor, address = frozen.descriptor, frozen.address  # asked of the peer while it runs
    imm, size = fresh_imm(), 64 * KIB
    # A deadline well past the watch, so the refused ops are still waiting during it.
    options = {**engine_options(provider), "bind_host": LOOPBACK, "transfer_timeout_s": REFUSED_WATCH_S + 4.0}
    with TransferEngine(**options) as engine:
        src = np.zeros(1 * MIB, dtype=np.uint8)
        src[:] = seeded_bytes(48, src.size)
        mr = engine.register(src)
        frozen.proc.send_signal(signal.SIGSTOP)
        refused = [engine.write(mr, 0, descriptor, 0, size, imm) for _ in range(16)]
        refused.append(engine.send(address, b"abort"))
        time.sleep(0.2)  # the refusals start
        assert engine.stats()[0]["ops_posted"] < len(refused), "the provider took every op: none was refused"

        cpu_before, wall_before = time.process_time(), time.monotonic()
        time.sleep(REFUSED_WATCH_S)
        share = (time.process_time() - cpu_before) / (time.monotonic() - wall_before)
        assert not refused[-1].done(), "the refused ops expired during the watch"
        assert share <= REFUSED_CPU_SHARE_MAX, f"the engine used {share:.0%} of a core while only refused ops waited"

        # Refused ops of one peer hold up nobody else.
        live_imm = fresh_imm()
        engine.write(mr, 0, live.descriptor, 5 * KIB, src.size, live_imm).wait(WAIT_S)
        live.wait_target_count(live_imm, 1)
        assert_same_bytes(live.target_bytes(5 * KIB, src.size), src, "write to the live peer")
        for transfer in refused[-8:]:
            with pytest.raises(TransferError):
                transfer.wait(FAIL_BOUND_S)


def test_peer_killed_mid_stream_fails_pending_writes_in_bounded_time_and_a_new_target_gets_data(
    provider: str, peers: OwnPeers, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if provider == "shm":
        # Passes in most runs; these upstream limits make some runs fail.
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "libfabric 1.17 shm: a peer SIGKILLed while holding its region spinlock makes the "
            "next fi_writemsg to it spin forever in the initiator's progress thread, so no "
            "deadline fires (seen in 2 of 6 probes with 4 MiB writes); and a non-inject op left "
            "outstanding to the dead peer can block every later one of the endpoint"
        )))
    size, seed, imm = SPARE_BYTES, 53, fresh_imm()
    # The initiator is a process too (its transfer_timeout_s is DEAD_PEER_TIMEOUT_S): a
    # wedged engine must not take pytest down with it.
    initiator, doomed = peers.spare(), peers.spare()
    initiator.call("fill", seed=seed)
    # 1 GiB in 1 MiB writes: far more than loopback moves before the kill lands. Only what
    # moved before the kill costs CPU; the rest fails.
    stream = initiator.call(
        "stream", descriptor=doomed.descriptor.hex(), count=1024, length=size, wait_first=2
    )
    assert stream["done"] < stream["submitted"], "the stream finished before the kill"

    doomed.kill()
    killed = time.monotonic()
    successor = peers.start()  # starts while the writes fail
    settled = initiator.call(
        "settle", timeout=FAIL_BOUND_S, reply_timeout=FAIL_BOUND_S + REPLY_TIMEOUT_S
    )
    elapsed = time.monotonic() - killed

    outcomes = settled["outcomes"]
    assert outcomes.get("pending", 0) == 0, f"still pending {FAIL_BOUND_S} s after: {settled}"
    assert set(outcomes) <= {"ok", "TransferError", "TransferTimeout"}, settled
    assert outcomes.get("TransferError", 0) + outcomes.get("TransferTimeout", 0) >= 1, settled
    assert elapsed <= FAIL_BOUND_S + 2.0, settled

    initiator.call(
        "write", descriptor=successor.descriptor.hex(), src_offset=0, dst_offset=0,
        length=size, imm=imm,
    )
    successor.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)
    dump = tmp_path / "successor.bin"
    successor.call("dump", path=str(dump))
    landed = np.fromfile(dump, dtype=np.uint8)
    assert_same_bytes(landed, seeded_bytes(seed, size), "successor's region")
