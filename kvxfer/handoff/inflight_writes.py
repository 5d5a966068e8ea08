"""The writes one push posted and has not yet seen complete, for both senders.

A push posts paged writes (and, for the builtin prefiller, its mailbox write; for the vLLM
connector, its checksum table's messages) and must know, at any time, whether one of them
may still land on the decoder: only once none can may the decoder reuse the pages, and
only then does a cancelled or failed push tell it so. `InflightWrites` keeps them in post
order and reaps the completed ones: it records the first failure, the latest completion
time (the end of the push tail, CLOCK_MONOTONIC like the engine's stamps), and what was
posted (writes, pages, bytes). The builtin sender posts on its compute thread while its
push monitor reaps on another, so the lists are guarded by a lock held only to append or
swap them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from kvxfer.errors import TransferError


class PostedWrite(Protocol):
    """A posted write as a push tracks it: an engine `Transfer`, a staged push, a message."""

    @property
    def completed_at_s(self) -> float | None: ...

    def done(self) -> bool: ...

    def wait(self, timeout: float = 30.0) -> None: ...


@dataclass(frozen=True)
class ReapResult:
    """What one reap found: writes still in flight and their bytes, whether any write
    completed successfully since the last reap, and the push's first failure so far."""

    pending: int
    pending_bytes: int
    progressed: bool
    failure: Exception | None


class InflightWrites:
    """The writes of one push: every one posted (in order, for per-write timings) and those
    not yet reaped, with the counters both senders report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted: list[PostedWrite] = []
        self._unreaped: list[tuple[PostedWrite, int]] = []
        #: Writes posted (`add` calls).
        self.writes_posted = 0
        #: Immediate units posted (what `add` was told each write is worth at the
        #: decoder's ImmCounter): the total a push declares in its last write.
        self.units_posted = 0
        #: KV pages and bytes posted, as the sender counts them (`count`).
        self.pages_posted = 0
        self.bytes_posted = 0
        #: CLOCK_MONOTONIC completion of the latest write reaped (0.0: none yet).
        self.last_completed_at = 0.0
        #: The first failed write's error, once a reap saw one.
        self.first_error: Exception | None = None

    def add(self, write: PostedWrite, nbytes: int = 0, units: int = 0) -> PostedWrite:
        """Tracks `write`, just posted (`nbytes`: its payload, for the monitor's allowance;
        `units`: what it adds to the decoder's ImmCounter, 0 for a write without immediate)."""
        with self._lock:
            self._posted.append(write)
            self._unreaped.append((write, nbytes))
            self.writes_posted += 1
            self.units_posted += units
        return write

    def count(self, pages: int, nbytes: int) -> None:
        """Counts `pages` KV pages of `nbytes` bytes as posted."""
        self.pages_posted += pages
        self.bytes_posted += nbytes

    def reap(self) -> ReapResult:
        """Drops the completed writes from those in flight, noting their completion times and
        the first failure (a completed write's `wait(0)` raises its error)."""
        with self._lock:
            unreaped = list(self._unreaped)
        still: list[tuple[PostedWrite, int]] = []
        pending_bytes = 0
        completed_ok = 0
        for entry in unreaped:
            write, nbytes = entry
            if not write.done():
                still.append(entry)
                pending_bytes += nbytes
                continue
            self.last_completed_at = max(self.last_completed_at, write.completed_at_s or 0.0)
            try:
                write.wait(0)
                completed_ok += 1
            except TransferError as exc:
                self.first_error = self.first_error or exc
        with self._lock:
            # Writes added while this reap looked are kept: they follow the ones it saw.
            self._unreaped = still + self._unreaped[len(unreaped):]
        return ReapResult(len(still), pending_bytes, completed_ok > 0, self.first_error)

    @property
    def unreaped(self) -> int:
        """Writes not yet seen complete by a reap (0: nothing of this push can land)."""
        return len(self._unreaped)

    def in_flight(self) -> bool:
        """True while any write may still land (asks each unreaped write, no reap)."""
        with self._lock:
            unreaped = list(self._unreaped)
        return any(not write.done() for write, _ in unreaped)

    @property
    def posted(self) -> list[PostedWrite]:
        """Every write posted, in post order (a copy)."""
        with self._lock:
            return list(self._posted)
