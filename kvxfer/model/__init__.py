"""The model side of kvxfer: config, byte tokenizer and the seeded paged-attention transformer."""

from kvxfer.model.config import ModelConfig
from kvxfer.model.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, ByteTokenizer
from kvxfer.model.transformer import (
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DecodeRequest,
    FinishReason,
    Generation,
    LayerDoneCallback,
    PrefillChunk,
    PrefillResult,
    Transformer,
    finish_reason_after,
)

__all__ = [
    "BOS_ID",
    "DEFAULT_PREFILL_CHUNK_TOKENS",
    "EOS_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "DecodeRequest",
    "FinishReason",
    "Generation",
    "LayerDoneCallback",
    "ModelConfig",
    "PrefillChunk",
    "PrefillResult",
    "Transformer",
    "finish_reason_after",
]
