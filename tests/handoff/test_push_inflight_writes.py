"""A push's posted writes (kvxfer.handoff.inflight_writes), on writes the test completes by
hand: what a reap reports, and that a failure or a write in flight is never lost."""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.errors import TransferError
from kvxfer.handoff.inflight_writes import InflightWrites


@dataclass
class HandWrite:
    """A posted write the test completes (at `completed_at_s`) or fails."""

    completed_at_s: float | None = None
    error: TransferError | None = None

    def done(self) -> bool:
        return self.completed_at_s is not None

    def wait(self, timeout: float = 30.0) -> None:
        if self.error is not None:
            raise self.error


def test_a_reap_reports_what_is_in_flight_and_whether_anything_completed_since_the_last() -> None:
    writes = InflightWrites()
    first, second = HandWrite(), HandWrite()
    writes.add(first, 100)
    writes.add(second, 50)
    writes.count(pages=3, nbytes=150)
    reaped = writes.reap()
    assert (reaped.pending, reaped.pending_bytes, reaped.progressed) == (2, 150, False)
    first.completed_at_s = 7.5
    reaped = writes.reap()
    assert (reaped.pending, reaped.pending_bytes, reaped.progressed, reaped.failure) == (1, 50, True, None)
    assert writes.reap().progressed is False  # nothing new completed
    assert (writes.unreaped, writes.in_flight(), writes.last_completed_at) == (1, True, 7.5)
    second.completed_at_s = 7.2  # completed earlier, seen later: the tail ends at the latest
    writes.reap()
    assert (writes.unreaped, writes.in_flight(), writes.last_completed_at) == (0, False, 7.5)
    assert (writes.writes_posted, writes.pages_posted, writes.bytes_posted) == (2, 3, 150)
    assert writes.posted == [first, second]


def test_the_first_failure_stays_reported_after_its_write_was_reaped() -> None:
    writes = InflightWrites()
    failed = HandWrite(1.0, TransferError("r1", "Operation canceled"))
    later = HandWrite(2.0, TransferError("r1", "Connection refused"))
    writes.add(failed)
    assert str(writes.reap().failure) == "request r1: Operation canceled"
    writes.add(later)
    reaped = writes.reap()
    assert (reaped.pending, reaped.progressed, str(reaped.failure)) == (0, False, "request r1: Operation canceled")
    assert writes.first_error is reaped.failure


def test_a_write_posted_while_a_reap_looks_stays_in_flight() -> None:
    writes = InflightWrites()
    posted_meanwhile = HandWrite()

    class PostsWhileAsked(HandWrite):
        """Done; asking it posts another write, as the compute thread may while the monitor reaps."""

        def done(self) -> bool:
            if writes.writes_posted == 1:
                writes.add(posted_meanwhile, 10)
            return True

    writes.add(PostsWhileAsked(1.0))
    writes.reap()
    assert (writes.unreaped, writes.in_flight()) == (1, True)
    assert writes.reap().pending_bytes == 10
