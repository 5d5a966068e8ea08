"""What pinning memory costs this kernel: the part of an RDMA registration that a machine
without an RDMA NIC can still measure.

ibv_reg_mr (libfabric's verbs provider; EFA registers the same way) pins every page of the
range with the kernel's long-term pin (pin_user_pages with FOLL_LONGTERM, in ib_umem_get)
and then writes the page addresses into the NIC's translation table. io_uring's fixed
buffers (IORING_REGISTER_BUFFERS) pin with the same kernel call and write no NIC, so
timing their registration and unregistration gives the kernel's share of an RDMA
registration and deregistration: a lower bound of what one costs there. The NIC's share
is not measured here (no such NIC).

`PinTimer().pin_unpin_s(ranges)` times one pin and one unpin of a list of
(address, length) ranges; `PinnableBuffer(nbytes, huge_pages)` makes populated private
memory with or without transparent huge pages, as TransferEngine's
huge_pages_on_register leaves a registered buffer. Needs root or CAP_IPC_LOCK (RLIMIT_MEMLOCK
applies otherwise) and io_uring not disabled (/proc/sys/kernel/io_uring_disabled).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

from kvxfer.transfer.registration_cost import huge_page_bytes

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_IO_URING_SETUP = 425
_SYS_IO_URING_REGISTER = 427
_IORING_REGISTER_BUFFERS = 0
_IORING_UNREGISTER_BUFFERS = 1
_IO_URING_PARAMS_BYTES = 120
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
HUGE_PAGE_BYTES = 2 << 20
#: io_uring refuses a fixed buffer longer than this (the kernel's limit per iovec).
MAX_RANGE_BYTES = 1 << 30


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class PinUnavailable(RuntimeError):
    """This kernel or process cannot pin through io_uring (disabled, or not permitted)."""


def _errno_text(what: str) -> str:
    err = ctypes.get_errno()
    return f"{what}: {os.strerror(err)} (errno {err})"


class PinTimer:
    """One io_uring instance whose fixed-buffer registration is used as the kernel's pin."""

    def __init__(self) -> None:
        params = (ctypes.c_uint8 * _IO_URING_PARAMS_BYTES)()
        fd = _libc.syscall(_SYS_IO_URING_SETUP, 1, ctypes.byref(params))
        if fd < 0:
            raise PinUnavailable(_errno_text("io_uring_setup"))
        self._fd = fd

    def pin_unpin_s(self, ranges: list[tuple[int, int]]) -> tuple[float, float]:
        """Seconds to pin every (address, length) range at once, and to unpin them. Ranges
        over io_uring's 1 GiB limit are pinned in pieces of it."""
        ranges = [(addr + off, min(MAX_RANGE_BYTES, length - off))
                  for addr, length in ranges for off in range(0, length, MAX_RANGE_BYTES)]
        iovecs = (_Iovec * len(ranges))(*[_Iovec(addr, length) for addr, length in ranges])
        t0 = time.perf_counter()
        rc = _libc.syscall(_SYS_IO_URING_REGISTER, self._fd, _IORING_REGISTER_BUFFERS, iovecs, len(ranges))
        t1 = time.perf_counter()
        if rc < 0:
            raise PinUnavailable(_errno_text("io_uring_register(IORING_REGISTER_BUFFERS)"))
        rc = _libc.syscall(_SYS_IO_URING_REGISTER, self._fd, _IORING_UNREGISTER_BUFFERS, None, 0)
        t2 = time.perf_counter()
        if rc < 0:
            raise PinUnavailable(_errno_text("io_uring_register(IORING_UNREGISTER_BUFFERS)"))
        return t1 - t0, t2 - t1

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> "PinTimer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PinnableBuffer:
    """`nbytes` of populated private memory at a 2 MiB-aligned `address`, with or without
    transparent huge pages; `huge_bytes` is how much of it the kernel gave huge pages."""

    def __init__(self, nbytes: int, huge_pages: bool) -> None:
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.address = (start + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1)
        self.nbytes = nbytes
        advice = _MADV_HUGEPAGE if huge_pages else _MADV_NOHUGEPAGE
        _libc.madvise(ctypes.c_void_p(self.address), ctypes.c_size_t(nbytes), advice)
        ctypes.memset(self.address, 1, nbytes)  # populate, as populate_on_register does
        self.huge_bytes = huge_page_bytes(self.address, nbytes)

    def close(self) -> None:
        self._map.close()
