"""The decoder's reservation state machine (kvxfer.handoff.decode_ledger): every transition, the
illegal ones, deadlines (TTL, stall, fence, a gone writer's fence), slots and epochs, and a
page source other than the allocator."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

from kvxfer.handoff.decode_ledger import DeadlineSetting, NoSlotError, ReservationLedger
from kvxfer.handoff.reservation_state import TRANSITIONS, IllegalTransition
from kvxfer.handoff.reservation_state import ReservationState as S
from kvxfer.kv.page_allocator import PageAllocator
from kvxfer.kv.protocol import decode_imm

TTL_S, FENCE_S = 10.0, 20.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(slots: int = 4, pages: int = 64) -> tuple[ReservationLedger, PageAllocator, Clock, list[int]]:
    allocator = PageAllocator(pages, 16)
    clock = Clock()
    forgotten: list[int] = []
    ledger = ReservationLedger(allocator, slots, reservation_ttl_s=TTL_S, fence_timeout_s=FENCE_S,
                               forget_imm=forgotten.append, clock=clock)
    return ledger, allocator, clock, forgotten


#: A path from RESERVED through each legal edge (source, target).
PATHS: dict[tuple[S, S], list[S]] = {
    (S.RESERVED, S.RECEIVING): [S.RECEIVING],
    (S.RESERVED, S.ADMITTED): [S.ADMITTED],
    (S.RESERVED, S.FAILED): [S.FAILED],
    (S.RESERVED, S.CANCELLED): [S.CANCELLED],
    (S.RECEIVING, S.ADMITTED): [S.RECEIVING, S.ADMITTED],
    (S.RECEIVING, S.FAILED): [S.RECEIVING, S.FAILED],
    (S.RECEIVING, S.CANCELLED): [S.RECEIVING, S.CANCELLED],
    (S.ADMITTED, S.FREE): [S.ADMITTED, S.FREE],
    (S.FAILED, S.FENCED): [S.FAILED, S.FENCED],
    (S.FAILED, S.FREE): [S.FAILED, S.FREE],
    (S.CANCELLED, S.FENCED): [S.CANCELLED, S.FENCED],
    (S.CANCELLED, S.FREE): [S.CANCELLED, S.FREE],
    (S.FENCED, S.FREE): [S.CANCELLED, S.FENCED, S.FREE],
}


def test_paths_cover_the_table() -> None:
    assert set(PATHS) == {(a, b) for a, targets in TRANSITIONS.items() for b in targets}


@pytest.mark.parametrize("edge", sorted(PATHS, key=str), ids=lambda e: f"{e[0].value}->{e[1].value}")
def test_every_legal_transition(edge: tuple[S, S]) -> None:
    ledger, allocator, clock, forgotten = make()
    entry = ledger.open("r", 100)
    held = len(entry.pages)
    for state in PATHS[edge]:
        clock.now += 1
        ledger.move("r", state)
    assert [s for s, _ in entry.history] == [S.RESERVED, *PATHS[edge]]
    target = edge[1]
    if target is S.FREE:
        assert ledger.get("r") is None and ledger.by_imm(entry.imm) is None
        assert allocator.free_pages == 64 and ledger.free_slots == 4
        assert forgotten[-1] == entry.imm
    elif target is S.FENCED:
        # Pages out of the pool and not reusable; deadline is the fence; the count forgotten.
        assert allocator.free_pages == 64 - held and allocator.quarantined_pages == held
        assert entry.deadline == clock.now + FENCE_S and forgotten == [entry.imm]
    elif target in (S.RECEIVING,):
        assert entry.deadline == 100.0 + TTL_S  # the TTL keeps running
    else:
        assert entry.deadline is None and allocator.reserved_pages == held


@pytest.mark.parametrize("source", list(S), ids=lambda s: s.value)
def test_every_illegal_transition_raises(source: S) -> None:
    for target in S:
        if target in TRANSITIONS[source] or source is S.FREE:
            continue
        ledger, allocator, _, _ = make()
        ledger.open("r", 20)
        for state in PATHS.get((S.CANCELLED, S.FENCED) if source is S.FENCED else (S.RESERVED, source), []) \
                if source is not S.RESERVED else []:
            ledger.move("r", state)
        assert ledger.get("r").state is source
        with pytest.raises(IllegalTransition, match=f"{source.value} -> {target.value}"):
            ledger.move("r", target)
        assert ledger.get("r").state is source  # nothing changed
    if source is S.FREE:
        ledger, _, _, _ = make()
        ledger.open("r", 20)
        ledger.end("r", S.CANCELLED, writer_stopped=True)
        with pytest.raises(KeyError):
            ledger.move("r", S.RESERVED)


def test_ttl_and_fence_deadlines_are_due() -> None:
    ledger, _, clock, _ = make()
    ledger.open("waits", 20)
    ledger.open("fenced", 20)
    ledger.end("fenced", S.CANCELLED, writer_stopped=False)
    assert ledger.due() == []
    clock.now += TTL_S
    assert [e.request_id for e in ledger.due()] == ["waits"]
    clock.now += FENCE_S - TTL_S
    assert sorted(e.request_id for e in ledger.due()) == ["fenced", "waits"]


def test_end_frees_or_fences_by_what_is_known() -> None:
    ledger, allocator, _, _ = make()
    ledger.open("stopped", 20)
    assert ledger.end("stopped", S.FAILED, writer_stopped=True).state is S.FREE
    ledger.open("unknown", 20)
    assert ledger.end("unknown", S.FAILED, writer_stopped=False).state is S.FENCED
    assert ledger.writer_stopped("unknown").state is S.FREE
    ledger.open("admitted", 20)
    ledger.move("admitted", S.ADMITTED)
    assert ledger.writer_stopped("admitted") is None  # a confirmation does not end a request
    assert ledger.end("admitted", S.CANCELLED, writer_stopped=False).state is S.FREE  # all its writes landed
    assert allocator.free_pages == 64


def test_slots_are_fifo_and_each_reuse_is_a_new_epoch() -> None:
    ledger, _, _, _ = make(slots=2)
    a = ledger.open("a", 1)
    b = ledger.open("b", 1)
    with pytest.raises(NoSlotError):
        ledger.open("c", 1)
    ledger.end("a", S.CANCELLED, writer_stopped=True)
    ledger.end("b", S.CANCELLED, writer_stopped=True)
    c = ledger.open("c", 1)
    assert c.slot == a.slot and decode_imm(c.imm) == (a.slot, a.generation + 1)
    assert c.imm != a.imm and ledger.by_imm(a.imm) is None  # a late write of "a" counts for nobody
    assert len({a.imm, b.imm, c.imm}) == 3


@pytest.mark.parametrize("edge", sorted(PATHS, key=lambda e: (e[0].value, e[1].value)),
                         ids=lambda e: f"{e[0].value}-{e[1].value}")
def test_writes_are_closed_exactly_once_when_a_reservation_stops_waiting(edge: tuple[S, S]) -> None:
    closed: list[str] = []
    ledger = ReservationLedger(PageAllocator(64, 16), 4, reservation_ttl_s=TTL_S, fence_timeout_s=FENCE_S,
                               close_writes=closed.append)
    ledger.open("r", 32)
    for step in PATHS[edge]:
        ledger.move("r", step)
        # Closed the moment it leaves RESERVED/RECEIVING, never while it still waits for KV.
        assert closed == ([] if step in (S.RESERVED, S.RECEIVING) else ["r"]), step


def documented_transitions() -> dict[S, frozenset[S]]:
    """The "Reservation states (decoder)" table of docs/architecture.md, as a transition map."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    section = doc.split("**Reservation states (decoder).**", 1)[1]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:  # the table is the first run of "|" lines
        if not line.startswith("|"):
            break
        rows.append(line)
    assert rows[0].replace(" ", "") == "|from|to|when|", rows[0]
    table: dict[S, set[S]] = {state: set() for state in S}
    for row in rows[2:]:  # past the header and its |---| line
        sources, targets = (cell.strip() for cell in row.strip("|").split("|")[:2])
        for source in sources.split(","):
            for target in targets.split(","):
                table[S[source.strip()]].add(S[target.strip()])
    return {state: frozenset(targets) for state, targets in table.items()}


def test_the_documented_table_is_the_code_table() -> None:
    # docs/architecture.md says which transitions exist; the ledger enforces TRANSITIONS.
    # One edge added or removed on either side (doc or code) fails here.
    assert documented_transitions() == TRANSITIONS


def make_stalling(stall_s: float) -> tuple[ReservationLedger, Clock]:
    clock = Clock()
    ledger = ReservationLedger(PageAllocator(64, 16), 4, reservation_ttl_s=TTL_S, fence_timeout_s=FENCE_S,
                               stall_timeout_s=stall_s, clock=clock)
    return ledger, clock


def test_progress_moves_a_reservation_to_receiving_and_restarts_its_stall_deadline() -> None:
    ledger, clock = make_stalling(3.0)
    entry = ledger.open("r", 20)
    assert (entry.deadline, entry.deadline_setting) == (103.0, DeadlineSetting.STALL)
    clock.now += 2
    assert ledger.progress("r", 0) is False and entry.state is S.RESERVED  # nothing counted yet
    assert ledger.progress("r", 4) is True and entry.state is S.RECEIVING
    assert (entry.landed, entry.progress_at, entry.deadline) == (4, 102.0, 105.0)
    clock.now += 2.5
    assert ledger.progress("r", 4) is False and ledger.due() == []  # the same count is no progress
    clock.now += 0.5
    assert [e.request_id for e in ledger.due()] == ["r"] and entry.deadline_setting is DeadlineSetting.STALL


def test_writes_that_keep_landing_still_end_at_the_reservation_ttl() -> None:
    ledger, clock = make_stalling(3.0)
    entry = ledger.open("r", 20)
    for landed in range(1, 8):
        clock.now += 2
        ledger.progress("r", landed)
    # 114 would be the stall bound; the TTL (110) comes first and is named.
    assert (entry.deadline, entry.deadline_setting) == (100.0 + TTL_S, DeadlineSetting.RESERVATION_TTL)
    assert [e.request_id for e in ledger.due()] == ["r"]


def test_a_gone_writer_cuts_the_fence_and_never_lengthens_it() -> None:
    ledger, clock = make_stalling(3.0)
    ledger.open("r", 20)
    assert ledger.writer_gone("r", 0.2) is None  # still waiting: nothing to cut
    entry = ledger.end("r", S.FAILED, writer_stopped=False, reason="stalled")
    assert (entry.deadline, entry.deadline_setting) == (100.0 + FENCE_S, DeadlineSetting.FENCE)
    clock.now += 1
    ledger.writer_gone("r", 0.2)
    assert (entry.deadline, entry.deadline_setting, entry.writer_gone) == (101.2, DeadlineSetting.WRITER_GONE, True)
    ledger.writer_gone("r", 50.0)
    assert entry.deadline == 101.2
    ledger.move("r", S.FREE, "fence passed")
    assert entry.reason == "stalled"  # why it ended, not how it was freed


class RecordingPages:
    """A page source that is not the allocator (as the vLLM connector's): records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def reserve(self, request_id: str, num_tokens: int, prefix: Sequence[bytes]) -> list[int]:
        self.calls.append(("reserve", request_id))
        return [7, 9]

    def held_pages(self, request_id: str) -> int:
        return 0

    def free(self, request_id: str) -> None:
        self.calls.append(("free", request_id))

    def release_after_quiesce(self, request_id: str) -> None:
        self.calls.append(("release_after_quiesce", request_id))

    def confirm_quiesced(self, request_id: str) -> None:
        self.calls.append(("confirm_quiesced", request_id))


def test_any_page_source_is_driven_through_the_same_transitions() -> None:
    pages = RecordingPages()
    ledger = ReservationLedger(pages, 2, reservation_ttl_s=TTL_S, fence_timeout_s=FENCE_S)
    assert ledger.open("admitted", 0).pages == [7, 9]
    ledger.open("fenced", 0)
    ledger.move("admitted", S.ADMITTED)
    ledger.move("admitted", S.FREE)
    ledger.end("fenced", S.CANCELLED, writer_stopped=False)
    ledger.writer_stopped("fenced")
    assert pages.calls == [("reserve", "admitted"), ("reserve", "fenced"), ("free", "admitted"),
                           ("release_after_quiesce", "fenced"), ("confirm_quiesced", "fenced")]


CONFIRM_S = 5.0


def make_confirming() -> tuple[ReservationLedger, Clock, list[str], list[str]]:
    """A ledger that keeps a cancelled entry's writes open for CONFIRM_S; what it closed and
    what its page source freed, in order, in one list each."""
    clock = Clock()
    closed: list[str] = []
    events: list[str] = []

    class Pages(PageAllocator):
        def confirm_quiesced(self, request_id: str) -> None:
            events.append(f"free {request_id}")
            super().confirm_quiesced(request_id)

    ledger = ReservationLedger(Pages(64, 16), 4, reservation_ttl_s=TTL_S, fence_timeout_s=FENCE_S,
                               cancel_confirm_timeout_s=CONFIRM_S, clock=clock,
                               close_writes=lambda rid: (closed.append(rid), events.append(f"close {rid}")))
    return ledger, clock, closed, events


def test_a_cancel_kept_open_closes_its_writes_at_the_confirmation_just_before_its_pages_go_back() -> None:
    ledger, clock, closed, events = make_confirming()
    ledger.open("r", 32)
    entry = ledger.end("r", S.CANCELLED, writer_stopped=False, keep_writes_open=True)
    assert entry.state is S.FENCED and entry.writes_open and closed == []
    assert (entry.deadline, entry.deadline_setting) == (100.0 + CONFIRM_S, DeadlineSetting.CANCEL_CONFIRM)
    clock.now += 1
    ledger.writer_stopped("r")
    assert events == ["close r", "free r"]


def test_a_cancel_never_confirmed_is_closed_at_its_bound_and_fenced_to_the_fence_timeout() -> None:
    ledger, clock, closed, events = make_confirming()
    ledger.open("r", 32)
    entry = ledger.end("r", S.FAILED, writer_stopped=False, keep_writes_open=True)
    clock.now += CONFIRM_S + 0.1
    assert ledger.due() == [entry]
    assert ledger.revoke_writes("r") is entry and closed == ["r"]
    assert (entry.deadline, entry.deadline_setting) == (100.0 + FENCE_S, DeadlineSetting.FENCE)
    assert ledger.revoke_writes("r") is None  # once only
    clock.now = 100.0 + FENCE_S
    ledger.move("r", S.FREE)
    assert closed == ["r"] and events == ["close r", "free r"]


def test_a_gone_writer_closes_writes_kept_open_before_its_short_fence_starts() -> None:
    ledger, clock, closed, _ = make_confirming()
    ledger.open("r", 32)
    ledger.end("r", S.CANCELLED, writer_stopped=False, keep_writes_open=True)
    clock.now += 1
    entry = ledger.writer_gone("r", 0.5)
    assert entry is not None and closed == ["r"] and not entry.writes_open
    assert (entry.deadline, entry.deadline_setting) == (101.5, DeadlineSetting.WRITER_GONE)


def test_writes_are_kept_open_only_where_a_bound_is_set_and_the_writer_may_still_write() -> None:
    ledger, _, closed, _ = make_confirming()
    ledger.open("stopped", 32)
    assert ledger.end("stopped", S.FAILED, writer_stopped=True, keep_writes_open=True).state is S.FREE
    assert closed == ["stopped"]  # the prefiller's word came first: nothing to wait for
    plain, _, _, _ = make()
    plain.open("r", 32)
    with pytest.raises(ValueError, match="cancel_confirm_timeout_s"):
        plain.move("r", S.CANCELLED, keep_writes_open=True)
    with pytest.raises(ValueError, match="cancel_confirm_timeout_s"):
        ReservationLedger(PageAllocator(64, 16), 4, reservation_ttl_s=TTL_S, fence_timeout_s=FENCE_S,
                          cancel_confirm_timeout_s=FENCE_S + 1)
