"""Registered memory gets transparent huge pages where the kernel allows
(huge_pages_on_register): fresh memory is populated as huge pages, and memory its owner
had already filled is collapsed into them, bytes unchanged. Private memory (numpy, torch)
and SharedBuffer memory (a memfd: the KV cache) alike."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from kvxfer.transfer.engine import TransferEngine
from kvxfer.transfer.registration_cost import huge_page_bytes
from kvxfer.transfer.shared_memory import SharedBuffer

MIB = 1 << 20
SIZE = 16 * MIB

pytestmark = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                                reason="this kernel has no transparent huge pages")


def private_memory(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """Private anonymous memory, as numpy and torch allocate (no huge-page hint of its own),
    and the mapping that keeps it alive."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8)


@pytest.mark.parametrize("filled_before", [False, True], ids=["fresh", "filled-by-its-owner"])
def test_registration_gives_private_memory_huge_pages_and_keeps_its_bytes(filled_before: bool) -> None:
    _mapping, buf = private_memory(SIZE)
    pattern = (np.arange(SIZE, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    if filled_before:
        buf[:] = pattern  # a KV cache its engine already wrote: 4 KiB pages until collapsed
    with TransferEngine(provider="net", bind_host="127.0.0.1", lock_on_register=False) as engine:
        engine.register(buf)
        huge = huge_page_bytes(buf.ctypes.data, SIZE)
    if filled_before:
        assert np.array_equal(buf, pattern), "collapsing changed the bytes"
    assert huge >= SIZE - 4 * MIB, f"{huge} of {SIZE} bytes in huge pages"  # ends not 2 MiB-aligned


def shmem_collapse_refused() -> bool:
    """True where the kernel refuses huge pages to shmem even on request (MADV_COLLAPSE)."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    return not setting.exists() or "[deny]" in setting.read_text()


@pytest.mark.skipif(shmem_collapse_refused(), reason="shmem_enabled is deny: no huge pages for a memfd")
@pytest.mark.parametrize("filled_before", [False, True], ids=["fresh", "filled-by-its-owner"])
def test_registration_gives_a_shared_buffer_huge_pages_and_keeps_its_bytes(filled_before: bool) -> None:
    # A memfd gets no huge pages at fault where shmem_enabled is never, but MADV_COLLAPSE
    # makes them, and only where the file's 2 MiB blocks sit at 2 MiB-aligned addresses.
    # A size that is no multiple of 2 MiB (as KV caches are) leaves the kernel's own
    # placement of the mapping unaligned.
    shared = SharedBuffer(SIZE + 4096)
    pattern = (np.arange(SIZE, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    if filled_before:
        shared.array[:SIZE] = pattern
    with TransferEngine(provider="net", bind_host="127.0.0.1", lock_on_register=False) as engine:
        engine.register(shared.array)
        huge = huge_page_bytes(shared.address, SIZE)
    if filled_before:
        assert np.array_equal(shared.array[:SIZE], pattern), "collapsing changed the bytes"
    else:
        assert not shared.array.any(), "registering wrote into fresh memory"
    assert huge == SIZE, f"{huge} of {SIZE} bytes in huge pages (buffer at {shared.address:#x})"
    shared.close()


def test_huge_pages_on_register_off_leaves_small_pages() -> None:
    _mapping, buf = private_memory(SIZE)
    with TransferEngine(provider="net", bind_host="127.0.0.1", lock_on_register=False,
                        huge_pages_on_register=False) as engine:
        engine.register(buf)
        assert huge_page_bytes(buf.ctypes.data, SIZE) == 0
