"""vLLM's paged KV cache seen as one registered region: layer order, geometry, kv_layout.

vLLM allocates one backing buffer per KV cache group and hands the connector one view per
layer, logically `[num_blocks, heads, block_size, content]` (content: one head's K then V
of one token, or MLA's latent vector with one head slot), laid out in memory by the
resolved `KVCacheLayout` (the CPU backend: LBHNC only). This module reads the layout and
the views' strides into one `CacheGeometry` (`kvxfer.kv.cache_geometry`), checks that the views
are exactly that layout packed densely in one allocation, and refuses anything else with a
clear error. Offsets, runs and writes come from the geometry; the `kv_layout` string shown to
peers and the registry is derived from it, for display and compatibility checks only.

Several KV cache groups (a hybrid model under vLLM's hybrid KV cache manager: full and
sliding-window attention) overlay one allocation: vLLM gives every group the same number
of layers and puts layer i of each group in the same place (one "slot" of the geometry),
and block ids come from one pool, so a block id names a page of one group only. The region
lists every attention layer once (its "layer index", in slot then group order) with the
geometry layer (slot) that holds it and its group; the kv_layout of such a cache carries
the groups' shape as a tag, so that a peer with another grouping, or one that knows only
one group, never matches it.

Mamba/SSM state groups (`state_groups.py`) overlay the same allocation: a mixer layer's
state for a block is the first `state_bytes` of that block's page in one of the attention
slots (vLLM pads the state page to the attention page). The region lists those layers too,
in their slot and group, with their state length: their runs, copies and checksums cover
the state only, and the kv_layout's groups tag covers the state shapes.
"""

from __future__ import annotations

import ctypes
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvxfer.errors import KvxferError
from kvxfer.kv.cache_geometry import CacheGeometry

from .state_groups import StateGroup


class KVRegionError(KvxferError, ValueError):
    """vLLM's KV cache does not have the layout the connector can push."""


@dataclass
class KVRegion:
    """The whole KV allocation as one buffer, plus what a reservation needs to address it."""

    layer_names: list[str]
    geometry: CacheGeometry
    buffer: np.ndarray | None  # uint8 view over a host allocation (does not own it); None on a device
    owners: list[Any]  # the tensors that keep the allocation alive
    dtype: str  # element type of the views, e.g. "bfloat16"
    element_bytes: int
    isa: str  # the CPU kernel family whose in-block byte order the blocks follow ("cuda" on a GPU)
    device_bytes: Any = None  # flat uint8 tensor over a device allocation (buffer is None then)
    #: Per layer index: the geometry layer (slot) holding it; None: the same index (one group).
    slots: list[int] | None = None
    #: Per layer index: its KV cache group; None: every layer in group 0.
    groups: list[int] | None = None
    #: Per layer index: bytes of its Mamba/SSM state (0: an attention layer); None: no state layers.
    state_bytes: list[int] | None = None
    #: The state groups' tensor shapes, for the kv_layout.
    state_shapes: tuple[str, ...] = ()
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(self.layer_names)}

    @property
    def num_groups(self) -> int:
        """KV cache groups (1 unless vLLM's hybrid manager split the layers)."""
        return 1 + max(self.groups) if self.groups else 1

    def slot(self, layer: int) -> int:
        """The geometry layer that holds layer index `layer` (its own index with one group)."""
        return self.slots[layer] if self.slots is not None else layer

    def group(self, layer: int) -> int:
        """The KV cache group of layer index `layer`."""
        return self.groups[layer] if self.groups is not None else 0

    def state_length(self, layer: int) -> int:
        """Bytes of layer index `layer`'s Mamba/SSM state at the start of its page; 0 for an
        attention layer (its whole page is KV)."""
        return self.state_bytes[layer] if self.state_bytes is not None else 0

    def layer_runs(self, layer: int, block: int, heads: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """(offset, length) of the byte runs that hold one block of layer index `layer`
        (`heads` of it, where given): its state only for a Mamba/SSM layer."""
        state = self.state_length(layer)
        if state:
            return [(self.geometry.offset(self.slot(layer), block), state)]
        return self.geometry.runs(self.slot(layer), block, heads)

    def group_layers(self, group: int) -> list[int]:
        """The layer indexes of `group`."""
        return [i for i in range(self.num_layers) if self.group(i) == group]

    @property
    def on_host(self) -> bool:
        """The cache is host memory the engine can register (else it moves through staging)."""
        return self.device_bytes is None

    @property
    def cache_bytes(self) -> Any:
        """The whole allocation as a flat uint8 tensor, on the cache's device."""
        if self.device_bytes is not None:
            return self.device_bytes
        return torch.from_numpy(self.buffer)

    @property
    def num_layers(self) -> int:
        """Attention layers, in allocation order (more than the geometry's layers where
        several groups share its slots)."""
        return len(self.layer_names)

    @property
    def num_blocks(self) -> int:
        """Blocks per layer."""
        return self.geometry.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one (layer, block), every head."""
        return self.geometry.page_bytes

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.geometry.block_size

    @property
    def kv_layout(self) -> str:
        """The `kv_layout` string peers compare: raw blocks are only portable where the
        shape, dtype, block size, layout and ISA all match. Derived, never parsed."""
        return self.kv_layout_with_heads(self.geometry.num_heads)

    def instance_kv_layout(self, total_kv_heads: int) -> str:
        """The `kv_layout` of the whole instance in the registry: this rank's kv_layout with
        every rank's KV heads (`total_kv_heads`), so that instances of one model with
        different tensor parallel sizes compare equal (the router checks the sizes apart)."""
        return self.kv_layout_with_heads(1 if self.geometry.latent else total_kv_heads)

    def kv_layout_with_heads(self, num_heads: int) -> str:
        """The kv_layout of a cache like this one with `num_heads` KV heads per block (a
        tensor parallel peer of another size)."""
        g = self.geometry
        elements = g.content_bytes // self.element_bytes
        # Attention content is K then V of one head: D is the head size. MLA's is one latent vector.
        head = f"D{elements}-{self.dtype}" if g.latent else f"D{elements // 2}-{self.dtype}"
        kind = "-mla" if g.latent else ""
        isa = re.sub(r"[^a-z0-9_]", "", self.isa)
        return f"L{g.num_layers}-H{num_heads}-{head}-bs{g.block_size}-vllm-{g.layout.lower()}{kind}-{isa}" \
               f"{self._groups_tag()}"

    def _groups_tag(self) -> str:
        # Several groups: their count and a digest of which layer is in which group and
        # slot, so that only a peer grouping the layers alike matches; one group: nothing
        # (the one-group kv_layout is unchanged, for peers written before groups).
        if self.num_groups == 1:
            return ""
        shape = ";".join(f"{n}:{self.slot(i)}:{self.group(i)}" + (f":s{self.state_length(i)}" if self.state_length(i)
                                                                   else "") for i, n in enumerate(self.layer_names))
        # A state group's shapes join the digest (and mark the tag): a peer whose mixers
        # hold another state never matches. Attention-only tags are as before.
        ssm = ""
        if self.state_shapes:
            shape, ssm = shape + "|" + ";".join(self.state_shapes), "-ssm"
        return f"-hma{self.num_groups}{ssm}_{zlib.crc32(shape.encode()):08x}"

    def layer_index(self, layer_name: str) -> int:
        """Index of `layer_name` in allocation order; KVRegionError if unknown."""
        try:
            return self._index[layer_name]
        except KeyError:
            raise KVRegionError(f"layer {layer_name!r} has no registered KV cache") from None

    def page_bytes(self, layer: int, block: int, heads: tuple[int, int] | None = None) -> bytes:
        """A copy of one block of one layer (of heads `heads` of it where given), its runs in
        address order (digest checks)."""
        runs = self.layer_runs(layer, block, heads)
        if self.buffer is not None:
            return b"".join(bytes(self.buffer[start:start + length]) for start, length in runs)
        flat = self.device_bytes
        return b"".join(flat[start:start + length].cpu().numpy().tobytes() for start, length in runs)


def _cpu_isa() -> str:
    # The CPU attention kernels lay a block out per ISA, so it is part of the kv_layout.
    try:
        return str(torch.backends.cpu.get_cpu_capability()).lower()
    except Exception:  # an older torch: be conservative, never match another machine by accident
        return "unknown"


def _matches(geometry: CacheGeometry, observed: list[int | None]) -> bool:
    # An axis of extent 1 has no meaningful stride (torch reports anything there).
    return all(seen is None or extent == 1 or seen == want
               for seen, want, extent in zip(observed, geometry.strides, geometry.shape))


def _slots_and_groups(tensors: list[tuple[str, Any]], groups: Sequence[Sequence[str]] | None
                      ) -> tuple[list[tuple[str, Any]], list[int] | None, list[int] | None]:
    """(the layers in slot then group order, their slots, their groups); slots and groups
    None for one group. Layers of several groups may share a slot (one per group)."""
    if groups is None or len(groups) <= 1:
        return tensors, None, None
    group_of = {name: g for g, names in enumerate(groups) for name in names}
    missing = [name for name, _ in tensors if name not in group_of]
    if missing:
        raise KVRegionError(f"layers {missing[:4]} are in no KV cache group")
    starts = sorted({t.data_ptr() for _, t in tensors})
    slot_of = {ptr: i for i, ptr in enumerate(starts)}
    ordered = sorted(tensors, key=lambda item: (item[1].data_ptr(), group_of[item[0]]))
    slots = [slot_of[t.data_ptr()] for _, t in ordered]
    layer_groups = [group_of[name] for name, _ in ordered]
    seen = set(zip(slots, layer_groups))
    if len(seen) != len(ordered):
        raise KVRegionError("two layers of one KV cache group share a place in the allocation")
    return ordered, slots, layer_groups


def region_from_kv_caches(kv_caches: dict[str, Any], layout: KVCacheLayout | None = None, *,
                          latent: bool = False, isa: str | None = None,
                          groups: Sequence[Sequence[str]] | None = None,
                          state_groups: Sequence[StateGroup] = ()) -> KVRegion:
    """Builds the region from `register_kv_caches`' dict.

    `layout` is vLLM's resolved layout (None: the one of the six the strides show);
    `latent` marks MLA content; `groups` are the layer names of each KV cache group
    (kv_cache_config.kv_cache_groups; None or one: every layer has a place of its own);
    `state_groups` those of them that hold Mamba/SSM state (their layers' views are
    vLLM's raw `[blocks, 1, 1, state bytes]` pages over the attention slots).
    Host and CUDA tensors; KVRegionError for other devices, views of different shapes,
    layers spread over several allocations, or strides that are not `layout` packed
    densely (padded pages), or a state that is not at the start of an attention page.
    """
    state_names = {name for group in state_groups for name in group.layer_names}
    attention = {name: view for name, view in kv_caches.items() if name not in state_names}
    region = _attention_region(attention, layout, latent=latent, isa=isa, groups=groups)
    states = {name: view for name, view in kv_caches.items() if name in state_names}
    return _with_state_layers(region, states, state_groups) if states else region


def _with_state_layers(region: KVRegion, views: dict[str, Any], state_groups: Sequence[StateGroup]) -> KVRegion:
    """`region` with the Mamba/SSM layers of `views` placed in their slots and groups."""
    g = region.geometry
    if not region.on_host:
        raise KVRegionError("Mamba/SSM state is pushed from host (CPU) caches only")
    if g.block_runs() != [(0, g.page_bytes)]:
        raise KVRegionError(f"a block of layout {g.layout} is not one run of its page; a Mamba/SSM state page "
                            "overlays one (LBHNC)")
    group_of = {name: group for group in state_groups for name in group.layer_names}
    base, layer_stride = region.owners[0].data_ptr(), g.strides[0]
    entries = [(name, region.slot(i), region.group(i), 0) for i, name in enumerate(region.layer_names)]
    for name, view in views.items():
        offset = view.data_ptr() - base
        slot = offset // layer_stride if layer_stride else 0
        if view.device.type != "cpu" or offset != slot * layer_stride or not 0 <= slot < g.num_layers:
            raise KVRegionError(f"Mamba/SSM layer {name}: its state is not at the start of an attention layer's "
                                "place in the allocation")
        state = int(np.prod(view.shape[1:])) * view.element_size()
        if view.stride(0) * view.element_size() != g.block_stride or state != group_of[name].state_bytes \
                or state > g.page_bytes:
            raise KVRegionError(f"Mamba/SSM layer {name}: {state} state bytes every "
                                f"{view.stride(0) * view.element_size()} bytes; expected "
                                f"{group_of[name].state_bytes} every {g.block_stride} (one attention page)")
        entries.append((name, slot, group_of[name].group, state))
    entries.sort(key=lambda e: (e[1], e[2]))
    if len({(slot, group) for _, slot, group, _ in entries}) != len(entries):
        raise KVRegionError("two layers of one KV cache group share a place in the allocation")
    return replace(region, layer_names=[e[0] for e in entries], slots=[e[1] for e in entries],
                   groups=[e[2] for e in entries], state_bytes=[e[3] for e in entries],
                   state_shapes=tuple(group.shapes for group in state_groups))


def _attention_region(kv_caches: dict[str, Any], layout: KVCacheLayout | None, *, latent: bool,
                      isa: str | None, groups: Sequence[Sequence[str]] | None) -> KVRegion:
    """The region of the attention layers (`region_from_kv_caches` without state layers)."""
    if not kv_caches:
        raise KVRegionError("vLLM registered no KV cache layers")
    tensors = sorted(kv_caches.items(), key=lambda item: item[1].data_ptr())
    tensors, slots, layer_groups = _slots_and_groups(tensors, groups)
    names, views = [n for n, _ in tensors], tensors
    if slots is not None:
        # One view per slot describes the allocation; the others alias it.
        tensors = [tensors[i] for i in range(len(tensors)) if i == 0 or slots[i] != slots[i - 1]]
    for name, t in views:
        if t.device.type not in ("cpu", "cuda"):
            raise KVRegionError(f"layer {name}: only host (CPU) and CUDA KV caches are supported, got {t.device}")
        if t.dim() != 4:
            raise KVRegionError(f"layer {name}: expected a [blocks, heads, block_size, content] view, "
                                f"got {tuple(t.shape)}")
    first = tensors[0][1]
    element = first.element_size()
    storage = first.untyped_storage()
    for name, t in views:
        if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype or t.stride() != first.stride() \
                or t.device != first.device:
            raise KVRegionError(f"layer {name}: shape {tuple(t.shape)} {t.dtype} strides {t.stride()} differ "
                                f"from layer 0's ({tuple(first.shape)} {first.dtype} {first.stride()})")
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            raise KVRegionError(f"layer {name}: not in the allocation of layer 0 (one allocation for every "
                                "layer is what vLLM allocates for one KV cache group)")
    num_blocks, heads, block_size, content = (int(x) for x in first.shape)
    base = first.data_ptr()
    layer_stride = tensors[1][1].data_ptr() - base if len(tensors) > 1 else None
    for i, (name, t) in enumerate(tensors):
        if layer_stride is not None and t.data_ptr() != base + i * layer_stride:
            raise KVRegionError(f"layer {name}: not at offset {i * layer_stride} of the allocation (layers must "
                                "be evenly spaced, as vLLM lays out one KV cache group)")
    if int(first.stride(3)) != 1:
        raise KVRegionError(f"the content axis is not contiguous (strides {first.stride()})")
    # The geometry counts content in bytes: its innermost stride is one byte.
    observed = [layer_stride, *(int(s) * element for s in first.stride()[:3]), 1]
    candidates = [layout] if layout is not None else list(KVCacheLayout)
    geometry = None
    for candidate in candidates:
        trial = CacheGeometry.dense(candidate.name, candidate.value, len(tensors), num_blocks, heads, block_size,
                                 content * element, latent=latent)
        if _matches(trial, observed):
            geometry = trial
            break
    if geometry is None:
        named = f"layout {layout.name}" if layout is not None else "any of vLLM's KV cache layouts"
        raise KVRegionError(f"the KV cache's byte strides (L, B, H, N, C) {observed} are not {named} packed "
                            "densely (padded pages are not supported)")
    if base < storage.data_ptr() or base + geometry.total_bytes > storage.data_ptr() + storage.nbytes():
        raise KVRegionError(f"the KV cache's {geometry.total_bytes} bytes ({geometry.layout}) overrun its "
                            f"allocation of {storage.nbytes()} bytes")
    dtype = str(first.dtype).removeprefix("torch.")
    owners = [t for _, t in tensors]
    if first.device.type == "cuda":
        # Device blocks have no CPU kernel's byte order: "cuda" keeps them apart from CPU ones.
        flat = first.new_empty(0, dtype=torch.uint8).set_(storage, base - storage.data_ptr(),
                                                         (geometry.total_bytes,), (1,))
        return KVRegion(names, geometry, None, owners, dtype, element, isa or "cuda",
                        device_bytes=flat, slots=slots, groups=layer_groups)
    buffer = np.ctypeslib.as_array((ctypes.c_uint8 * geometry.total_bytes).from_address(base))
    return KVRegion(names, geometry, buffer, owners, dtype, element, isa or _cpu_isa(), slots=slots,
                    groups=layer_groups)
