"""Where every byte of a paged KV cache lives, whatever the order of its five axes.

A paged KV cache is logically `[L, B, H, N, C]`: layer, block, head, token, and the bytes
of one head's content for one token (K then V for attention; for MLA the token's latent
vector, with one head slot that cannot be split). Engines store it in one of several
physical orders: vLLM names six (`KVCacheLayout`: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC,
BHLNC), kvxfer's own cache is LBHNC. `CacheGeometry` is that order plus the byte strides,
and it answers what a transfer needs: the contiguous byte runs of one (layer, block) or of
a head slice of it, the paged writes that copy a request's blocks of one layer into
another cache (one write per run of a block, each covering every listed block at the
cache's block stride, also where B is outermost and a block holds every layer), and the
windows a reservation opens. It computes; nothing here parses a string.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvxfer.errors import KvxferError
from kvxfer.kv.write_windows import MAX_WINDOWS

#: Logical axes, in the order strides and shapes are given.
AXES = "LBHNC"
_L, _B, _H, _N, _C = range(5)


class GeometryError(KvxferError, ValueError):
    """A geometry that cannot exist, or a question it cannot answer (a bad head slice, a
    destination whose shape differs)."""


@dataclass(frozen=True)
class PagedRun:
    """One paged write of one layer: byte `length` at `src_offset + page * src_stride`
    goes to `dst_offset + page * dst_stride`, for each (source, destination) page pair."""

    src_offset: int
    dst_offset: int
    length: int
    src_stride: int
    dst_stride: int


@dataclass(frozen=True)
class CacheGeometry:
    """A paged KV cache's shape, physical axis order and byte strides (dense: no padding).

    `order` lists the logical axes (0..4 for L, B, H, N, C) outermost first, the
    convention of vLLM's `KVCacheLayout.value`; content is always innermost. `strides`
    are in bytes, in logical order. `latent` marks content with no head axis (MLA): its
    one head slot is never split between ranks.
    """

    layout: str
    order: tuple[int, ...]
    shape: tuple[int, ...]  # (layers, blocks, heads, tokens per block, content bytes)
    strides: tuple[int, ...]
    latent: bool = False

    @classmethod
    def dense(cls, layout: str, order: tuple[int, ...], num_layers: int, num_blocks: int, num_heads: int,
              block_size: int, content_bytes: int, *, latent: bool = False) -> CacheGeometry:
        """The geometry of a cache packed with no gaps in axis order `order`."""
        order = tuple(int(a) for a in order)
        if sorted(order) != list(range(5)) or order[-1] != _C:
            raise GeometryError(f"layout {layout}: axis order {order} is not a permutation of L,B,H,N,C with C last")
        shape = (int(num_layers), int(num_blocks), int(num_heads), int(block_size), int(content_bytes))
        if min(shape) <= 0:
            raise GeometryError(f"layout {layout}: every extent must be positive, got {dict(zip(AXES, shape))}")
        if latent and num_heads != 1:
            raise GeometryError(f"layout {layout}: latent (MLA) content has one head slot, got {num_heads}")
        strides = [0] * 5
        step = 1
        for axis in reversed(order):
            strides[axis] = step
            step *= shape[axis]
        return cls(layout, order, shape, tuple(strides), latent)

    def with_num_blocks(self, num_blocks: int) -> CacheGeometry:
        """The same cache with another number of blocks (a peer's cache of this shape)."""
        return CacheGeometry.dense(self.layout, self.order, self.num_layers, num_blocks, self.num_heads,
                                self.block_size, self.content_bytes, latent=self.latent)

    # ---- extents -------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """L."""
        return self.shape[_L]

    @property
    def num_blocks(self) -> int:
        """B."""
        return self.shape[_B]

    @property
    def num_heads(self) -> int:
        """H: KV heads, or 1 for latent content."""
        return self.shape[_H]

    @property
    def block_size(self) -> int:
        """N: tokens per block."""
        return self.shape[_N]

    @property
    def content_bytes(self) -> int:
        """C: bytes of one head's content for one token."""
        return self.shape[_C]

    @property
    def page_bytes(self) -> int:
        """Bytes of one (layer, block), every head."""
        return self.num_heads * self.block_size * self.content_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole cache."""
        return self.num_layers * self.num_blocks * self.page_bytes

    @property
    def layer_stride(self) -> int:
        """Bytes from a block of layer l to the same block of layer l + 1."""
        return self.strides[_L]

    @property
    def block_stride(self) -> int:
        """Bytes from block b of a layer to block b + 1 of the same layer."""
        return self.strides[_B]

    def offset(self, layer: int, block: int, head: int = 0, token: int = 0) -> int:
        """Byte offset of (layer, block, head, token)'s content."""
        return layer * self.strides[_L] + block * self.strides[_B] + head * self.strides[_H] + token * self.strides[_N]

    # ---- runs ----------------------------------------------------------------------------

    def head_range(self, heads: tuple[int, int] | None) -> tuple[int, int]:
        """`heads` checked against this cache ([h0, h1) within [0, H)); None is every head."""
        if heads is None:
            return (0, self.num_heads)
        h0, h1 = heads
        if self.latent and (h0, h1) != (0, 1):
            raise GeometryError(f"latent (MLA) content has no head axis to split: heads {h0}..{h1} asked, "
                                "every rank holds the whole latent vector")
        if not 0 <= h0 < h1 <= self.num_heads:
            raise GeometryError(f"heads {h0}..{h1} are not a slice of this cache's {self.num_heads} heads")
        return (h0, h1)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (geometries are few and live as long as the process)
    def copy_plan(self, dst: CacheGeometry, src_heads: tuple[int, int] | None = None,
                  dst_heads: tuple[int, int] | None = None) -> tuple[tuple[int, int, int], ...]:
        """(source offset, destination offset, length) of each contiguous piece that copies
        heads `src_heads` of one block here to heads `dst_heads` of one block of `dst`,
        offsets relative to each side's (layer, block) origin; as few pieces as both
        layouts allow (one for LBHNC to LBHNC, one per head for LHBNC)."""
        s0, s1 = self.head_range(src_heads)
        d0, d1 = dst.head_range(dst_heads)
        if (s1 - s0, self.block_size, self.content_bytes, self.latent) != (d1 - d0, dst.block_size,
                                                                          dst.content_bytes, dst.latent):
            raise GeometryError(f"cannot copy {s1 - s0} heads x {self.block_size} tokens x {self.content_bytes} B "
                                f"({self.layout}) into {d1 - d0} heads x {dst.block_size} tokens x "
                                f"{dst.content_bytes} B ({dst.layout})")
        # Walk the (head, token) cells in the source's physical order, so its side only
        # ascends; merge a cell into the previous piece where both sides continue it.
        cells = [(h, n) for h in range(s1 - s0) for n in range(self.block_size)]
        if self.strides[_N] > self.strides[_H]:
            cells.sort(key=lambda cell: (cell[1], cell[0]))
        pieces: list[list[int]] = []
        for h, n in cells:
            src = (s0 + h) * self.strides[_H] + n * self.strides[_N]
            dst_off = (d0 + h) * dst.strides[_H] + n * dst.strides[_N]
            last = pieces[-1] if pieces else None
            if last is not None and last[0] + last[2] == src and last[1] + last[2] == dst_off:
                last[2] += self.content_bytes
            else:
                pieces.append([src, dst_off, self.content_bytes])
        return tuple((s, d, n) for s, d, n in pieces)

    def block_runs(self, heads: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """(offset from the (layer, block) origin, length) of each contiguous run that heads
        `heads` of one block occupy, ascending."""
        return sorted((s, n) for s, _, n in self.copy_plan(self, heads, heads))

    def runs(self, layer: int, block: int, heads: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """(offset, length) of the byte runs that hold `heads` of one (layer, block)."""
        origin = self.offset(layer, block)
        return [(origin + rel, length) for rel, length in self.block_runs(heads)]

    def layer_writes(self, layer: int, dst: CacheGeometry, plan: tuple[tuple[int, int, int], ...]) -> list[PagedRun]:
        """The paged writes that copy `layer`'s listed blocks into the same layer of `dst`
        along `plan` (from `copy_plan`): one per piece, each covering every block of the request."""
        src_base, dst_base = self.offset(layer, 0), dst.offset(layer, 0)
        return [PagedRun(src_base + s, dst_base + d, n, self.block_stride, dst.block_stride) for s, d, n in plan]

    def windows(self, blocks: list[int]) -> list[tuple[int, int]]:
        """(offset, length) of the bytes that `blocks` of every layer occupy, adjacent runs
        merged (for a reservation's own registration). Past `MAX_WINDOWS` (a fragmented
        pool), each layer gets one window from its lowest to its highest byte: wider than
        the blocks, still revoked with them."""
        if not blocks:
            raise GeometryError("a reservation window needs at least one block")
        runs = self.block_runs()
        rel = np.array([r for r, _ in runs], dtype=np.int64)
        length = runs[0][1]
        layer_origins = np.arange(self.num_layers, dtype=np.int64) * self.layer_stride
        block_origins = np.unique(np.asarray(blocks, dtype=np.int64)) * self.block_stride
        starts = (layer_origins[:, None, None] + block_origins[None, :, None] + rel[None, None, :])
        merged = _merge(starts.ravel(), np.full(starts.size, length, dtype=np.int64))
        if len(merged) <= MAX_WINDOWS:
            return merged
        per_layer = starts.reshape(self.num_layers, -1)
        spans = _merge(per_layer.min(axis=1), per_layer.max(axis=1) + length - per_layer.min(axis=1))
        if len(spans) <= MAX_WINDOWS:
            return spans
        first, last = int(starts.min()), int(starts.max()) + length
        return [(first, last - first)]


def _merge(starts: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """Sorted (offset, length) ranges with touching or overlapping ones joined."""
    order = np.argsort(starts, kind="stable")
    begin = starts[order]
    reach = np.maximum.accumulate(begin + lengths[order])
    # A range opens a new window where it starts past everything before it.
    opens = np.flatnonzero(np.concatenate(([True], begin[1:] > reach[:-1])))
    closes = np.concatenate((opens[1:] - 1, [len(begin) - 1]))
    return [(int(b), int(e - b)) for b, e in zip(begin[opens], reach[closes])]
