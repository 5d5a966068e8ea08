"""Seeded checkpoints in Hugging Face format, made here without downloads: a Llama, a
Gemma-2 whose layers alternate between sliding-window and full attention (a hybrid model),
a GraniteMoeHybrid whose layers alternate between Mamba-2 mixers and attention, and a
Qwen3-Next whose layers alternate between gated delta-net mixers and attention.

Tests and benchmarks need a model vLLM can load, and nothing may be downloaded: this module
trains a byte-level BPE tokenizer on local text and saves a `LlamaForCausalLM` (or
`Gemma2ForCausalLM`) with seeded random weights next to it (safetensors, config.json,
tokenizer files). The directory it
writes is an ordinary checkpoint: vLLM and the kvxfer tools load it through the same code
path as a real checkpoint a user gives.

Random weights make a weak oracle (greedy tokens barely depend on the KV), so tests that
use these models compare KV bytes and logprobs as well as tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Text every Debian machine has; licences are long, varied English prose.
_CORPUS_DIRS = (Path("/usr/share/common-licenses"),)
_FALLBACK_CORPUS = (
    "kvxfer moves the KV cache of a prompt from the prefill worker to the decode worker "
    "with one-sided writes; the decoder admits the request when every write has landed. "
) * 200
_STAMP = "kvxfer-checkpoint.json"


@dataclass(frozen=True)
class CheckpointShape:
    """Size of the generated model. The defaults load in vLLM in about 15 s on 2 cores;
    `SHAPE_1B` is the benchmark's larger model."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 2048
    max_positions: int = 4096
    seed: int = 0
    dtype: str = "bfloat16"


#: About 1.1 B parameters with a 32 k vocabulary: the benchmark model.
SHAPE_1B = CheckpointShape(layers=16, hidden=2048, heads=16, kv_heads=4, intermediate=5632,
                           vocab=32000, max_positions=8192)


def _corpus() -> list[str]:
    texts: list[str] = []
    for folder in _CORPUS_DIRS:
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts or [_FALLBACK_CORPUS]


def _save_tokenizer(out_dir: Path, vocab: int) -> Any:
    """Trains the byte-level BPE on the local corpus and saves it (with a chat template) to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    # A plain chat template, so /v1/chat/completions works on the generated model.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _is_current(stamp: Path, wanted: dict[str, object]) -> bool:
    return stamp.is_file() and json.loads(stamp.read_text()) == wanted


def _write_seeded_checkpoint(out_dir: Path, shape: CheckpointShape, wanted: dict[str, object], architecture: str,
                             config_class: str, what: str, pad_with_unk: bool, **config: Any) -> Path:
    """Writes a checkpoint of the transformers class `architecture` (its config class
    `config_class`, built from `shape` and the architecture's own `config` settings) with
    seeded weights and the local tokenizer to `out_dir`, stamped with `wanted`, and returns
    it; a directory already stamped with `wanted` is kept as it is. `pad_with_unk`: the
    tokenizer's unknown token is the config's padding token."""
    out_dir = Path(out_dir)
    stamp = out_dir / _STAMP
    if _is_current(stamp, wanted):
        return out_dir
    # Imported here: transformers and tokenizers come with the vllm extra only.
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _save_tokenizer(out_dir, shape.vocab)
    if pad_with_unk:
        config["pad_token_id"] = tokenizer.unk_token_id
    model_config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, torch_dtype=shape.dtype, **config,
    )
    torch.manual_seed(shape.seed)
    model = getattr(transformers, architecture)(model_config).to(getattr(torch, shape.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    stamp.write_text(json.dumps(wanted))
    log.info("wrote a %d-layer seeded %s checkpoint to %s", shape.layers, what, out_dir)
    return out_dir


def _alternating(shape: CheckpointShape, even: str, odd: str) -> list[str]:
    """Per layer its kind: `even` for layers 0, 2, ..., `odd` for the others."""
    return [even if i % 2 == 0 else odd for i in range(shape.layers)]


def make_checkpoint(out_dir: Path, shape: CheckpointShape = CheckpointShape()) -> Path:
    """Writes the checkpoint to `out_dir` (created) and returns it.

    Idempotent: a directory already holding a checkpoint of the same shape is kept as it
    is, so fixtures can call this on every run.
    """
    return _write_seeded_checkpoint(out_dir, shape, asdict(shape), "LlamaForCausalLM", "LlamaConfig", "Llama",
                                    pad_with_unk=False, tie_word_embeddings=False)


#: Tokens a sliding-window layer of the hybrid checkpoint attends to: one 32-token block,
#: so that a prompt of a few blocks already reaches past the window.
SLIDING_WINDOW_TOKENS = 32


def make_sliding_window_checkpoint(out_dir: Path, shape: CheckpointShape = CheckpointShape(),
                                   sliding_window: int = SLIDING_WINDOW_TOKENS) -> Path:
    """Writes a seeded Gemma-2 checkpoint (a hybrid model: its layers alternate between
    sliding-window and full attention) to `out_dir` and returns it; idempotent as
    `make_checkpoint` is. vLLM's CPU attention serves Gemma-2 (sliding window, logit
    soft-capping); the head size is hidden / heads, which must be one the CPU backend takes."""
    wanted = {**asdict(shape), "architecture": "Gemma2ForCausalLM", "sliding_window": sliding_window}
    return _write_seeded_checkpoint(
        out_dir, shape, wanted, "Gemma2ForCausalLM", "Gemma2Config",
        f"Gemma-2 (sliding window {sliding_window})", pad_with_unk=True,
        head_dim=shape.hidden // shape.heads, sliding_window=sliding_window,
        layer_types=_alternating(shape, "sliding_attention", "full_attention"))


#: The Mamba-2 mixers of the Mamba hybrid checkpoint: heads x head size is the mixer's
#: inner width (2 x hidden), a small state per head so instances start fast.
MAMBA_HEADS, MAMBA_HEAD_SIZE, MAMBA_STATE_SIZE = 8, 64, 16


def make_mamba_hybrid_checkpoint(out_dir: Path, shape: CheckpointShape = CheckpointShape()) -> Path:
    """Writes a seeded GraniteMoeHybrid checkpoint (a Mamba hybrid: its layers alternate
    between a Mamba-2 mixer and full attention; dense MLPs, no experts) to `out_dir` and
    returns it; idempotent as `make_checkpoint` is. vLLM on CPU serves it with its CPU
    Mamba-2 kernels; the mixer's state (a conv window and an SSM state per request) is a
    KV cache group of its own (MambaSpec). The smallest Mamba-bearing architecture
    transformers and vLLM both have without custom code."""
    wanted = {**asdict(shape), "architecture": "GraniteMoeHybridForCausalLM",
              "mamba": [MAMBA_HEADS, MAMBA_HEAD_SIZE, MAMBA_STATE_SIZE]}
    return _write_seeded_checkpoint(
        out_dir, shape, wanted, "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
        "Mamba hybrid (GraniteMoeHybrid)", pad_with_unk=True,
        shared_intermediate_size=shape.intermediate, num_local_experts=0, num_experts_per_tok=0,
        layer_types=_alternating(shape, "linear_attention", "full_attention"),
        mamba_n_heads=MAMBA_HEADS, mamba_d_head=MAMBA_HEAD_SIZE, mamba_d_state=MAMBA_STATE_SIZE,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=MAMBA_HEADS * MAMBA_HEAD_SIZE // shape.hidden,
        position_embedding_type="rope", tie_word_embeddings=False)


#: The gated delta-net mixers of the linear-attention hybrid checkpoint: one key and one
#: value head of the size vLLM's CPU kernel takes (128), the smallest state it serves (conv
#: window plus a 128 x 128 fp32 matrix: vLLM widens the attention block to hold it).
LINEAR_KEY_HEADS, LINEAR_VALUE_HEADS, LINEAR_HEAD_SIZE = 1, 1, 128
#: Experts of its sparse MLPs (vLLM's Qwen3-Next refuses a model without one).
LINEAR_EXPERTS = 4
#: Standard deviation of its seeded weights (see the config below).
LINEAR_INITIALIZER_RANGE = 0.2


def make_linear_attention_hybrid_checkpoint(out_dir: Path, shape: CheckpointShape = CheckpointShape()) -> Path:
    """Writes a seeded Qwen3-Next checkpoint (a linear-attention hybrid: its layers
    alternate between gated delta-net mixers and gated full attention; each MLP a few
    small experts and a shared one) to `out_dir` and returns it; idempotent as `make_checkpoint` is. vLLM keeps
    each mixer's conv window and recurrent state as a state group (MambaSpec), like a
    Mamba-2 mixer's, computed by other kernels (the CPU's GDN path)."""
    wanted = {**asdict(shape), "architecture": "Qwen3NextForCausalLM",
              "linear": [LINEAR_KEY_HEADS, LINEAR_VALUE_HEADS, LINEAR_HEAD_SIZE, LINEAR_EXPERTS],
              "initializer_range": LINEAR_INITIALIZER_RANGE}
    return _write_seeded_checkpoint(
        out_dir, shape, wanted, "Qwen3NextForCausalLM", "Qwen3NextConfig",
        "linear-attention hybrid (Qwen3-Next)", pad_with_unk=True,
        head_dim=shape.hidden // shape.heads,
        layer_types=_alternating(shape, "linear_attention", "full_attention"),
        linear_num_key_heads=LINEAR_KEY_HEADS, linear_num_value_heads=LINEAR_VALUE_HEADS,
        linear_key_head_dim=LINEAR_HEAD_SIZE, linear_value_head_dim=LINEAR_HEAD_SIZE, linear_conv_kernel_dim=4,
        # vLLM's Qwen3-Next wants a sparse MLP somewhere: a few small experts in every layer.
        num_experts=LINEAR_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=shape.intermediate // 4,
        shared_expert_intermediate_size=shape.intermediate // 4, decoder_sparse_step=1, mlp_only_layers=[],
        # Wider weights than the default 0.02 give peaked logits: at 0.02 the next-token
        # distribution is nearly flat, and the rounding that differs between vLLM's chunked
        # delta-rule kernel and its one-token step (a decoder computes the last prompt token
        # in the latter) flips greedy picks between near-equal tokens.
        initializer_range=LINEAR_INITIALIZER_RANGE, tie_word_embeddings=False)
