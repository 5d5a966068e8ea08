"""Watches every KV push in flight, per destination, so that no decoder blocks another.

The prefill worker's compute thread only computes and posts writes; it never waits for a
destination. Each push is handed to the `PushMonitor`, whose one thread polls the posted
writes (a `done()` per transfer, a few hundred at most) and

- resolves the push's outcome (an asyncio future the HTTP handler awaits) once every write
  completed, or at the first failed write;
- declares a destination *down* when it has writes in flight and none of them completed
  for `stall_timeout_s` plus the time its bytes in flight take at `min_rate_bytes_per_s`
  (a frozen or dead decoder: over the fabric the engine would only notice at its per-write
  deadline; a 32 MiB layer write to a healthy decoder on a starved machine may take longer
  than the bare stall timeout), or at once on a write that failed because the peer
  itself is unreachable (connection refused or reset, no route: `_peer_unreachable`).
  Every push to a destination that is down fails at once: it is cancelled (no further
  writes) and its outcome is `DestinationDown`; new pushes to it are refused (`check`)
  until one of its writes completes again or none is left in flight. A write the decoder
  refused (its reservation's registration closed by a cancel: the provider answers
  "Operation canceled") fails only its own push: that decoder is healthy;
- calls the push's `on_released` once none of its writes is in flight any more (bounded by
  the engine's per-write deadline): only then may the prefiller free the source pages and
  tell the decoder (abort) that nothing more can land.

A slow decoder whose writes keep completing is never down: it delays only its own pushes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxfer.errors import TransferError, TransferTimeout
from kvxfer.handoff.push_session import PushSession, PushStats

log = logging.getLogger("kvxfer.push")

#: With nothing to watch the thread sleeps until a push arrives; it looks again after
#: this long anyway (a bound, not a poll: `watch()` wakes it at once).
IDLE_RECHECK_S = 1.0

#: fi_strerror texts (the engine's error message starts with one) that mean the peer
#: itself cannot be reached, not that it refused one write.
_PEER_UNREACHABLE = ("connection refused", "connection reset by peer", "broken pipe", "no route to host",
                     "host is down", "network is unreachable", "transport endpoint is not connected")


def _peer_unreachable(failure: BaseException) -> bool:
    """Whether a failed write says the decoder is gone (then every push to it fails)."""
    if isinstance(failure, TransferTimeout):
        return False  # the stall rule judges slowness, with its allowance for bytes in flight
    reason = failure.reason if isinstance(failure, TransferError) else str(failure)
    return reason.lower().startswith(_PEER_UNREACHABLE)


#: The same test for other callers: a decoder's probe of its prefiller (kv_receiver.py).
peer_unreachable = _peer_unreachable


class DestinationDown(TransferError):
    """The push's decoder stopped taking writes (none completed within the stall timeout,
    or the fabric reported it gone); the push failed without waiting for its deadline."""


class PushPhase(enum.Enum):
    """Where one watched push is."""

    COMPUTING = "computing"  # the compute thread is still posting its writes
    POSTED = "posted"        # every write posted (mailbox included); waiting for completions
    ENDED = "ended"          # outcome known (success or failure); waiting for writes in flight to drain


@dataclass
class WatchedPush:
    """One push under watch: its session, destination, outcome future and release hook."""

    session: PushSession
    destination: bytes
    outcome: asyncio.Future[PushStats]
    loop: asyncio.AbstractEventLoop
    on_released: Callable[[WatchedPush], None]
    phase: PushPhase = PushPhase.COMPUTING
    #: Why the push failed (None: it has not, or succeeded).
    error: BaseException | None = None

    def _resolve(self, error: BaseException | None, stats: PushStats | None = None) -> None:
        def settle() -> None:
            if self.outcome.done():
                return
            if error is not None:
                self.outcome.set_exception(error)
            else:
                self.outcome.set_result(stats or self.session.stats)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop closed (shutdown): nobody awaits the outcome
            pass


@dataclass
class _Destination:
    """What the monitor knows of one decoder engine."""

    key: bytes
    pushes: set[int] = field(default_factory=set)  # ids of WatchedPush
    #: Monotonic time since which it has had writes in flight and none completed.
    quiet_since: float = 0.0
    down_reason: str | None = None


class PushMonitor:
    """One thread watching all pushes of a prefill worker, grouped by destination."""

    def __init__(self, stall_timeout_s: float, min_rate_bytes_per_s: float = 50e6,
                 poll_interval_s: float = 0.005) -> None:
        if stall_timeout_s <= 0 or poll_interval_s <= 0 or min_rate_bytes_per_s <= 0:
            raise ValueError("stall_timeout_s, min_rate_bytes_per_s and poll_interval_s must be > 0")
        self.stall_timeout_s = stall_timeout_s
        self.min_rate_bytes_per_s = min_rate_bytes_per_s
        self.poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        # Signalled when a push is watched or the monitor closes: an idle worker's monitor
        # waits on it instead of waking every poll interval (1.8% of a core here).
        self._work = threading.Condition(self._lock)
        self._pushes: dict[int, WatchedPush] = {}
        self._destinations: dict[bytes, _Destination] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="push-monitor", daemon=True)
        self._thread.start()

    # -- the compute side ---------------------------------------------------------------
    def check(self, destination: bytes) -> None:
        """Raises DestinationDown if pushes to `destination` fail at once now."""
        with self._lock:
            dest = self._destinations.get(destination)
            reason = dest.down_reason if dest is not None else None
        if reason is not None:
            raise DestinationDown(None, f"decode destination is down ({reason}); refusing the push at once")

    def watch(self, session: PushSession, destination: bytes, loop: asyncio.AbstractEventLoop,
              on_released: Callable[[WatchedPush], None]) -> WatchedPush:
        """Starts watching `session` (before its first write); its outcome resolves on `loop`."""
        push = WatchedPush(session, destination, loop.create_future(), loop, on_released)
        with self._lock:
            self._pushes[id(push)] = push
            dest = self._destinations.setdefault(destination, _Destination(destination))
            if not dest.pushes:
                dest.quiet_since = time.monotonic()
            dest.pushes.add(id(push))
            self._work.notify()
        return push

    def posted(self, push: WatchedPush) -> None:
        """Every write of the push is posted: it succeeds once they all completed."""
        with self._lock:
            if push.phase is PushPhase.COMPUTING:
                push.phase = PushPhase.POSTED

    def end(self, push: WatchedPush, error: BaseException) -> None:
        """The compute side failed the push: no further writes; released once none is in flight."""
        push.session.cancel()
        with self._lock:
            first = push.phase is not PushPhase.ENDED
            push.phase = PushPhase.ENDED
            push.error = push.error or error
        if first:
            push._resolve(push.error)

    def pushes_to(self, destination: bytes) -> int:
        """Pushes to `destination` not yet released (tests, metrics)."""
        with self._lock:
            dest = self._destinations.get(destination)
            return len(dest.pushes) if dest is not None else 0

    def down_destinations(self) -> int:
        """Destinations declared down now."""
        with self._lock:
            return sum(1 for d in self._destinations.values() if d.down_reason is not None)

    def close(self) -> None:
        """Stops the thread (pushes still watched are left to the engine's deadlines)."""
        self._stop.set()
        with self._work:
            self._work.notify()
        self._thread.join(timeout=5.0)

    # -- the monitor thread -------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._work:
                if not self._destinations:  # nothing in flight, no destination down
                    if not self._stop.is_set():  # close() sets it before it notifies
                        self._work.wait(IDLE_RECHECK_S)
                    continue
            if self._stop.wait(self.poll_interval_s):
                break
            try:
                self._poll()
            except Exception:  # a bug must not stop the watch of every other push
                log.exception("push monitor: poll failed")

    def _poll(self) -> None:
        now = time.monotonic()
        released: list[WatchedPush] = []
        with self._lock:
            for dest in list(self._destinations.values()):
                released += self._poll_destination(dest, now)
                if not dest.pushes and dest.down_reason is None:
                    del self._destinations[dest.key]
        for push in released:
            try:
                push.on_released(push)
            except Exception:
                log.exception("push monitor: release of request %s failed", push.session.reservation.request_id)

    def _poll_destination(self, dest: _Destination, now: float) -> list[WatchedPush]:
        in_flight = 0
        in_flight_bytes = 0
        progressed = False
        fabric_error: str | None = None
        released: list[WatchedPush] = []
        for pid in list(dest.pushes):
            push = self._pushes[pid]
            pending, pending_bytes, push_progressed, failure = push.session.poll()
            progressed |= push_progressed
            if failure is not None and _peer_unreachable(failure):
                fabric_error = fabric_error or str(failure)
            in_flight += pending
            in_flight_bytes += pending_bytes
            if push.phase is PushPhase.POSTED and (failure is not None or not pending):
                push.phase = PushPhase.ENDED
                if failure is not None:
                    push.error = failure
                    push.session.cancel()
                    push._resolve(failure)
                else:
                    push._resolve(None, push.session.collect_stats())
            if push.phase is PushPhase.ENDED and not pending:
                dest.pushes.discard(pid)
                del self._pushes[pid]
                released.append(push)
        if progressed or in_flight == 0:
            dest.quiet_since = now
            if dest.down_reason is not None:
                log.warning("decode destination %s is taking writes again", dest.key[:16].hex())
                dest.down_reason = None
        allowed_s = self.stall_timeout_s + in_flight_bytes / self.min_rate_bytes_per_s
        stalled = in_flight > 0 and now - dest.quiet_since > allowed_s
        if dest.down_reason is None and (stalled or fabric_error is not None):
            dest.down_reason = (f"no write completed for {now - dest.quiet_since:.2f} s with {in_flight} in flight "
                                f"({in_flight_bytes} bytes)"
                                if fabric_error is None else f"fabric error: {fabric_error}")
            log.warning("decode destination %s is down: %s", dest.key[:16].hex(), dest.down_reason)
        if dest.down_reason is not None:
            for pid in dest.pushes:
                push = self._pushes[pid]
                if push.phase is not PushPhase.ENDED:
                    push.phase = PushPhase.ENDED
                    push.error = DestinationDown(push.session.reservation.request_id,
                                                 f"decode destination is down ({dest.down_reason})")
                    push.session.cancel()
                    push._resolve(push.error)
        return released
