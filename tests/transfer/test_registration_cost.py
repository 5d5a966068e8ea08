"""The per-reservation registration cost warning: a provider that pins memory (verbs, efa)
with a region of small pages is warned about; huge pages, or a provider that does not pin,
are not. The huge-page count is read from this process's real mappings."""

from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path

import numpy as np
import pytest

from kvxfer.transfer.engine import TransferEngine
from kvxfer.transfer.registration_cost import huge_page_bytes, per_reservation_pin_warning

MIB = 1 << 20
SIZE = 32 * MIB
HUGE = 2 * MIB
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_libc = ctypes.CDLL(None, use_errno=True)

pytestmark = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                                reason="this kernel has no transparent huge pages")


def populated(huge: bool) -> tuple[mmap.mmap, int]:
    """SIZE bytes of populated private memory at a 2 MiB-aligned address, with or without
    transparent huge pages; returns the mapping (keep it alive) and the address."""
    m = mmap.mmap(-1, SIZE + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(m, dtype=np.uint8)
    start = view.ctypes.data
    addr = (start + HUGE - 1) & ~(HUGE - 1)
    _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(SIZE), _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE)
    view[addr - start: addr - start + SIZE] = 1
    return m, addr


def test_small_pages_on_a_pinning_provider_are_warned_about_and_huge_pages_are_not() -> None:
    small_map, small = populated(huge=False)
    huge_map, huge = populated(huge=True)
    assert huge_page_bytes(small, SIZE) == 0
    if huge_page_bytes(huge, SIZE) < SIZE // 2:
        pytest.skip("the kernel gave no huge pages to a madvised range (THP off or memory fragmented)")
    warning = per_reservation_pin_warning("verbs", small, SIZE)
    assert warning is not None and "0% of the registered region" in warning and "whole_cache" in warning
    assert per_reservation_pin_warning("efa", small, SIZE) is not None
    assert per_reservation_pin_warning("verbs", huge, SIZE) is None
    for provider in ("net", "tcp", "shm"):
        assert per_reservation_pin_warning(provider, small, SIZE) is None
    del small_map, huge_map


def test_huge_page_bytes_counts_only_the_asked_range() -> None:
    # One mapping, split by madvise into a huge-page half and a small-page half right after
    # it: the small half is asked about, so the count must not spill over from its
    # neighbour. (An address "past the mapping" is no test: another mapping, with huge
    # pages of its own, may sit there.)
    both = mmap.mmap(-1, 2 * SIZE + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(both, dtype=np.uint8)
    start = view.ctypes.data
    huge = (start + HUGE - 1) & ~(HUGE - 1)
    small = huge + SIZE
    _libc.madvise(ctypes.c_void_p(huge), ctypes.c_size_t(SIZE), _MADV_HUGEPAGE)
    _libc.madvise(ctypes.c_void_p(small), ctypes.c_size_t(SIZE), _MADV_NOHUGEPAGE)
    view[huge - start: huge - start + 2 * SIZE] = 1
    if huge_page_bytes(huge, SIZE) < SIZE // 2:
        pytest.skip("the kernel gave no huge pages to a madvised range")
    assert huge_page_bytes(huge, HUGE) <= HUGE
    assert huge_page_bytes(small, SIZE) == 0
    assert huge_page_bytes(small + SIZE - HUGE, HUGE) == 0
    assert huge_page_bytes(small - HUGE, 2 * HUGE) <= HUGE  # straddles the two: only the huge half counts
    del view, both


def test_register_windows_warns_once_per_engine_on_a_pinning_provider_and_never_on_tcp(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    small_map, addr = populated(huge=False)
    whole = np.frombuffer(small_map, dtype=np.uint8)
    start = addr - whole.ctypes.data
    cache = whole[start:start + 4 * MIB]  # small pages, and registered without asking for huge ones
    with TransferEngine("tcp", bind_host="127.0.0.1", huge_pages_on_register=False) as engine:
        region = engine.register(cache)
        with caplog.at_level(logging.WARNING, logger="kvxfer.transfer"):
            engine.register_windows(region, [(0, MIB)]).close()
        assert "pins memory" not in caplog.text
    # The same engine code, told its provider is verbs: no verbs NIC here, but the check
    # register_windows makes reads the provider's name and the region's real pages.
    monkeypatch.setattr(TransferEngine, "provider", property(lambda self: "verbs"))
    with TransferEngine("tcp", bind_host="127.0.0.1", huge_pages_on_register=False) as engine:
        region = engine.register(cache)
        with caplog.at_level(logging.WARNING, logger="kvxfer.transfer"):
            for _ in range(3):
                engine.register_windows(region, [(0, MIB), (2 * MIB, MIB)]).close()
    assert caplog.text.count("provider verbs pins memory at each registration") == 1
    del cache, whole, small_map
