"""Host memory that same-host peers can map: buffers kept in a memfd.

A `TransferEngine` writing to a region on this machine copies with process_vm_writev
(the kernel pins and dirties every 4 KiB page, about half the speed of memcpy), unless the
region lives in a file the writer can map; then a write is a plain memcpy into the mapping.
`SharedBuffer` makes such memory: an anonymous memfd mapped here. Any numpy array or torch
tensor viewing it registers as shareable, since `register()` looks the address up here.
The KV cache allocates its tensor this way.

The mapping sits at a 2 MiB-aligned address, so that the file's 2 MiB blocks line up
with the address space: only then can registration turn them into huge pages
(MADV_COLLAPSE works on a memfd even where shmem_enabled is never), for this process and
for the peers that map it. Python's `mmap` cannot ask for an address, so it is mapped
with libc's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

_HUGE_PAGE_BYTES = 2 << 20
_PAGE_BYTES = mmap.PAGESIZE
# Linux's values on x86-64 and arm64; Python's mmap module names none of them.
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _map_at_huge_boundary(fd: int, nbytes: int) -> Any:
    """Maps all of `fd` (`nbytes`) shared and writable at a 2 MiB-aligned address; returns
    a ctypes byte array over it, which unmaps it once the last view of it is gone."""
    length = _round_up(nbytes, _PAGE_BYTES)
    span = length + _HUGE_PAGE_BYTES
    # Reserve address space with room to align, map the file over its aligned part, then
    # give back the ends.
    reserved = _libc.mmap(None, span, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if reserved in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"reserving {span} bytes of address space: {os.strerror(err)}")
    start = _round_up(reserved, _HUGE_PAGE_BYTES)
    mapped = _libc.mmap(start, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if mapped != start:
        err = ctypes.get_errno()
        _libc.munmap(reserved, span)
        raise OSError(err, f"mapping the memfd ({nbytes} bytes): {os.strerror(err)}")
    if start > reserved:
        _libc.munmap(reserved, start - reserved)
    if reserved + span > start + length:
        _libc.munmap(start + length, reserved + span - (start + length))
    memory = (ctypes.c_ubyte * nbytes).from_address(start)
    weakref.finalize(memory, _libc.munmap, start, length)
    return memory


class SharedBuffer:
    """`nbytes` of zeroed host memory in a memfd, mapped into this process.

    `array` is a writable uint8 view of it; `torch(dtype, shape)` gives a tensor view. Like
    a file, it stays open (peers open the memfd through /proc/<pid>/fd, and only those that
    pass the engine's checks may map it) until `close()` or the end of the process; views
    keep the memory itself alive after that.
    """

    def __init__(self, nbytes: int, name: str = "kvxfer-region") -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"SharedBuffer size must be a positive int, got {nbytes!r}")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._map = _map_at_huge_boundary(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        _live.add(self)

    def torch(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        """A torch tensor of `dtype` and `shape` over the start of this buffer."""
        import torch

        return torch.frombuffer(self._map, dtype=dtype).view(shape)

    def close(self) -> None:
        """Closes the memfd (peers can no longer map it; regions registered from it keep
        working over process_vm_writev); the memory lives on while views of it exist."""
        if self.fd >= 0:
            _live.discard(self)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SharedBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LiveBuffers:
    """Open SharedBuffers by address range, for register() to recognise their views. Holds
    them until closed, so a caller may keep only a view."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: set[SharedBuffer] = set()

    def add(self, buf: SharedBuffer) -> None:
        with self._lock:
            self._buffers.add(buf)

    def discard(self, buf: SharedBuffer) -> None:
        with self._lock:
            self._buffers.discard(buf)

    def find(self, addr: int, length: int) -> SharedBuffer | None:
        """The open buffer holding [addr, addr+length), if any."""
        with self._lock:
            for buf in self._buffers:
                if buf.fd >= 0 and buf.address <= addr and addr + length <= buf.address + buf.nbytes:
                    return buf
        return None


_live = _LiveBuffers()


def shared_buffer_of(addr: int, length: int) -> SharedBuffer | None:
    """The open SharedBuffer that [addr, addr+length) lies in, if any."""
    return _live.find(addr, length)
