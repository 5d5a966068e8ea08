"""kvxfer: KV-cache transfer for disaggregated LLM prefill and decode.

The transfer engine (one-sided WriteImm over libfabric) is imported lazily so that the
model, registry and router layers can be used where the native extension is not built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvxfer.errors import (
    BoundsError,
    DescriptorError,
    EngineError,
    KvxferError,
    TransferError,
    TransferTimeout,
)
from kvxfer.transfer.shared_memory import SharedBuffer

if TYPE_CHECKING:
    from kvxfer.transfer.engine import RegisteredMemory, Transfer, TransferEngine

__all__ = [
    "BoundsError",
    "DescriptorError",
    "EngineError",
    "KvxferError",
    "RegisteredMemory",
    "SharedBuffer",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "TransferTimeout",
]


def __getattr__(name: str) -> Any:
    if name in ("TransferEngine", "Transfer", "RegisteredMemory"):
        from kvxfer.transfer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
