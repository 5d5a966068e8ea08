"""Model hyper-parameters and the KV-cache layout they imply.

Both workers of a prefill/decode pair build their model from the same `ModelConfig`, so the
config is the one place that fixes the weights (through `seed`) and the byte layout of the
KV cache (through `kv_layout` and `page_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvxfer.kv.cache import dtype_from_name
from kvxfer.kv.layout import format_kv_layout


@dataclass(frozen=True)
class ModelConfig:
    """Shape, seed and dtype of the small decoder-only transformer.

    The config is frozen so that a worker cannot drift from the layout it advertised: the
    `kv_layout` string it publishes in the registry is derived from these fields, and a
    prefiller only pushes into a decoder whose string is equal. `block_size` (tokens per KV
    page) is part of the config for the same reason: two workers that agree on every other
    field but page their cache differently cannot exchange pages. Use `preset()` for the
    named configurations and `dataclasses.replace()` (or `preset(name, **overrides)`) for
    variants.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    # float32 by default: the service compares disaggregated output with a one-process
    # reference token for token, and float32 keeps near-ties between logits rare.
    dtype: str = "float32"
    block_size: int = 16

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Small enough that a whole test file runs in seconds on two cores, while still
        # exercising grouped-query attention (4 query heads share 2 KV heads).
        "tiny": dict(
            name="tiny",
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=258,
            max_context=1024,
            rope_theta=10000.0,
        ),
        # The KV cache has Llama-3-8B's shape (32 layers, 8 KV heads of 128), so pages and
        # per-layer transfers have realistic sizes (128 KiB pages at block_size 16), but the
        # hidden and MLP sizes are cut down so that prefill runs on a 2-core CPU.
        "llama3-8b-kv": dict(
            name="llama3-8b-kv",
            num_layers=32,
            hidden_size=512,
            num_heads=8,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=1024,
            vocab_size=258,
            max_context=32768,
            rope_theta=500000.0,
        ),
    }

    def __post_init__(self) -> None:
        # Fail at construction with a message naming the field, rather than with a shape
        # error deep inside attention.
        positive = (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_context",
            "block_size",
        )
        for field_name in positive:
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field_name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and rms_eps must be positive")
        dtype_from_name(self.dtype)  # raises on an unsupported name

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """Return the named preset ("tiny" or "llama3-8b-kv"), optionally with fields replaced.

        Overrides go through the same validation as a hand-built config; an override of
        `name` is allowed so that a variant can advertise itself under its own name.
        """
        try:
            fields = cls.PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(cls.PRESETS)}") from None
        return cls(**{**fields, **overrides})

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of weights, activations and the KV cache."""
        return dtype_from_name(self.dtype)

    @property
    def dtype_size(self) -> int:
        """Bytes per element of `torch_dtype`."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page of one layer: K and V for `block_size` tokens (architecture.md)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def kv_layout(self) -> str:
        """Short stable string that two workers compare to decide whether they can exchange pages.

        It names every field that changes the bytes of a page or the number of pages per
        request (layers, KV heads, head dim, dtype, block size), e.g.
        ``"L32-H8-D128-float32-bs16"``.
        """
        return format_kv_layout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.block_size)

    def replace(self, **changes: Any) -> "ModelConfig":
        """Return a copy with `changes` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)
