"""The decode worker's jobs and their table (kvxfer/workers/decode/job.py, job_table.py):
a job reads its reservation's state from its ledger entry and copies none of it, and `end`
moves the reservation on exactly once, by the batch thread when the job is in the batch.

No engine and no model: a real `ReservationLedger` over a real `PageAllocator`, with the
ledger's clock given by the test.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvxfer.handoff.decode_ledger import ReservationLedger
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.page_allocator import PageAllocator
from kvxfer.workers.decode.job import DecodeJob, DecodePhase
from kvxfer.workers.decode.job_table import JobTable
from kvxfer.workers.rejection import Rejection, RequestRejected

BLOCK = 16
PAGES = 64
#: A first token that neither is EOS nor reaches max_tokens: the job goes to the batch.
FIRST_TOKEN = ord("a")


class ManualClock:
    """The ledger's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def table(clock: ManualClock) -> JobTable:
    allocator = PageAllocator(PAGES, BLOCK)
    ledger = ReservationLedger(allocator, 8, reservation_ttl_s=60.0, fence_timeout_s=5.0, clock=clock)
    return JobTable(ledger, allocator, model_name="tiny", max_requests=8, reservation_ttl_s=60.0)


def open_job(table: JobTable, request_id: str, prompt_tokens: int = 40, max_tokens: int = 8) -> DecodeJob:
    """A job as /reserve makes it: a ledger entry and the job that holds it."""
    with table.lock:
        entry = table.ledger.open(request_id, prompt_tokens + max_tokens)
        job = DecodeJob(request_id=request_id, entry=entry, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                        expected_count=1, created_at=0.0, owner="alice", block_size=BLOCK)
        table.jobs[request_id] = job
    return job


def test_a_job_reads_its_reservation_from_its_ledger_entry(table: JobTable, clock: ManualClock) -> None:
    job = open_job(table, "r1")
    entry = table.ledger.get("r1")
    assert entry is not None
    assert (job.pages, job.slot, job.imm, job.nonce, job.held_pages) == (
        entry.pages, entry.slot, entry.imm, entry.nonce, entry.held_pages)
    assert job.reservation_state is Res.RESERVED and job.waiting_for_kv and job.first_imm_at == 0.0

    clock.now = 103.5
    table.ledger.move("r1", Res.RECEIVING)  # the reaper saw its first immediate
    assert job.reservation_state is Res.RECEIVING and job.waiting_for_kv
    assert job.first_imm_at == 103.5, "the receipt's wire time must start at the first immediate"

    table.ledger.move("r1", Res.ADMITTED)
    assert not job.waiting_for_kv
    assert job.phase is DecodePhase.PENDING, "admission of the KV is the ledger's, not a decode phase"


def test_a_waiting_job_ends_once_and_its_pages_stay_fenced_until_the_writer_stops(table: JobTable) -> None:
    job = open_job(table, "r1")
    table.end(job, DecodePhase.FAILED, error="the push failed")
    assert job.phase is DecodePhase.FAILED and job.reservation_state is Res.FENCED
    assert table.allocator.free_pages < PAGES, "a write may still land: the pages must not be reusable"
    assert table.jobs["r1"] is job

    table.end(job, DecodePhase.CANCELLED)  # a late cancel of an ended job changes nothing
    assert job.phase is DecodePhase.FAILED and job.error == "the push failed"
    assert job.reservation_state is Res.FENCED

    assert table.writer_stopped("r1")
    assert job.reservation_state is Res.FREE and "r1" not in table.jobs
    assert table.allocator.free_pages == PAGES


def test_a_job_in_the_batch_is_freed_by_the_batch_thread_after_its_step(table: JobTable) -> None:
    table.batch_thread = threading.Thread(target=lambda: None)  # some other thread than this one
    queued, taken = open_job(table, "queued"), open_job(table, "taken")

    async def scenario() -> None:  # in an event loop, as /generate runs it
        for job in (queued, taken):
            table.ledger.move(job.request_id, Res.ADMITTED)
            table.start_decoding(job, FIRST_TOKEN)
        assert queued.phase is taken.phase is DecodePhase.RUNNING
        assert table.take_for_batch(1) == [queued]
        assert table.take_for_batch(1) == [taken]
        assert table.take_for_batch(1) == []

        table.end(taken, DecodePhase.CANCELLED)  # e.g. its client went away, mid-step
        assert taken.phase is DecodePhase.CANCELLED
        assert taken.reservation_state is Res.ADMITTED, "freed while the batch step may write its K/V"
        assert table.take_deferred_releases() == [taken]
        table.release_after_step(taken)
        assert taken.reservation_state is Res.FREE and "taken" not in table.jobs

    asyncio.run(scenario())


def test_a_job_ended_before_the_batch_took_it_is_freed_at_once(table: JobTable) -> None:
    table.batch_thread = threading.Thread(target=lambda: None)
    job = open_job(table, "r1")

    async def scenario() -> None:
        table.ledger.move("r1", Res.ADMITTED)
        table.start_decoding(job, FIRST_TOKEN)
        table.end(job, DecodePhase.CANCELLED)
        assert job.reservation_state is Res.FREE and table.allocator.free_pages == PAGES
        assert table.take_for_batch(8) == [] and table.take_deferred_releases() == []

    asyncio.run(scenario())


def test_a_cancel_of_an_unknown_id_refuses_that_callers_later_reservation_once(table: JobTable) -> None:
    with pytest.raises(RequestRejected) as unknown:
        table.cancel("late", caller="bob")
    assert unknown.value.reason is Rejection.UNKNOWN_REQUEST
    with table.lock:
        assert not table.was_cancelled_unreserved("alice", "late")
        assert table.was_cancelled_unreserved("bob", "late")
        assert not table.was_cancelled_unreserved("bob", "late"), "remembered after it was used"
