"""vLLM's paged KV cache seen as one registered region: layer order, block size, signature.

vLLM's CPU backend allocates one backing buffer for every layer and hands the connector a
view per layer, `[num_blocks, kv_heads, block_size, 2 * head_size]` (LBHNC). One block of
one layer is one contiguous run of bytes, and layers follow each other, so page `p` of
layer `l` lives at `l * num_blocks * block_bytes + p * block_bytes`: the same geometry as
kvxfer's own cache (`kvxfer.kv.layout`), and a request's blocks of one layer are one
paged write. This module checks that shape instead of assuming it, and refuses anything
else with a clear error.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.errors import KvxferError


class KVRegionError(KvxferError, ValueError):
    """vLLM's KV cache does not have the layout the connector can push."""


_LAYER_NUMBER = re.compile(r"(\d+)")


@dataclass
class KVRegion:
    """The whole KV allocation as one buffer, plus what a reservation needs to address it."""

    layer_names: list[str]
    num_blocks: int
    block_bytes: int
    buffer: np.ndarray  # uint8 view over the backing allocation (does not own it)
    owners: list[Any]  # the tensors that keep the allocation alive
    signature: str

    @property
    def num_layers(self) -> int:
        """Attention layers, in allocation order."""
        return len(self.layer_names)

    def layer_index(self, layer_name: str) -> int:
        """Index of `layer_name` in allocation order; KVRegionError if unknown."""
        try:
            return self._index[layer_name]
        except KeyError:
            raise KVRegionError(f"layer {layer_name!r} has no registered KV cache") from None

    def layer_offset(self, layer: int) -> int:
        """Byte offset of block 0 of `layer` in the region."""
        return layer * self.num_blocks * self.block_bytes

    def page_bytes(self, layer: int, block: int) -> bytes:
        """A copy of one block of one layer (test hook digests and checks)."""
        start = self.layer_offset(layer) + block * self.block_bytes
        return bytes(self.buffer[start:start + self.block_bytes])

    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(self.layer_names)}


def _cpu_isa() -> str:
    # The CPU attention kernels lay a block out per ISA, so it is part of the signature.
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability()).lower()
    except Exception:  # an older torch: be conservative, never match another machine by accident
        return "unknown"


def layout_signature(num_layers: int, kv_heads: int, head_size: int, dtype: str, block_size: int,
                     isa: str | None = None) -> str:
    """The `kv_layout` string of a vLLM CPU cache: kvxfer's format plus the engine, the
    block layout and the ISA (raw blocks are only portable where all of them match)."""
    isa = isa or _cpu_isa()
    return f"L{num_layers}-H{kv_heads}-D{head_size}-{dtype}-bs{block_size}-vllm-lbhnc-{re.sub(r'[^a-z0-9_]', '', isa)}"


def region_from_kv_caches(kv_caches: dict[str, Any]) -> KVRegion:
    """Builds the region from `register_kv_caches`' dict; KVRegionError on any other layout."""
    if not kv_caches:
        raise KVRegionError("vLLM registered no KV cache layers")
    tensors = list(kv_caches.items())
    for name, t in tensors:
        if getattr(t, "is_cuda", False) or str(getattr(t, "device", "cpu")) != "cpu":
            raise KVRegionError(f"layer {name}: only host (CPU) KV caches are supported, got {t.device}")
        if t.dim() != 4:
            raise KVRegionError(f"layer {name}: expected [blocks, kv_heads, block_size, 2*head_size], got {tuple(t.shape)}")
    tensors.sort(key=lambda item: item[1].data_ptr())
    first = tensors[0][1]
    num_blocks, kv_heads, block_size, two_head = (int(x) for x in first.shape)
    element = first.element_size()
    block_bytes = kv_heads * block_size * two_head * element
    layer_bytes = num_blocks * block_bytes
    base = first.data_ptr()
    for i, (name, t) in enumerate(tensors):
        if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
            raise KVRegionError(f"layer {name}: shape {tuple(t.shape)} {t.dtype} differs from layer 0's")
        if int(t.stride(0)) * element != block_bytes or not t[0].is_contiguous():
            raise KVRegionError(f"layer {name}: a block is not one contiguous run of {block_bytes} bytes")
        if t.data_ptr() != base + i * layer_bytes:
            raise KVRegionError(f"layer {name}: not at offset {i * layer_bytes} of one allocation (layers must be "
                                "consecutive, as vLLM's CPU backend allocates them)")
    total = layer_bytes * len(tensors)
    buffer = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(base))
    dtype = str(first.dtype).removeprefix("torch.")
    signature = layout_signature(len(tensors), kv_heads, two_head // 2, dtype, block_size)
    return KVRegion([n for n, _ in tensors], num_blocks, block_bytes, buffer, [t for _, t in tensors], signature)
