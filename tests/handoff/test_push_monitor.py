"""The push monitor's rules (kvxfer.handoff.push_monitor), on sessions whose writes the test
completes by hand: when a destination is down, what fails with it, and what is released.
The transfer path itself is covered with real processes in tests/workers/test_peer_isolation.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvxfer.errors import TransferError
from kvxfer.handoff import push_monitor
from kvxfer.handoff.push_session import PushStats
from kvxfer.handoff.push_monitor import DestinationDown, PushMonitor

STALL_S = 0.2
RATE = 1e6  # bytes/s: 100 KB in flight buys 0.1 s more


@dataclass
class HandDrivenSession:
    """What the monitor reads of a PushSession: writes the test marks done or failed."""

    request_id: str
    pending_bytes: list[int] = field(default_factory=list)
    done: int = 0
    seen: int = 0
    failure: Exception | None = None
    cancelled: bool = False
    stats: PushStats = field(default_factory=PushStats)

    @property
    def reservation(self) -> Any:
        return SimpleNamespace(request_id=self.request_id)

    def poll(self) -> tuple[int, int, bool, Exception | None]:
        progressed = self.done > self.seen
        self.seen = self.done
        return len(self.pending_bytes), sum(self.pending_bytes), progressed, self.failure

    def complete_one(self) -> None:
        self.pending_bytes.pop()
        self.done += 1

    def cancel(self) -> None:
        self.cancelled = True

    def collect_stats(self) -> PushStats:
        return self.stats


async def watch(monitor: PushMonitor, session: HandDrivenSession, dest: bytes, released: list[str]) -> Any:
    push = monitor.watch(session, dest, asyncio.get_running_loop(),  # type: ignore[arg-type]
                         lambda p: released.append(p.session.reservation.request_id))
    return push


async def until_released(released: list[str], expected: list[str], timeout_s: float = 1.0) -> None:
    """Waits for the release hooks: the monitor thread calls them after it has resolved the
    outcomes, so an awaited outcome can be seen before its push is released."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while sorted(released) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)
    assert sorted(released) == expected


def test_a_stuck_destination_fails_its_pushes_and_spares_a_healthy_one() -> None:
    async def run() -> None:
        monitor = PushMonitor(STALL_S, RATE, poll_interval_s=0.005)
        released: list[str] = []
        try:
            stuck = HandDrivenSession("stuck", pending_bytes=[1000, 1000])
            slow = HandDrivenSession("slow", pending_bytes=[1000] * 40)
            stuck_push = await watch(monitor, stuck, b"A", released)
            slow_push = await watch(monitor, slow, b"B", released)
            monitor.posted(stuck_push)
            monitor.posted(slow_push)
            # B completes a write every 0.1 s (slow, but progressing); A never does.
            for _ in range(4):
                await asyncio.sleep(0.1)
                slow.complete_one()
            with pytest.raises(DestinationDown):
                await asyncio.wait_for(stuck_push.outcome, 1.0)
            assert stuck.cancelled and not slow.cancelled and not slow_push.outcome.done()
            with pytest.raises(DestinationDown):
                monitor.check(b"A")
            monitor.check(b"B")
            # A's writes are still in flight: not released (no abort, pages held) until they end.
            assert released == []
            stuck.pending_bytes.clear()
            while slow.pending_bytes:
                slow.complete_one()
            assert await asyncio.wait_for(slow_push.outcome, 1.0) is slow.stats
            await until_released(released, ["slow", "stuck"])
            monitor.check(b"A")  # nothing in flight any more: it may be tried again
        finally:
            monitor.close()

    asyncio.run(run())


def test_bytes_in_flight_extend_the_stall_allowance() -> None:
    async def run() -> None:
        monitor = PushMonitor(STALL_S, RATE, poll_interval_s=0.005)
        try:
            big = HandDrivenSession("big", pending_bytes=[300_000])  # STALL_S + 0.3 s allowed
            push = await watch(monitor, big, b"C", [])
            monitor.posted(push)
            await asyncio.sleep(STALL_S + 0.15)
            assert not push.outcome.done(), "declared down inside its bytes' allowance"
            with pytest.raises(DestinationDown):
                await asyncio.wait_for(push.outcome, 1.0)
        finally:
            monitor.close()

    asyncio.run(run())


def test_a_fabric_error_takes_the_destination_down_at_once() -> None:
    async def run() -> None:
        monitor = PushMonitor(10.0, RATE, poll_interval_s=0.005)
        try:
            failing = HandDrivenSession("failing", pending_bytes=[10])
            other = HandDrivenSession("other", pending_bytes=[10])
            failing_push = await watch(monitor, failing, b"D", [])
            other_push = await watch(monitor, other, b"D", [])
            monitor.posted(failing_push)
            failing.failure = TransferError("failing", "connection reset by peer")
            with pytest.raises(TransferError):
                await asyncio.wait_for(failing_push.outcome, 1.0)
            # The other push to the same decoder (still computing) fails with it.
            with pytest.raises(DestinationDown):
                await asyncio.wait_for(other_push.outcome, 1.0)
            assert other.cancelled
        finally:
            monitor.close()

    asyncio.run(run())


def test_a_write_the_decoder_refused_fails_only_its_own_push() -> None:
    # A cancel closes the reservation's registration: the provider fails the next write of
    # that push ("Operation canceled"), and the decoder stays healthy for everyone else.
    async def run() -> None:
        monitor = PushMonitor(10.0, RATE, poll_interval_s=0.005)
        try:
            refused = HandDrivenSession("refused", pending_bytes=[10])
            other = HandDrivenSession("other", pending_bytes=[10])
            refused_push = await watch(monitor, refused, b"E", [])
            other_push = await watch(monitor, other, b"E", [])
            monitor.posted(refused_push)
            monitor.posted(other_push)
            refused.failure = TransferError("refused", "Operation canceled (Operation now in progress)")
            with pytest.raises(TransferError) as failed:
                await asyncio.wait_for(refused_push.outcome, 1.0)
            assert not isinstance(failed.value, DestinationDown)
            await asyncio.sleep(0.05)
            assert not other_push.outcome.done() and not other.cancelled
            monitor.check(b"E")  # new pushes to it are still taken
            other.pending_bytes = []
            await asyncio.wait_for(other_push.outcome, 1.0)
        finally:
            monitor.close()

    asyncio.run(run())


def test_an_idle_monitor_sleeps_until_a_push_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    # An idle prefill worker's monitor used to wake every poll interval for nothing (1.8%
    # of a core). With nothing to watch it must not poll at all, and a new push must wake
    # it (the idle recheck is made longer than the test: only watch() can).
    monkeypatch.setattr(push_monitor, "IDLE_RECHECK_S", 60.0)

    async def run() -> None:
        monitor = PushMonitor(STALL_S, RATE, poll_interval_s=0.005)
        polls: list[float] = []
        poll = monitor._poll

        def counted_poll() -> None:
            polls.append(0.0)
            poll()

        monitor._poll = counted_poll  # type: ignore[method-assign]
        released: list[str] = []
        try:
            await asyncio.sleep(0.3)
            assert polls == []  # 60 polls at the old fixed interval
            session = HandDrivenSession("late", pending_bytes=[1000])
            push = await watch(monitor, session, b"A", released)
            monitor.posted(push)
            session.complete_one()
            await asyncio.wait_for(push.outcome, 1.0)
            await until_released(released, ["late"])
        finally:
            monitor.close()

    asyncio.run(run())


def test_closing_an_idle_monitor_stops_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push_monitor, "IDLE_RECHECK_S", 60.0)  # only close() can wake it
    monitor = PushMonitor(STALL_S, RATE, poll_interval_s=0.005)
    monitor.close()
    assert not monitor._thread.is_alive()
