"""The model side of kvxfer: config, byte tokenizer and the seeded paged-attention transformer.

Names are imported lazily: the router needs only the tokenizer and must not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "kvxfer.model.config",
    "BOS_ID": "kvxfer.model.tokenizer",
    "EOS_ID": "kvxfer.model.tokenizer",
    "VOCAB_SIZE": "kvxfer.model.tokenizer",
    "ByteTokenizer": "kvxfer.model.tokenizer",
    "DEFAULT_PREFILL_CHUNK_TOKENS": "kvxfer.model.transformer",
    "DecodeRequest": "kvxfer.model.transformer",
    "FinishReason": "kvxfer.model.transformer",
    "Generation": "kvxfer.model.transformer",
    "LayerDoneCallback": "kvxfer.model.transformer",
    "PrefillChunk": "kvxfer.model.transformer",
    "PrefillResult": "kvxfer.model.transformer",
    "Transformer": "kvxfer.model.transformer",
    "finish_reason_after": "kvxfer.model.transformer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer.model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
