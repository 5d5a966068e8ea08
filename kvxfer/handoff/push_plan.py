"""Which pages of a layer a push posts now, and where they land: one plan for both senders.

A reservation names the decoder's pages for prompt blocks `first_page ...` (the blocks
before are the decoder's prefix-cache hit and are never pushed): prompt block `b` lands in
reserved page ``pages[b - first_page]``. `PushPlan` keeps, per layer, how far that layer
was posted, and turns "blocks [first, end) of layer l are final" (the builtin prefiller
knows each chunk's blocks) or "the first n prompt pages of layer l are final" (the vLLM
connector, whose reservation may come after some layers were computed) into a
`LayerPages`: the local and reserved page ids, and the columns of the push's checksum
table they fill (`checksums`, where the reservation asks for one). Where the bytes lie
comes from the caches' `CacheGeometry` (kv.cache_geometry), the one object that knows
offsets: `runs(layer)` are the paged writes of a layer, each covering every listed page at
the caches' strides. A sender posts exactly what the plan says; neither computes an offset
of its own.

Several KV cache groups (vLLM's hybrid manager: `LayerGroups`): a layer belongs to one
group, its pages are named by that group's block ids on both sides, and the geometry layer
(slot) that holds it may hold one layer of every other group too. The plan then counts
"layers" as the pushed layers, reads the decoder's pages of the layer's group from the
reservation's `group_pages`, and leaves out the pages the decoder's group keeps none of
(-1: a sliding window's pages before its window); the sender passes its own block ids of
the layer's group as `local`.

A Mamba/SSM state group is one more group to the plan: its pages are -1 but for the last
prompt page, which names the request's state block, and its layers' writes cover the
first `state_bytes` of that block's page (the state) instead of the whole page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.errors import KvxferError
from kvxfer.kv.cache_geometry import CacheGeometry, GeometryError, PagedRun
from kvxfer.kv.protocol import KVReservation

#: Local page ids as a sender holds them: a numpy array (builtin) or a list (vLLM's block ids).
LocalPages = np.ndarray | list[int]


class PushPlanError(KvxferError, ValueError):
    """The pages asked for cannot be planned (the request holds fewer blocks than final pages)."""


@dataclass(frozen=True)
class LayerGroups:
    """Per pushed layer: the geometry layer (slot) holding it and its KV cache group."""

    slots: tuple[int, ...]
    groups: tuple[int, ...]
    #: Per pushed layer: bytes of its Mamba/SSM state at the start of its page (0: KV, the
    #: whole page); None: no state layers.
    state_bytes: tuple[int, ...] | None = None

    def expected_writes(self, group_pages: list[list[int]]) -> int:
        """The writes a push of `group_pages` makes: each layer's group's pages that are not -1."""
        per_group = [sum(1 for page in pages if page >= 0) for pages in group_pages]
        return sum(per_group[g] for g in self.groups)


@dataclass(frozen=True)
class LayerPages:
    """Prompt blocks [first_block, end_block) of `layer`: the local pages they are read
    from and the reserved pages they land in, pair by pair."""

    layer: int
    first_block: int
    end_block: int
    local: LocalPages
    remote: np.ndarray
    #: Columns of the (layer, reserved page) checksum table these pages fill.
    table_columns: slice | np.ndarray


def whole_page_geometry(layout: str, num_layers: int, num_pages: int, page_bytes: int) -> CacheGeometry:
    """The geometry of a cache whose (layer, page) is one opaque run of `page_bytes`, pages
    of a layer adjacent (the builtin `PagedKVCache`, [L, P, ...]): what a whole-page push
    needs of it, whatever the order inside a page."""
    return CacheGeometry.dense(layout, (0, 1, 2, 3, 4), num_layers, num_pages, 1, 1, page_bytes)


class PushPlan:
    """The pages of one reservation each layer posts, and the paged writes that move them.

    `geometry` is this side's cache; the decoder's is the same shape with the reservation's
    `num_pages` blocks, or, for a head slice (a decode rank of another tensor parallel
    size), `dst_num_heads` heads per block of which `dst_heads` receive this cache's
    `src_heads`. The writes are planned on first use: a slice the layout cannot move as one
    run per block raises `GeometryError` there, where the sender fails the push.
    """

    def __init__(self, reservation: KVReservation, geometry: CacheGeometry, *,
                 src_heads: tuple[int, int] | None = None, dst_heads: tuple[int, int] | None = None,
                 dst_num_heads: int | None = None, layer_groups: LayerGroups | None = None) -> None:
        self.reservation = reservation
        self.geometry = geometry
        self.first_page = reservation.first_page
        #: The prompt page after the last one pushed (held ones are below `first_page`).
        self.end_page = reservation.first_page + reservation.prompt_pages
        self._remote = np.asarray(reservation.pages, dtype=np.int64)
        self._layer_groups = layer_groups
        self._group_remote: list[np.ndarray] = []
        num_layers = geometry.num_layers
        if layer_groups is not None:
            if reservation.group_pages is None or len(reservation.group_pages) != 1 + max(layer_groups.groups):
                raise PushPlanError("the reservation's KV cache groups are not this cache's")
            self._group_remote = [np.asarray(pages, dtype=np.int64) for pages in reservation.group_pages]
            num_layers = len(layer_groups.slots)
        elif reservation.group_pages is not None:
            raise PushPlanError("the reservation names pages of several KV cache groups; this cache has one")
        self._heads = (src_heads, dst_heads, dst_num_heads)
        self._dst: CacheGeometry | None = None
        self._pieces: tuple[tuple[int, int, int], ...] = ()
        #: Per layer, the prompt block up to which it was posted.
        self.pushed_upto = [self.first_page] * num_layers
        #: CRC-32C of each (layer, pushed page), where the reservation asks for them: taken
        #: just before a page's write is posted, the table says what this side meant to send.
        self.checksums: np.ndarray | None = None
        if reservation.checksums:
            self.checksums = np.zeros((num_layers, reservation.prompt_pages), dtype="<u4")

    def _plan(self) -> tuple[CacheGeometry, tuple[tuple[int, int, int], ...]]:
        if self._dst is None:
            g = self.geometry
            src_heads, dst_heads, dst_num_heads = self._heads
            if dst_num_heads is None:
                dst = g.with_num_blocks(self.reservation.num_pages)
                pieces = g.copy_plan(dst)
            else:
                dst = CacheGeometry.dense(g.layout, g.order, g.num_layers, self.reservation.num_pages, dst_num_heads,
                                          g.block_size, g.content_bytes, latent=g.latent)
                pieces = g.copy_plan(dst, src_heads, dst_heads)
                if len(pieces) != 1:
                    # The decoder counts one immediate per (layer, page) from each prefill rank.
                    raise GeometryError(f"a head slice of layout {g.layout} is {len(pieces)} runs per block; "
                                        "tensor parallel peers of different sizes need LBHNC or BLHNC")
            self._dst, self._pieces = dst, pieces
        return self._dst, self._pieces

    def runs(self, layer: int) -> list[PagedRun]:
        """The paged writes of `layer`: one per contiguous piece of a block (one for whole
        pages and for LBHNC), each covering every page of a `LayerPages` at both strides."""
        dst, pieces = self._plan()
        slot = self._layer_groups.slots[layer] if self._layer_groups is not None else layer
        state = self._layer_groups.state_bytes[layer] if self._layer_groups and self._layer_groups.state_bytes else 0
        if state:
            if self._heads[2] is not None:
                raise GeometryError("a Mamba/SSM state is pushed whole, never as a head slice")
            pieces = ((0, 0, state),)
        return self.geometry.layer_writes(slot, dst, pieces)

    def blocks(self, layer: int, first_block: int, end_block: int, local: LocalPages) -> LayerPages | None:
        """Blocks [first_block, end_block) of `layer`, less those the decoder holds; None
        when none is left. `local` holds the local page of every prompt block."""
        first_block = max(first_block, self.first_page)
        if end_block <= first_block:
            return None
        first_col, end_col = first_block - self.first_page, end_block - self.first_page
        if self._layer_groups is not None:
            return self._group_blocks(layer, first_block, end_block, local)
        src = local[first_block:end_block]
        dst = self._remote[first_col:end_col]
        if len(src) != len(dst):
            raise PushPlanError(f"the request has {len(local)} blocks, fewer than its computed pages")
        return LayerPages(layer, first_block, end_block, src, dst, slice(first_col, end_col))

    def _group_blocks(self, layer: int, first_block: int, end_block: int, local: LocalPages) -> LayerPages:
        # The decoder's pages of this layer's group; -1 where it keeps none (not pushed).
        assert self._layer_groups is not None
        group = self._layer_groups.groups[layer]
        first_col, end_col = first_block - self.first_page, end_block - self.first_page
        remote = self._group_remote[group][first_col:end_col]
        src = np.asarray(local[first_block:end_block], dtype=np.int64)
        if len(src) != len(remote):
            raise PushPlanError(f"the request has {len(local)} blocks of group {group}, fewer than its computed pages")
        wanted = remote >= 0
        if np.any(src[wanted] < 0):
            page = first_block + int(np.argmax(wanted & (src < 0)))
            raise PushPlanError(f"the decoder wants prompt page {page} of KV cache group {group}, which this "
                                "side no longer holds (its sliding window dropped it)")
        columns = np.arange(first_col, end_col)[wanted]
        return LayerPages(layer, first_block, end_block, src[wanted].tolist(), remote[wanted], columns)

    def final(self, layer: int, final_pages: int, local: LocalPages) -> LayerPages | None:
        """The pages of `layer` that became final since it was last posted (its first
        `final_pages` prompt pages are final now); None when there are none (pages the
        decoder keeps none of count as posted)."""
        pages = self.blocks(layer, self.pushed_upto[layer], final_pages, local)
        if pages is not None and not len(pages.remote):
            self.posted(pages)
            return None
        return pages

    def posted(self, pages: LayerPages) -> None:
        """`pages` were posted: `final` starts after them."""
        self.pushed_upto[pages.layer] = max(self.pushed_upto[pages.layer], pages.end_block)

    def record_checksums(self, pages: LayerPages, values: np.ndarray) -> None:
        """The checksums of `pages`' pages, as they are about to be written."""
        assert self.checksums is not None, "the reservation asks for no checksums"
        self.checksums[pages.layer, pages.table_columns] = values

    @property
    def complete(self) -> bool:
        """Every layer posted up to the reservation's last page."""
        return all(upto >= self.end_page for upto in self.pushed_upto)

    @property
    def num_layers(self) -> int:
        """Layers the plan pushes (the pushed layers of every group, where there are several)."""
        return len(self.pushed_upto)
