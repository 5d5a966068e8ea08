"""KV page geometry: the layout string two workers compare, dtypes, and page counts.

The lowest module of the KV layer. The model's config satisfies `KVGeometry`, so the cache
and the push read geometry from any config without importing the model package (which
imports this layer, never the other way round).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

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


# Names accepted in configs. Kept to the float types the model computes in; the name is
# part of the kv_layout string, so it must be stable (not torch's repr, which has a prefix).
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class KVCacheError(KvxferError, ValueError):
    """A KV-cache access outside the cache: bad layer, page index, position or tensor shape.

    It is a KvxferError like every library error, and a ValueError because each case is a
    caller passing an invalid argument (`errors.BoundsError` is the engine's counterpart for
    registered regions). The message names the offending value and the valid range.
    """


def dtype_from_name(name: str) -> torch.dtype:
    """Map a dtype name used in configs and layout strings ("float32", ...) to a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise KVCacheError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


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
