"""How a layer's blocks leave the prefiller's cache, and where the decoder's land: straight
from and into a host cache registered with the engine, or through pinned host staging for
a device (CUDA) cache (`kvxfer.transfer.device_staging`; Debian's libfabric registers host
memory only).

Both paths post the same paged writes, planned by the push's `PushPlan` over the cache's
`CacheGeometry` (kvxfer.handoff.push_plan): one per layer, each covering the request's
blocks at the caches' block strides, with one immediate per page, so the decoder's count
is layers x pages either way (the reservation's contract, `kvxfer.kv.protocol`). That
needs each (layer, block) to be one run of bytes: LBHNC, LBNHC, BLHNC, BLNHC. LHBNC and
BHLNC cut a block into one run per head and are refused here with a clear error; the
connector asks vLLM for LBHNC, which every backend that offers them offers too.
On the staged path the decoder hands out landing blocks instead of its cache blocks: a
small pinned cache of the same layout (`landing_blocks` blocks), copied into the device
cache once every write landed, and handed out again only after that. Between different
tensor parallel sizes the prefiller posts its head slice of each block (one run per block:
LBHNC, BLHNC), packed in its staging rows, and a decoder's landing blocks gather the slices
of every prefill rank its heads come from, copied to the device once, when every part of the
load landed (`KVReceiver`); MLA's latent is replicated, a whole block from one prefill rank.
With several KV cache groups each block a load names gets a landing block, every slot of it
copied (a block id names a page of one group only); Mamba/SSM state stays on host caches.
The staged classes
take any tensor, so the CPU tests drive them with host caches (`tests/integrations/
test_kv_cache_paths.py`); a device cache picks them in `KVPusher` and `KVReceiver`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvxfer.handoff.inflight_writes import InflightWrites
from kvxfer.kv.cache_geometry import CacheGeometry, GeometryError, PagedRun
from kvxfer.kv.protocol import KVReservation
from kvxfer.transfer.device_staging import DevicePageReceiver, DevicePageSender, StagedPush
from kvxfer.transfer.engine import RegisteredMemory, TransferEngine

if TYPE_CHECKING:
    from .kv_region import KVRegion
    from .sliced_reservation import SliceTarget

#: Rows of pinned staging per prefiller (one row is one run of a block: 16 MiB of 16 KiB
#: blocks): room for a few layers of a long prompt in flight while the next is copied.
DEFAULT_STAGING_ROWS = 1024
#: Blocks of pinned landing cache per decoder: bounds the prompt blocks being received at
#: once on a device cache (a load that finds no room fails with a clear reason).
DEFAULT_LANDING_BLOCKS = 256


class DirectWrites:
    """The prefiller's cache is host memory registered with the engine: each paged write
    reads it in place."""

    def __init__(self, engine: TransferEngine, memory: RegisteredMemory, geometry: CacheGeometry) -> None:
        one_run_per_block(geometry)
        self.engine, self.memory = engine, memory

    def post(self, runs: list[PagedRun], src: list[int], res: KVReservation, dst: list[int], request_id: str,
             writes: InflightWrites, target: SliceTarget | None = None) -> int:
        """Posts the planned `runs` of blocks `src` (a layer's, the heads `target` names,
        where given: `PushPlan.runs`) to the reservation's pages `dst`, tracking each write
        in `writes` as it is posted; the bytes posted."""
        posted = 0
        for run in runs:
            nbytes = len(src) * run.length
            writes.add(self.engine.write_paged(
                self.memory, src, res.descriptor, dst, run.length, src_stride=run.src_stride,
                dst_stride=run.dst_stride, src_offset=run.src_offset, dst_offset=run.dst_offset,
                imm=res.imm, request_id=request_id), nbytes)
            posted += nbytes
        return posted


class _StagedWrite:
    """One `DevicePageSender.push` as the pusher reaps it."""

    def __init__(self, push: StagedPush) -> None:
        self._push = push

    @property
    def completed_at_s(self) -> float | None:
        stamps = [t.completed_at_s for t in self._push.transfers]
        return None if not stamps or None in stamps else max(stamps)

    def done(self) -> bool:
        return bool(self._push.done())

    def wait(self, timeout: float = 30.0) -> None:
        self._push.wait(timeout)


def one_run_per_block(geometry: CacheGeometry) -> int:
    """Bytes of one (layer, block), checked to be one run of bytes (see the module doc)."""
    runs = geometry.block_runs()
    if len(runs) != 1:
        raise GeometryError(f"KV cache layout {geometry.layout} stores a block as {len(runs)} runs (one per head); "
                            "the reservation counts one write per (layer, block): use LBHNC "
                            "(VLLM_KV_CACHE_LAYOUT=LBHNC), LBNHC, BLHNC or BLNHC")
    return runs[0][1]


def _rows(geometry: CacheGeometry, blocks: list[int], row: int) -> np.ndarray:
    """Row indices of every run of `blocks` in every layer, in (layer, block, run) order."""
    rel = np.array([r for r, _ in geometry.block_runs()], dtype=np.int64)
    offsets = (np.arange(geometry.num_layers, dtype=np.int64)[:, None, None] * geometry.layer_stride
               + np.asarray(blocks, dtype=np.int64)[None, :, None] * geometry.block_stride + rel[None, None, :])
    return (offsets // row).ravel()


class StagedWrites:
    """The prefiller's cache is device memory: each planned write is copied off the device
    into pinned staging rows and posted from there (`DevicePageSender`)."""

    def __init__(self, engine: TransferEngine, region: KVRegion, *, staging_rows: int = DEFAULT_STAGING_ROWS) -> None:
        self.row = one_run_per_block(region.geometry)
        self.sender = DevicePageSender(engine, region.cache_bytes, self.row, staging_pages=staging_rows,
                                       chunk_pages=min(staging_rows, 64))

    def post(self, runs: list[PagedRun], src: list[int], res: KVReservation, dst: list[int], request_id: str,
             writes: InflightWrites, target: SliceTarget | None = None) -> int:
        """As `DirectWrites.post`, through the staging rows: a whole block, or the head
        slice `target` names (one run of each block, `PushPlan`), is a piece of one row."""
        posted = 0
        blocks = np.asarray(src, dtype=np.int64)
        for run in runs:
            # Every (layer, block) starts a row (one run per block), so a piece of a block
            # sits at the same column of each row it is read from.
            column = run.src_offset % self.row
            if run.src_stride % self.row or column + run.length > self.row:
                raise GeometryError(f"a piece of {run.length} bytes at byte {column} of a block (stride "
                                    f"{run.src_stride}) is not within one staging row of {self.row} bytes")
            rows = (run.src_offset + blocks * run.src_stride) // self.row
            nbytes = len(src) * run.length
            writes.add(_StagedWrite(self.sender.push(rows, res.descriptor, dst, dst_offset=run.dst_offset,
                                                     dst_stride=run.dst_stride, imm=res.imm, request_id=request_id,
                                                     src_column=column, length=run.length)), nbytes)
            posted += nbytes
        return posted


class DirectLanding:
    """The decoder's cache is host memory registered with the engine: writes land in the
    request's own blocks."""

    def __init__(self, memory: RegisteredMemory, geometry: CacheGeometry) -> None:
        one_run_per_block(geometry)
        self.memory, self.geometry = memory, geometry

    def reserve(self, blocks: list[int]) -> list[int] | None:
        """The pages the prefiller writes for `blocks`: the blocks themselves."""
        return list(blocks)

    def land(self, pages: list[int], blocks: list[int]) -> None:
        """Every write landed: nothing to copy."""

    def release(self, pages: list[int]) -> None:
        """No write can land any more: nothing to give back."""


class StagedLanding:
    """The decoder's cache is device memory: writes land in pinned landing blocks (a small
    cache of the same layout), copied into the request's device blocks once all landed
    (from every prefill rank the load draws heads from: the receiver copies once per load)."""

    def __init__(self, engine: TransferEngine, region: KVRegion, *,
                 landing_blocks: int = DEFAULT_LANDING_BLOCKS) -> None:
        self.cache_geometry = region.geometry
        self.geometry = region.geometry.with_num_blocks(landing_blocks)
        self.row = one_run_per_block(region.geometry)
        self.receiver = DevicePageReceiver(engine, region.cache_bytes, self.row,
                                           landing_pages=self.geometry.total_bytes // self.row)
        self.memory = self.receiver.region
        self._free = list(range(landing_blocks - 1, -1, -1))

    def reserve(self, blocks: list[int]) -> list[int] | None:
        """Landing blocks for `blocks`, or None when too few are free."""
        if len(blocks) > len(self._free):
            return None
        return [self._free.pop() for _ in blocks]

    def land(self, pages: list[int], blocks: list[int]) -> None:
        """Copies landing blocks `pages` into the device cache's `blocks`; returns once done."""
        self.receiver.land(_rows(self.geometry, pages, self.row), _rows(self.cache_geometry, blocks, self.row))

    def release(self, pages: list[int]) -> None:
        """No write for `pages` can land any more: they may be handed out again."""
        self._free.extend(reversed(pages))
