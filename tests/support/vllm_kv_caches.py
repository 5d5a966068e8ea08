"""KV caches built exactly as vLLM's workers build them (`compute_layout_strides`,
`create_kv_cache_views` over one seeded int8 allocation), in any `KVCacheLayout`, with
attention or MLA content, on any device; and the connector's region over them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvxfer.integrations.vllm.kv_region import KVRegion, region_from_kv_caches

LAYERS, TOKENS, HEADS, HEAD_SIZE, LATENT = 3, 4, 4, 8, 24


def attention_spec(heads: int = HEADS, tokens: int = TOKENS) -> KVCacheSpec:
    """FlashAttention-style content: K then V of `heads` heads per token."""
    return FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16)


def mla_spec(tokens: int = TOKENS) -> KVCacheSpec:
    """MLA content: one latent vector per token, one head slot."""
    return MLAAttentionSpec(block_size=tokens, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)


@dataclass
class Cache:
    """One vLLM cache: its allocation, vLLM's per-layer views, and the connector's region."""

    raw: torch.Tensor
    views: list[torch.Tensor]
    region: KVRegion

    def cell(self, layer: int, block: int, head: int, token: int) -> tuple[int, int]:
        """(offset, length) of one cell where vLLM's view puts it (the oracle)."""
        view = self.views[layer][block, head, token]
        return view.data_ptr() - self.raw.data_ptr(), view.numel() * view.element_size()

    def cells(self, layer: int, block: int) -> list[tuple[int, int]]:
        """(offset, length) of every cell of one (layer, block)."""
        heads, tokens = self.views[layer].shape[1:3]
        return [self.cell(layer, block, h, n) for h in range(heads) for n in range(tokens)]

    def host_bytes(self) -> np.ndarray:
        """A host copy of the whole allocation, as bytes."""
        return self.raw.cpu().numpy().view(np.uint8)


def vllm_cache(layout: KVCacheLayout, spec: KVCacheSpec, num_blocks: int, seed: int, device: str = "cpu",
               layers: int = LAYERS) -> Cache:
    """A cache allocated and viewed as vLLM's workers do, filled with seeded bytes."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    size = layers * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.attn" for i in range(layers)],
                           layer_stride=layer_stride, block_stride=block_stride, offset=0)
    raw = torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, size, dtype=np.int8)).to(device)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    region = region_from_kv_caches(dict(zip(tensor.layers, views)), layout,
                                   latent=isinstance(spec, MLAAttentionSpec), isa="test")
    return Cache(raw, views, region)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (seeded random bytes read as bf16 hold NaNs, never equal as numbers)."""
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


def mask_of(ranges: list[tuple[int, int]], size: int) -> np.ndarray:
    """The bytes `ranges` cover; each byte named once at most."""
    mask = np.zeros(size, dtype=bool)
    for start, length in ranges:
        assert not mask[start:start + length].any(), f"byte range {start}+{length} named twice"
        mask[start:start + length] = True
    return mask


class OverlaidGroupsCache:
    """Several KV cache groups over one seeded allocation, as vLLM's `allocate_kv_cache` views
    a hybrid model's (every group's views from byte 0, so they overlay each other; one block
    pool, so no block is in two groups): `groups` names each group's layers and its spec, and
    the strides come from `page_spec` (the page every group's page is padded to)."""

    def __init__(self, groups: list[tuple[list[str], KVCacheSpec]], page_spec: KVCacheSpec, num_blocks: int,
                 seed: int, layout: KVCacheLayout = KVCacheLayout.LBHNC) -> None:
        layers_per_group = len(groups[0][0])
        layer_stride, block_stride, *_ = compute_layout_strides(page_spec, num_blocks, layers_per_group, layout)
        size = layers_per_group * num_blocks * page_spec.page_size_bytes
        self.raw = torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, size, dtype=np.int8))
        self.views: dict[str, torch.Tensor] = {}
        for names, spec in groups:
            tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride,
                                   offset=0)
            self.views.update(zip(names, create_kv_cache_views(self.raw, spec, num_blocks, layout, tensor)))

    def host_bytes(self) -> np.ndarray:
        """The whole allocation, as bytes (a view: copy it to keep a snapshot)."""
        return self.raw.numpy().view(np.uint8)

    def page_range(self, name: str, block: int) -> tuple[int, int]:
        """(offset, length) of one block's page of layer `name`, where vLLM's view puts it."""
        view = self.views[name][block]
        return view.data_ptr() - self.raw.data_ptr(), view.numel() * view.element_size()

    def head_range(self, name: str, block: int, head: int) -> tuple[int, int]:
        """(offset, length) of one head of one block of layer `name`, where vLLM's view puts it."""
        view = self.views[name][block, head]
        return view.data_ptr() - self.raw.data_ptr(), view.numel() * view.element_size()
