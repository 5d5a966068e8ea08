"""Specification of the decode-side PageAllocator: reservations, quarantine, errors, thread safety."""

from __future__ import annotations

import random
import threading

import pytest

from kvxfer.errors import KvxferError
from kvxfer.kv.page_allocator import (
    DuplicateRequestError,
    OutOfPagesError,
    PageAllocationError,
    PageAllocator,
    RequestStateError,
    PageHold,
    UnknownRequestError,
)

BLOCK = 16


def test_reserve_returns_enough_pages_for_the_tokens() -> None:
    allocator = PageAllocator(12, BLOCK)
    assert len(allocator.reserve("a", 1)) == 1
    assert len(allocator.reserve("b", 16)) == 1
    assert len(allocator.reserve("c", 17)) == 2
    assert len(allocator.reserve("d", 100)) == 7
    assert allocator.capacity_tokens("d") == 112


def test_unshuffled_allocator_hands_out_pages_in_ascending_order() -> None:
    allocator = PageAllocator(6, BLOCK)
    assert allocator.reserve("a", 2 * BLOCK) == [0, 1]
    assert allocator.reserve("b", 3 * BLOCK) == [2, 3, 4]
    assert allocator.pages("a") == [0, 1]


def test_shuffled_allocator_is_deterministic_per_seed_and_not_contiguous() -> None:
    first = PageAllocator(64, BLOCK, shuffle=True, seed=5).reserve("r", 8 * BLOCK)
    again = PageAllocator(64, BLOCK, shuffle=True, seed=5).reserve("r", 8 * BLOCK)
    other = PageAllocator(64, BLOCK, shuffle=True, seed=6).reserve("r", 8 * BLOCK)
    assert first == again
    assert first != other
    assert len(set(first)) == 8
    assert any(b != a + 1 for a, b in zip(first, first[1:]))


def test_counters_follow_reserve_quarantine_confirm_and_free() -> None:
    allocator = PageAllocator(10, BLOCK)
    allocator.reserve("a", 3 * BLOCK)
    allocator.reserve("b", 2 * BLOCK)
    assert (allocator.free_pages, allocator.reserved_pages, allocator.quarantined_pages) == (5, 5, 0)
    allocator.release_after_quiesce("a")
    assert (allocator.free_pages, allocator.reserved_pages, allocator.quarantined_pages) == (5, 2, 3)
    allocator.confirm_quiesced("a")
    assert (allocator.free_pages, allocator.reserved_pages, allocator.quarantined_pages) == (8, 2, 0)
    allocator.free("b")
    assert (allocator.free_pages, allocator.reserved_pages, allocator.quarantined_pages) == (10, 0, 0)
    assert allocator.total_pages == 10


def test_out_of_pages_raises_with_counts_and_allocates_nothing() -> None:
    allocator = PageAllocator(4, BLOCK)
    allocator.reserve("a", 3 * BLOCK)
    with pytest.raises(OutOfPagesError, match="request 'b': needs 2 pages, 1 free") as info:
        allocator.reserve("b", 2 * BLOCK)
    assert (info.value.request_id, info.value.needed, info.value.available) == ("b", 2, 1)
    assert allocator.free_pages == 1
    assert "b" not in allocator
    with pytest.raises(OutOfPagesError):
        allocator.grow("a", 2 * BLOCK)
    assert allocator.pages("a") == [0, 1, 2]


def test_quarantined_pages_are_not_handed_out_until_confirmed() -> None:
    allocator = PageAllocator(4, BLOCK)
    quarantined = allocator.reserve("cancelled", 4 * BLOCK)
    allocator.release_after_quiesce("cancelled")
    with pytest.raises(OutOfPagesError):
        allocator.reserve("next", 1)
    allocator.confirm_quiesced("cancelled")
    assert sorted(allocator.reserve("next", 4 * BLOCK)) == sorted(quarantined)


def test_random_operation_sequence_never_hands_out_a_page_in_use_or_in_quarantine() -> None:
    rng = random.Random(11)
    allocator = PageAllocator(48, BLOCK, shuffle=True, seed=11)
    reserved: dict[str, list[int]] = {}
    quarantined: dict[str, list[int]] = {}
    for step in range(600):
        action = rng.choice(["reserve", "reserve", "grow", "free", "quarantine", "confirm"])
        if action == "reserve":
            request_id = f"r{step}"
            try:
                pages = allocator.reserve(request_id, rng.randrange(1, 10 * BLOCK))
            except OutOfPagesError:
                continue
            busy = {p for ps in (*reserved.values(), *quarantined.values()) for p in ps}
            assert not busy & set(pages)
            reserved[request_id] = pages
        elif action == "grow" and reserved:
            request_id = rng.choice(sorted(reserved))
            try:
                added = allocator.grow(request_id, rng.randrange(0, 3 * BLOCK))
            except OutOfPagesError:
                continue
            busy = {p for ps in (*reserved.values(), *quarantined.values()) for p in ps}
            assert not busy & set(added)
            reserved[request_id] += added
        elif action == "free" and reserved:
            request_id = rng.choice(sorted(reserved))
            allocator.free(request_id)
            del reserved[request_id]
        elif action == "quarantine" and reserved:
            request_id = rng.choice(sorted(reserved))
            allocator.release_after_quiesce(request_id)
            quarantined[request_id] = reserved.pop(request_id)
        elif action == "confirm" and quarantined:
            request_id = rng.choice(sorted(quarantined))
            allocator.confirm_quiesced(request_id)
            del quarantined[request_id]
        assert allocator.reserved_pages == sum(map(len, reserved.values()))
        assert allocator.quarantined_pages == sum(map(len, quarantined.values()))
        assert allocator.free_pages + allocator.reserved_pages + allocator.quarantined_pages == 48
        for request_id, pages in reserved.items():
            assert allocator.pages(request_id) == pages


def test_freed_pages_are_reused_only_after_the_never_used_ones() -> None:
    allocator = PageAllocator(4, BLOCK)
    allocator.reserve("a", BLOCK)  # page 0
    allocator.free("a")
    assert allocator.reserve("b", 4 * BLOCK) == [1, 2, 3, 0]


def test_grow_appends_pages_only_when_the_last_page_is_full() -> None:
    allocator = PageAllocator(8, BLOCK)
    allocator.reserve("a", 10)
    assert allocator.grow("a", 6) == []
    assert allocator.grow("a", 1) == [1]
    assert allocator.grow("a", 2 * BLOCK) == [2, 3]
    assert allocator.pages("a") == [0, 1, 2, 3]
    assert allocator.reserved_pages == 4


def test_unknown_request_id_raises_for_every_operation() -> None:
    allocator = PageAllocator(4, BLOCK)
    for call in (
        lambda: allocator.free("ghost"),
        lambda: allocator.grow("ghost", 1),
        lambda: allocator.release_after_quiesce("ghost"),
        lambda: allocator.confirm_quiesced("ghost"),
        lambda: allocator.pages("ghost"),
    ):
        with pytest.raises(UnknownRequestError, match="request 'ghost': holds no pages"):
            call()


def test_double_free_raises_unknown_request() -> None:
    allocator = PageAllocator(4, BLOCK)
    allocator.reserve("a", 1)
    allocator.free("a")
    with pytest.raises(UnknownRequestError):
        allocator.free("a")
    assert allocator.free_pages == 4


def test_reserving_an_id_that_holds_pages_raises_duplicate() -> None:
    allocator = PageAllocator(4, BLOCK)
    allocator.reserve("a", 1)
    with pytest.raises(DuplicateRequestError):
        allocator.reserve("a", 1)
    allocator.release_after_quiesce("a")
    with pytest.raises(DuplicateRequestError):
        allocator.reserve("a", 1)


def test_quarantined_request_cannot_be_freed_grown_or_quarantined_again() -> None:
    allocator = PageAllocator(4, BLOCK)
    allocator.reserve("a", 1)
    allocator.release_after_quiesce("a")
    assert allocator.state("a") is PageHold.QUARANTINED
    with pytest.raises(RequestStateError, match="cannot free: pages are quarantined"):
        allocator.free("a")
    with pytest.raises(RequestStateError):
        allocator.grow("a", 1)
    with pytest.raises(RequestStateError):
        allocator.release_after_quiesce("a")
    assert allocator.quarantined_pages == 1


def test_confirm_quiesced_on_a_reserved_request_raises_state_error() -> None:
    allocator = PageAllocator(4, BLOCK)
    allocator.reserve("a", 1)
    with pytest.raises(RequestStateError, match="cannot confirm_quiesced: pages are reserved"):
        allocator.confirm_quiesced("a")
    assert allocator.reserved_pages == 1


def test_errors_are_kvxfer_errors_carrying_the_request_id() -> None:
    for cls in (OutOfPagesError, UnknownRequestError, DuplicateRequestError, RequestStateError):
        assert issubclass(cls, PageAllocationError)
        assert issubclass(cls, KvxferError)
    error = UnknownRequestError("x", "holds no pages")
    assert error.request_id == "x"
    assert str(error) == "request 'x': holds no pages"


def test_invalid_sizes_raise_value_error() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0, BLOCK)
    allocator = PageAllocator(4, BLOCK)
    with pytest.raises(ValueError):
        allocator.reserve("a", 0)


def test_concurrent_reservations_get_disjoint_pages() -> None:
    allocator = PageAllocator(400, BLOCK, shuffle=True, seed=2)
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def worker(thread_index: int) -> None:
        try:
            for i in range(50):
                request_id = f"t{thread_index}-{i}"
                results[request_id] = allocator.reserve(request_id, 2 * BLOCK)
                if i % 2:
                    allocator.free(request_id)
                    del results[request_id]
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    held = [p for pages in results.values() for p in pages]
    assert len(held) == len(set(held)) == 4 * 25 * 2
    assert allocator.reserved_pages == len(held)
    assert allocator.free_pages == 400 - len(held)
