"""Host memory that same-host peers can map: buffers kept in a memfd.

A `TransferEngine` writing to a region on this machine copies with process_vm_writev
(the kernel pins and dirties every 4 KiB page, about half the speed of memcpy), unless the
region lives in a file the writer can map; then a write is a plain memcpy into the mapping.
`SharedBuffer` makes such memory: an anonymous memfd mapped here. Any numpy array or torch
tensor viewing it registers as shareable, since `register()` looks the address up here.
The KV cache allocates its tensor this way.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np


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
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
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
