"""KV page geometry: the layout string two workers compare, page counts and byte offsets.

The lowest module of the KV layer, free of torch: the router imports it (through
`kv.protocol`) and has no torch. The model's config satisfies `KVGeometry`, so the cache
and the push read geometry from any config without importing the model package (which
imports this layer, never the other way round). Dtype names map to torch dtypes in
`kv.cache.dtype_from_name`.
"""

from __future__ import annotations

import math
from typing import Protocol

from kvxfer.errors import KvxferError


class KVGeometry(Protocol):
    """The fields that fix the byte layout of one KV page and the number of layers."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def block_size(self) -> int: ...


class KVCacheError(KvxferError, ValueError):
    """A KV-cache access outside the cache: bad layer, page index, position or tensor shape.

    It is a KvxferError like every library error, and a ValueError because each case is a
    caller passing an invalid argument (`errors.BoundsError` is the engine's counterpart for
    registered regions). The message names the offending value and the valid range.
    """


def format_kv_layout(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int) -> str:
    """Return the layout string two workers compare, e.g. ``"L32-H8-D128-float32-bs16"``.

    The number of pages is deliberately not part of it: each worker sizes its own pool, and
    page ids are per worker; only the shape of one page and the layer count must agree.
    """
    return f"L{num_layers}-H{num_kv_heads}-D{head_dim}-{dtype}-bs{block_size}"


def pages_for_tokens(num_tokens: int, block_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens (ceiling division)."""
    if num_tokens < 0:
        raise KVCacheError(f"num_tokens must be >= 0, got {num_tokens}")
    return math.ceil(num_tokens / block_size)


def layer_offset_bytes(layer: int, num_pages: int, page_bytes: int) -> int:
    """Byte offset of page 0 of `layer` in a cache of `num_pages` pages per layer.

    The one formula both sides use: the prefiller for its own cache (source) and for the
    decoder's (destination, with the decoder's `num_pages` from the reservation).
    """
    if layer < 0 or num_pages <= 0 or page_bytes <= 0:
        raise KVCacheError(f"layer must be >= 0 and num_pages, page_bytes positive, got {layer}, {num_pages}, {page_bytes}")
    return layer * num_pages * page_bytes
