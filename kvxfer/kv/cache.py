"""Paged KV cache: one contiguous, registrable tensor holding every layer's K/V pages.

Layout (architecture.md, "KV cache layout"): ``[num_layers, num_pages, 2, block_size,
num_kv_heads, head_dim]``. The order of the dimensions is chosen for the transfer, not for
the attention kernel:

* the page dimension sits right under the layer, and K and V of a page sit side by side, so
  one page of one layer (K and V for `block_size` tokens) is ONE contiguous run of
  `page_bytes` bytes -- each page is a single RDMA write;
* the layer is the outermost dimension, so all pages of one layer form a regular array of
  `page_bytes`-sized slots starting at ``layer * num_pages * page_bytes``: the pages that a
  request's prefill produced for one layer go out as one paged write with
  ``stride = page_bytes`` and ``offset = layer_offset_bytes(layer)`` as soon as that layer is
  computed, which is what lets the transfer hide behind the next layer's compute.

The whole cache is one allocation so that the engine registers it once (by pointer,
through `tensor`) and peers address pages by index rather than by pointer. It lives in a
`SharedBuffer` (a memfd), so a prefiller on the same machine maps it and writes pages with
memcpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import torch

from kvxfer.kv.layout import (
    KVCacheError,
    KVGeometry,
    format_kv_layout,
    layer_offset_bytes,
    pages_for_tokens,
)
from kvxfer.transfer.shared_memory import SharedBuffer

#: A request's block table: page ids in token order (page i holds tokens
#: ``[i * block_size, (i + 1) * block_size)``), as a list or a 1-D integer tensor.
BlockTable = Union[Sequence[int], torch.Tensor]

# Names accepted in configs. Kept to the float types the model computes in; the name is
# part of the kv_layout string, so it must be stable (not torch's repr, which has a prefix).
# Here and not in `layout`: `layout` (and `protocol`, which the router imports) stay free
# of torch.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_from_name(name: str) -> torch.dtype:
    """Map a dtype name used in configs and layout strings ("float32", ...) to a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise KVCacheError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


class PagedKVCache:
    """All K/V pages of one worker in one contiguous tensor, plus the byte offsets the engine needs.

    The tensor has shape ``[num_layers, num_pages, 2, block_size, num_kv_heads, head_dim]``
    (index 0 of the third dimension is K, 1 is V) and is zero-initialised. Page ids are
    local to this worker: a prefiller and a decoder each address their own cache. Model
    code reads and writes tokens through `write_tokens` and `gather_tokens` with a request's
    block table; transfer code uses `tensor` (to register the memory), `page_bytes` and
    `layer_offset_bytes` (to build paged writes). Accessors validate layer and page indices
    and raise `KVCacheError` with the valid range.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
    ) -> None:
        for field_name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KVCacheError(f"PagedKVCache {field_name} must be a positive int, got {value!r}")
        self._dtype_name = dtype
        torch_dtype = dtype_from_name(dtype)
        shape = (num_layers, num_pages, 2, block_size, num_kv_heads, head_dim)
        # A memfd-backed buffer (zeroed like torch.zeros): a prefiller on the same machine
        # maps it and pushes pages with memcpy rather than process_vm_writev.
        nbytes = math.prod(shape) * torch.tensor([], dtype=torch_dtype).element_size()
        self._backing = SharedBuffer(nbytes, name="kvxfer-kv-cache")
        self._tensor = self._backing.torch(torch_dtype, shape)
        self._num_layers = num_layers
        self._num_pages = num_pages
        self._block_size = block_size
        self._num_kv_heads = num_kv_heads
        self._head_dim = head_dim
        self._page_bytes = 2 * block_size * num_kv_heads * head_dim * self._tensor.element_size()
        # Per-layer views with K and V split out, built once: the model indexes them on every
        # layer of every step, and slicing a 6-D tensor each time is measurable on decode.
        self._k_layers = [self._tensor[layer, :, 0] for layer in range(num_layers)]
        self._v_layers = [self._tensor[layer, :, 1] for layer in range(num_layers)]

    @classmethod
    def from_config(cls, config: KVGeometry, num_pages: int) -> "PagedKVCache":
        """Build a cache whose pages match `config` (layers, KV heads, head dim, dtype, block size).

        Any object with the `KVGeometry` fields serves (a `ModelConfig` does), so this layer
        never imports the model package that builds on it.
        """
        return cls(
            num_layers=config.num_layers,
            num_pages=num_pages,
            block_size=config.block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=config.dtype,
        )

    # ---- shape and byte geometry -------------------------------------------------------

    @property
    def tensor(self) -> torch.Tensor:
        """The backing tensor (contiguous, CPU); register it with the engine by pointer."""
        return self._tensor

    @property
    def num_layers(self) -> int:
        """Number of transformer layers held."""
        return self._num_layers

    @property
    def num_pages(self) -> int:
        """Pages per layer; valid page ids are ``0 .. num_pages - 1``."""
        return self._num_pages

    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return self._block_size

    @property
    def num_kv_heads(self) -> int:
        """KV heads per token."""
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        """Elements per head."""
        return self._head_dim

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype of the cache."""
        return self._tensor.dtype

    @property
    def kv_layout(self) -> str:
        """The layout string of this cache; equals `ModelConfig.kv_layout` of a matching model."""
        return format_kv_layout(self._num_layers, self._num_kv_heads, self._head_dim, self._dtype_name, self._block_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer: ``2 * block_size * num_kv_heads * head_dim * dtype_size``."""
        return self._page_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's whole page pool (the distance between two layers' page 0)."""
        return self._num_pages * self._page_bytes

    @property
    def nbytes(self) -> int:
        """Total bytes of the backing tensor (the size to register)."""
        return self._num_layers * self.layer_bytes

    @property
    def data_ptr(self) -> int:
        """Address of byte 0 of the cache, for engines that register by pointer and length."""
        return self._tensor.data_ptr()

    def layer_offset_bytes(self, layer: int) -> int:
        """Byte offset of page 0 of `layer`: ``layer * num_pages * page_bytes``.

        This is the `offset` of the paged write that pushes one layer's pages; page ``p``
        of that layer then lies at ``offset + p * page_bytes``.
        """
        self._check_layer(layer)
        return layer_offset_bytes(layer, self._num_pages, self._page_bytes)

    def page_offset_bytes(self, layer: int, page: int) -> int:
        """Byte offset of page `page` of `layer` from the start of the cache."""
        self._check_page(page)
        return self.layer_offset_bytes(layer) + page * self._page_bytes

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Number of pages needed to hold `num_tokens` tokens (ceiling division)."""
        return pages_for_tokens(num_tokens, self._block_size)

    # ---- page access (transfer side and tests) ------------------------------------------

    def page_view(self, layer: int, page: int) -> torch.Tensor:
        """A contiguous view of one page of one layer, shape ``[2, block_size, num_kv_heads, head_dim]``.

        Writes into the view land in the cache; index 0 of the first dimension is K, 1 is V.
        """
        self._check_layer(layer)
        self._check_page(page)
        return self._tensor[layer, page]

    def read_pages(self, layer: int, pages: BlockTable) -> torch.Tensor:
        """Copy of the given pages of `layer`, shape ``[len(pages), 2, block_size, num_kv_heads, head_dim]``."""
        self._check_layer(layer)
        index = self._page_index(pages)
        return self._tensor[layer].index_select(0, index)

    def write_pages(self, layer: int, pages: BlockTable, data: torch.Tensor) -> None:
        """Overwrite the given pages of `layer` with `data` (shaped like `read_pages`' result).

        This is what a remote paged write does to the receiver's memory; tests and a
        loopback transfer use it to move pages between two caches without an engine.
        """
        self._check_layer(layer)
        index = self._page_index(pages)
        expected = (len(index), 2, self._block_size, self._num_kv_heads, self._head_dim)
        if tuple(data.shape) != expected or data.dtype != self.dtype:
            raise KVCacheError(
                f"write_pages data must be {self.dtype} of shape {expected}, got {data.dtype} {tuple(data.shape)}"
            )
        self._tensor[layer].index_copy_(0, index, data)

    def read_page_bytes(self, layer: int, page: int) -> bytes:
        """The raw `page_bytes` bytes of one page of one layer, as they would travel on the wire."""
        start = self.page_offset_bytes(layer, page)
        return self.as_bytes()[start : start + self._page_bytes].numpy().tobytes()

    def write_page_bytes(self, layer: int, page: int, data: bytes) -> None:
        """Overwrite one page of one layer with exactly `page_bytes` raw bytes."""
        if len(data) != self._page_bytes:
            raise KVCacheError(f"a page is {self._page_bytes} bytes, got {len(data)}")
        start = self.page_offset_bytes(layer, page)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.as_bytes()[start : start + self._page_bytes].copy_(src)

    def as_bytes(self) -> torch.Tensor:
        """A flat uint8 view of the whole cache (shares memory); byte ``i`` is at ``data_ptr + i``."""
        return self._tensor.view(-1).view(torch.uint8)

    # ---- token access (model side) -------------------------------------------------------

    def write_tokens(
        self, layer: int, block_table: BlockTable, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K and V of tokens ``start_pos .. start_pos + len(k) - 1`` of one request in `layer`.

        `k` and `v` are ``[num_tokens, num_kv_heads, head_dim]``. Token at position ``p``
        goes to page ``block_table[p // block_size]``, slot ``p % block_size``.
        """
        self._check_layer(layer)
        num_tokens = k.shape[0]
        expected = (num_tokens, self._num_kv_heads, self._head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise KVCacheError(f"k and v must be shaped {expected}, got {tuple(k.shape)} and {tuple(v.shape)}")
        if start_pos < 0:
            raise KVCacheError(f"start_pos must be >= 0, got {start_pos}")
        end_pos = start_pos + num_tokens
        table = self._page_index(block_table, needed_tokens=end_pos)
        positions = torch.arange(start_pos, end_pos)
        pages = table[positions // self._block_size]
        slots = positions % self._block_size
        # Advanced indexing on (page, slot) of the per-layer K and V views writes straight
        # into the cache tensor; the views were sliced once in __init__.
        self._k_layers[layer][pages, slots] = k
        self._v_layers[layer][pages, slots] = v

    def gather_tokens(self, layer: int, block_table: BlockTable, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return copies of K and V for tokens ``0 .. num_tokens - 1`` of one request in `layer`.

        Each is ``[num_tokens, num_kv_heads, head_dim]``, gathered from the request's pages
        in block-table order; this is how attention reads a request's context.
        """
        self._check_layer(layer)
        num_pages = self.pages_for_tokens(num_tokens)
        table = self._page_index(block_table, needed_tokens=num_tokens)[:num_pages]
        shape = (num_pages * self._block_size, self._num_kv_heads, self._head_dim)
        k = self._k_layers[layer].index_select(0, table).view(shape)[:num_tokens]
        v = self._v_layers[layer].index_select(0, table).view(shape)[:num_tokens]
        return k, v

    # ---- validation ---------------------------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._num_layers:
            raise KVCacheError(f"layer {layer} out of range: the cache has layers 0..{self._num_layers - 1}")

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self._num_pages:
            raise KVCacheError(f"page {page} out of range: the cache has pages 0..{self._num_pages - 1}")

    def _page_index(self, pages: BlockTable, needed_tokens: int | None = None) -> torch.Tensor:
        """Validate a list of page ids and return it as a 1-D int64 tensor."""
        index = torch.as_tensor(pages, dtype=torch.long)
        if index.dim() != 1:
            raise KVCacheError(f"page ids must be a 1-D sequence, got shape {tuple(index.shape)}")
        if index.numel():
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= self._num_pages:
                bad = low if low < 0 else high
                raise KVCacheError(f"page {bad} out of range: the cache has pages 0..{self._num_pages - 1}")
        if needed_tokens is not None and index.numel() * self._block_size < needed_tokens:
            raise KVCacheError(
                f"block table of {index.numel()} pages holds {index.numel() * self._block_size} tokens, "
                f"{needed_tokens} needed"
            )
        return index
