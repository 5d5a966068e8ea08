"""The byte ranges a reservation's own registration covers (kv.write_windows)."""

from __future__ import annotations

import pytest

from kvxfer.kv.layout import layer_offset_bytes
from kvxfer.kv.write_windows import MAX_WINDOWS, page_runs, reservation_windows

PAGE_BYTES, NUM_PAGES = 4096, 100


def covered_pages(windows: list[tuple[int, int]], layer: int) -> set[int]:
    base = layer_offset_bytes(layer, NUM_PAGES, PAGE_BYTES)
    return {(offset - base) // PAGE_BYTES + i for offset, length in windows
            if base <= offset < base + NUM_PAGES * PAGE_BYTES for i in range(length // PAGE_BYTES)}


def test_runs_of_consecutive_pages_are_merged_in_id_order() -> None:
    assert page_runs([7, 3, 4, 5, 9, 8, 20]) == [(3, 3), (7, 3), (20, 1)]


def test_windows_cover_exactly_the_reserved_pages_of_every_layer() -> None:
    pages = [10, 11, 12, 40, 41, 99]
    windows = reservation_windows(pages, num_layers=3, num_pages=NUM_PAGES, page_bytes=PAGE_BYTES)
    assert len(windows) == 3 * 3
    assert windows == sorted(windows)
    for layer in range(3):
        assert covered_pages(windows, layer) == set(pages)


def test_a_fragmented_reservation_falls_back_to_one_span_per_layer() -> None:
    pages = list(range(0, 2 * (MAX_WINDOWS // 2 + 1), 2))  # no two pages adjacent
    windows = reservation_windows(pages, num_layers=2, num_pages=10 * MAX_WINDOWS, page_bytes=PAGE_BYTES)
    assert len(windows) == 2
    assert windows[0] == (pages[0] * PAGE_BYTES, (pages[-1] + 1 - pages[0]) * PAGE_BYTES)


def test_no_pages_is_an_error() -> None:
    with pytest.raises(ValueError):
        reservation_windows([], 2, NUM_PAGES, PAGE_BYTES)
