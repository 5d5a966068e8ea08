"""Pages of device (CUDA) memory over the fabric, through pinned host staging buffers.

Debian's libfabric (1.17) is built without FI_HMEM's CUDA support, and the TCP-class
providers could not register device memory anyway, so `TransferEngine.register` takes host
memory only. A KV cache on a GPU still moves with one-sided writes this way:

- the sender (`DevicePageSender`, the prefiller) gathers the pages on the device, copies
  them into a ring of slots in pinned host memory registered with its engine, and posts one
  paged write per chunk from those slots into the receiver's landing pages (or one piece of
  each page, a head slice for a peer of another tensor parallel size, packed in the slots).
  Chunks pipeline: while chunk k is on the fabric, chunk k+1 is copied off the device;
- the receiver (`DevicePageReceiver`, the decoder) registers pinned host landing pages. Its
  ImmCounter admits the request exactly as for host memory (one count per page, however the
  pages were chunked), then `land()` copies the landing pages into the device cache.

Both sides order their copies after the work already queued on the caller's CUDA stream (the
layer that wrote the KV, the decode step that reads it) and wait only for their own copy's
event, never for the whole device. With a CPU tensor as the "device" cache every step runs
the same way with host copies, which is how the CPU-only test suite exercises this module.

A staging slot is reused only after the write that read it completed. A write that failed or
timed out may still have parts on the fabric (the engine fails a transfer at its first
failed part), so its slots are quarantined for the sender's lifetime: they are counted
(`quarantined_pages`), never reused, and a sender that runs out of room says so
(`StagingExhausted`) instead of waiting.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from kvxfer.errors import BoundsError, EngineError, KvxferError, TransferError, TransferTimeout
from kvxfer.transfer.engine import page_array

if TYPE_CHECKING:
    from kvxfer.transfer.engine import RegisteredMemory, Transfer, TransferEngine

#: Pages copied off the device and posted as one paged write. Small enough that the first
#: write leaves while later chunks are still being copied; large enough that a chunk's event
#: wait and post cost little next to its bytes (64 x 16 KiB = 1 MiB per chunk).
DEFAULT_CHUNK_PAGES = 64
#: How long `push` waits for one chunk's staging slots to come free (earlier writes still in
#: flight), seconds.
DEFAULT_STAGING_WAIT_S = 30.0


class StagingExhausted(KvxferError):
    """No staging slots came free in time, or too many are quarantined for a chunk to fit."""


def page_rows(cache: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """`cache` as a 2-D uint8 tensor of pages: row p is page p's bytes.

    The cache must be contiguous and a whole number of pages long; any dtype is viewed as
    its bytes (a KV cache of bf16 blocks is pages of 2-byte elements)."""
    if not isinstance(cache, torch.Tensor):
        raise BoundsError(f"the cache must be a torch tensor, got {type(cache).__name__}")
    if not cache.is_contiguous():
        raise BoundsError("the cache must be contiguous")
    if page_bytes <= 0:
        raise BoundsError(f"page_bytes must be positive, got {page_bytes}")
    total = cache.numel() * cache.element_size()
    if total == 0 or total % page_bytes:
        raise BoundsError(f"the cache holds {total} bytes, not a whole number of {page_bytes}-byte pages")
    return cache.reshape(-1).view(torch.uint8).view(total // page_bytes, page_bytes)


def host_staging_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host memory for `nbytes` of staging: pinned (page-locked) when the device is a GPU, so
    its copies run as DMA without a bounce of CUDA's own; plain memory for a CPU cache."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _indices(pages: Any, name: str, limit: int) -> np.ndarray:
    """Page indices as int64, each checked against `limit` before anything is copied."""
    arr = page_array(pages, name)
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        bad = int(arr[(arr < 0) | (arr >= limit)][0])
        raise BoundsError(f"{name}: page {bad} outside 0..{limit - 1}")
    return arr


class _CopyFence:
    """Waits for the copies queued so far on the caller's stream, and no other work."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device

    def wait(self) -> None:
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
            event.synchronize()


@dataclass
class _SlotLease:
    """Slots [start, start + count) of the ring, read by `transfer` until it completes."""

    start: int
    count: int
    transfer: "Transfer"

    def overlaps(self, start: int, count: int) -> bool:
        return self.start < start + count and start < self.start + self.count


class StagingRing:
    """Hands out runs of consecutive staging slots in ring order, each reused only after the
    write that read it completed; slots of failed writes are never reused.

    Leases are kept oldest first, and the oldest writes finish first, so a new run waits
    for the leases in front of it in that order. Single-threaded: one sender owns it.
    """

    def __init__(self, slots: int) -> None:
        if slots <= 0:
            raise BoundsError(f"a staging ring needs at least one slot, got {slots}")
        self.slots = slots
        self._head = 0
        self._leases: deque[_SlotLease] = deque()
        self._quarantined: list[tuple[int, int]] = []

    @property
    def quarantined_slots(self) -> int:
        """Slots held by writes that failed or timed out: never reused."""
        return sum(count for _, count in self._quarantined)

    @property
    def leased_slots(self) -> int:
        """Slots whose writes may still be reading them."""
        return sum(lease.count for lease in self._leases)

    def acquire(self, count: int, deadline_s: float) -> int:
        """The first slot of `count` free consecutive slots; waits for in-flight writes until
        `deadline_s` (time.monotonic()), then raises StagingExhausted."""
        if count > self.slots:
            raise BoundsError(f"a chunk of {count} pages does not fit {self.slots} staging slots")
        start = self._place(count)
        while any(lease.overlaps(start, count) for lease in self._leases):
            # Retire the oldest lease first, whichever one overlaps: writes finish about in
            # the order they were posted, and releasing in that order keeps the ring FIFO.
            self._retire_oldest(deadline_s)
            start = self._place(count)
        self._head = start + count
        return start

    def lease(self, start: int, count: int, transfer: "Transfer") -> None:
        """Records that `transfer` reads slots [start, start + count) until it completes."""
        self._leases.append(_SlotLease(start, count, transfer))

    def reap(self) -> None:
        """Releases the leases whose writes completed, oldest first, without waiting."""
        while self._leases and self._leases[0].transfer.done():
            self._release(self._leases.popleft())

    def drain(self, deadline_s: float) -> None:
        """Waits until no write reads any slot (each failed one quarantined)."""
        while self._leases:
            self._retire_oldest(deadline_s)

    def _place(self, count: int) -> int:
        """Where a run of `count` starts: at the head, after any quarantined range it would
        cross, wrapping to 0 at the end of the ring."""
        start = self._head
        for _ in range(len(self._quarantined) + 2):
            if start + count > self.slots:
                start = 0
            crossed = [q for q in self._quarantined if q[0] < start + count and start < q[0] + q[1]]
            if not crossed:
                return start
            start = max(q[0] + q[1] for q in crossed)
        raise StagingExhausted(f"no run of {count} staging slots is free of quarantined ones "
                               f"({self.quarantined_slots} of {self.slots} slots held by failed writes)")

    def _retire_oldest(self, deadline_s: float) -> None:
        lease = self._leases[0]
        remaining = deadline_s - time.monotonic()
        try:
            lease.transfer.wait(max(remaining, 0.0))
        except TransferTimeout:
            if not lease.transfer.done():  # our wait ran out, the write is still going
                raise StagingExhausted(f"staging slots still read by in-flight writes after the "
                                       f"staging wait ({lease.count} slots at {lease.start})") from None
        except TransferError:
            pass  # finished, failed: _release quarantines it; its own push reports the error
        self._release(self._leases.popleft())

    def _release(self, lease: _SlotLease) -> None:
        if not lease.transfer.done():
            raise EngineError("internal: releasing staging slots of a write still in flight")
        try:
            lease.transfer._raise_if_failed()
        except TransferError:
            self._quarantined.append((lease.start, lease.count))


class StagedPush:
    """The writes of one `DevicePageSender.push`: one per chunk. The receiver's count for the
    push's immediate grows by one per page, as for a single paged write."""

    def __init__(self, transfers: list["Transfer"], pages: int, nbytes: int) -> None:
        self.transfers = transfers
        self.pages = pages
        self.bytes = nbytes

    def done(self) -> bool:
        """True once every chunk's write finished, successfully or not."""
        return all(t.done() for t in self.transfers)

    def wait(self, timeout: float = 30.0) -> None:
        """Blocks until every chunk's write completed; raises TransferError/TransferTimeout
        (the first failure) at the deadline, like `Transfer.wait`."""
        deadline = time.monotonic() + timeout
        for transfer in self.transfers:
            transfer.wait(max(deadline - time.monotonic(), 0.0))


class DevicePageSender:
    """Pushes pages of a device cache into a peer's registered pages (see the module doc).

    engine: the sender's TransferEngine. cache: the device (or CPU) tensor holding the pages.
    page_bytes: bytes per page, both here and at the receiver. staging_pages: slots of pinned
    host memory (staging_pages * page_bytes bytes, registered once). chunk_pages: pages per
    write (DEFAULT_CHUNK_PAGES). staging_wait_s: how long a push waits for one
    chunk's slots to come free. One thread pushes through a sender (its ring has no lock).
    """

    def __init__(self, engine: "TransferEngine", cache: torch.Tensor, page_bytes: int, *,
                 staging_pages: int = 1024, chunk_pages: int = DEFAULT_CHUNK_PAGES,
                 staging_wait_s: float = DEFAULT_STAGING_WAIT_S) -> None:
        if chunk_pages <= 0 or chunk_pages > staging_pages:
            raise BoundsError(f"chunk_pages must be 1..staging_pages ({staging_pages}), got {chunk_pages}")
        self._engine = engine
        self._pages = page_rows(cache, page_bytes)
        self.device = cache.device
        self.page_bytes = page_bytes
        self.chunk_pages = chunk_pages
        self.staging_wait_s = staging_wait_s
        self._staging = host_staging_buffer(staging_pages * page_bytes, self.device)
        self._region: "RegisteredMemory" = engine.register(self._staging)  # keeps it alive
        self._ring = StagingRing(staging_pages)
        self._fence = _CopyFence(self.device)

    @property
    def quarantined_pages(self) -> int:
        """Staging slots held for good by writes that failed or timed out."""
        return self._ring.quarantined_slots

    def push(self, src_pages: Sequence[int] | np.ndarray | torch.Tensor, remote_descriptor: bytes,
             dst_pages: Sequence[int] | np.ndarray | torch.Tensor, *, dst_offset: int = 0,
             dst_stride: int | None = None, imm: int | None = None, request_id: Any = None,
             src_column: int = 0, length: int | None = None) -> StagedPush:
        """Writes cache page src_pages[i] to the receiver's page dst_pages[i] for every i;
        with `src_column` and `length`, only bytes [src_column, src_column + length) of
        each page (a head slice of a block, for a peer of another tensor parallel size).

        Every index is checked before anything is copied or posted (destination pages
        against the receiver's region). Returns once every chunk is posted; wait on the
        result."""
        length = self.page_bytes if length is None else length
        if length <= 0 or src_column < 0 or src_column + length > self.page_bytes:
            raise BoundsError(f"bytes {src_column}..{src_column + length} are not a piece of a "
                              f"{self.page_bytes}-byte page")
        src = _indices(src_pages, "src_pages", self._pages.shape[0])
        # Checked whole against the receiver's region here, so a bad page list posts no
        # chunk; the engine checks each chunk again (and a windows descriptor's windows).
        stride = length if dst_stride is None else dst_stride
        remote_length = self._engine.remote_length(remote_descriptor)
        dst = _indices(dst_pages, "dst_pages", max((remote_length - dst_offset - length) // stride + 1, 0))
        if src.size != dst.size:
            raise BoundsError(f"src_pages has {src.size} pages, dst_pages {dst.size}")
        transfers = []
        self._ring.reap()
        pieces = self._pages[:, src_column:src_column + length]
        for first in range(0, src.size, self.chunk_pages):
            chunk_src = src[first:first + self.chunk_pages]
            n = chunk_src.size
            # The wait is per chunk: a long push that keeps moving never times out.
            slot = self._ring.acquire(n, time.monotonic() + self.staging_wait_s)
            # Gather on the device, then one contiguous copy into the slots, the pieces
            # packed from the first slot's start (a piece is never longer than a slot);
            # ordered after whatever the caller's stream already holds (the layer that
            # wrote these pages).
            index = torch.from_numpy(chunk_src).to(self.device, non_blocking=True)
            start = slot * self.page_bytes
            packed = self._staging[start:start + n * length].view(n, length)
            packed.copy_(pieces.index_select(0, index), non_blocking=True)
            self._fence.wait()
            transfer = self._engine.write_paged(
                self._region, np.arange(n, dtype=np.int64), remote_descriptor, dst[first:first + n], length,
                src_stride=length, src_offset=start, dst_stride=dst_stride, dst_offset=dst_offset,
                imm=imm, request_id=request_id)
            self._ring.lease(slot, n, transfer)
            transfers.append(transfer)
        return StagedPush(transfers, int(src.size), int(src.size) * length)

    def close(self, timeout: float = DEFAULT_STAGING_WAIT_S) -> None:
        """Waits for in-flight writes (bounded), then deregisters the staging memory. A write
        still in flight when the wait ends, or a failed one that may still have parts on the
        fabric (quarantined slots), keeps the memory registered and alive for good."""
        try:
            self._ring.drain(time.monotonic() + timeout)
        except StagingExhausted:
            return  # a write may still read it: leak the registration rather than free it
        if not self._ring.quarantined_slots:
            self._engine.deregister(self._region)


class DevicePageReceiver:
    """Pinned host landing pages for a device cache (see the module doc).

    engine: the receiver's TransferEngine. cache: the device (or CPU) tensor the pages end
    in. page_bytes: bytes per page. landing_pages: how many pages may be landing at once;
    hand peers `descriptor` (or windows of `region`, `TransferEngine.register_windows`).
    """

    def __init__(self, engine: "TransferEngine", cache: torch.Tensor, page_bytes: int, *,
                 landing_pages: int) -> None:
        if landing_pages <= 0:
            raise BoundsError(f"landing_pages must be positive, got {landing_pages}")
        self._engine = engine
        self._pages = page_rows(cache, page_bytes)
        self.device = cache.device
        self.page_bytes = page_bytes
        landing = host_staging_buffer(landing_pages * page_bytes, self.device)
        self._landing_rows = landing.view(landing_pages, page_bytes)
        self.region: "RegisteredMemory" = engine.register(landing)  # keeps it alive
        self._fence = _CopyFence(self.device)

    @property
    def descriptor(self) -> bytes:
        """What a sender writes the landing pages with (page p at offset p * page_bytes)."""
        return self.region.descriptor

    def land(self, landing_pages: Sequence[int] | np.ndarray, cache_pages: Sequence[int] | np.ndarray) -> None:
        """Copies landing page landing_pages[i] into cache page cache_pages[i], after the
        ImmCounter admitted the push (the caller's wait_imm). Returns once the copy is done,
        so the landing pages may be handed out again.

        Runs of consecutive landing pages go to the device as one copy each (straight from
        pinned memory), then into their cache pages with one indexed copy per run."""
        src = _indices(landing_pages, "landing_pages", self._landing_rows.shape[0])
        dst = _indices(cache_pages, "cache_pages", self._pages.shape[0])
        if src.size != dst.size:
            raise BoundsError(f"landing_pages has {src.size} pages, cache_pages {dst.size}")
        if not src.size:
            return
        breaks = np.flatnonzero(np.diff(src) != 1) + 1
        for run_src, run_dst in zip(np.split(src, breaks), np.split(dst, breaks)):
            first = int(run_src[0])
            rows = self._landing_rows[first:first + run_src.size].to(self.device, non_blocking=True)
            index = torch.from_numpy(run_dst).to(self.device, non_blocking=True)
            self._pages.index_copy_(0, index, rows)
        self._fence.wait()

    def close(self) -> None:
        """Deregisters the landing pages; no write may be headed for them any more."""
        self._engine.deregister(self.region)
