"""A small Llama-style decoder-only transformer whose attention reads K/V from a paged cache.

The weights are random but seeded (`ModelConfig.seed`), so every process that builds the
same config holds bit-identical weights: a prefiller and a decoder on different machines
compute on the same model without shipping a checkpoint. The blocks are the Llama ones:
RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP, untied LM head.

Attention never keeps K/V in Python state: every layer writes the new tokens' K/V into the
request's pages of a `PagedKVCache` and reads the whole context back through the request's
block table. That makes the cache the only state of a request, which is what allows the
prefiller to push the pages and the decoder to continue from them.

Exactness rules the service relies on:

* a request's decode output does not depend on the other requests in its batch, bit for
  bit (see `Transformer.decode_logits` for how);
* prefill with the same prompt, the same weights and the same `chunk_size` is
  bit-reproducible, so a reference run and a disaggregated run that use the same chunk size
  produce identical KV pages; different chunk sizes agree within float tolerance only.

Both hold for processes on the same CPU type and torch build: MKL picks its kernels by
instruction set, so an AVX-512 machine and an AVX2 machine may round differently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from kvxfer.kv.cache import BlockTable, KVCacheError, PagedKVCache
from kvxfer.model.config import ModelConfig
from kvxfer.model.tokenizer import EOS_ID, VOCAB_SIZE

#: Default prefill chunk in tokens. A multiple of every block size in use (16) so each page
#: is completed by exactly one chunk and pushed once; large enough that the per-chunk
#: matmuls are efficient, small enough that the first layer's pages can leave early.
DEFAULT_PREFILL_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class PrefillChunk:
    """One chunk of a chunked prefill, as passed to the `on_layer_done` callback.

    Tokens ``start_pos .. end_pos - 1`` were computed in this chunk; their K/V for the layer
    just finished lie in the block-table entries ``first_block .. end_block - 1`` (page ids
    ``block_table[first_block:end_block]``). Because chunk sizes are multiples of the block
    size, no later chunk writes those pages again, so they can be pushed right away (the
    prompt's last page may be partly filled; the decoder fills the rest as it decodes).
    """

    index: int
    start_pos: int
    end_pos: int
    first_block: int
    end_block: int
    is_last: bool

    @property
    def blocks(self) -> range:
        """Block-table indices whose pages this chunk wrote."""
        return range(self.first_block, self.end_block)


#: Callback invoked after each (chunk, layer) of a prefill: ``on_layer_done(layer, chunk)``.
#: The KV push hooks in here: when it is called, that layer's pages of that chunk are final.
LayerDoneCallback = Callable[[int, PrefillChunk], None]


@dataclass(frozen=True)
class PrefillResult:
    """Outcome of a prefill: the greedy first token and the logits it was taken from.

    `logits` is the ``[vocab_size]`` vector of the last prompt position; `num_tokens` is the
    prompt length, i.e. the position at which the first decode step writes its K/V.
    """

    first_token: int
    logits: torch.Tensor
    num_tokens: int


class DecodeRequest(NamedTuple):
    """One request's entry in a decode batch.

    `last_token` sits at `position` (its K/V is written there during the step) and
    `block_table` must hold at least ``position + 1`` tokens. The step returns the token for
    ``position + 1``.
    """

    last_token: int
    position: int
    block_table: BlockTable


class FinishReason(str, Enum):
    """Why a generation ended: the model emitted EOS (`STOP`) or hit `max_tokens` (`LENGTH`)."""

    STOP = "stop"
    LENGTH = "length"


def finish_reason_after(token: int, num_kept: int, max_tokens: int) -> Optional[FinishReason]:
    """Decide whether a generation ends on `token`, given `num_kept` tokens kept before it.

    EOS ends the generation and is not kept (`STOP`). Any other token is kept; if that makes
    `max_tokens` kept tokens, the generation ends (`LENGTH`). Returns None to continue. The
    decode worker must apply the same rule as `Transformer.generate` to match it token for
    token, which is why the rule lives in one function.
    """
    if token == EOS_ID:
        return FinishReason.STOP
    if num_kept + 1 >= max_tokens:
        return FinishReason.LENGTH
    return None


@dataclass(frozen=True)
class Generation:
    """Tokens generated after the prompt (EOS excluded) and why generation stopped."""

    tokens: list[int]
    finish_reason: FinishReason


@dataclass
class _LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    out: torch.Tensor  # [hidden, num_heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class Transformer:
    """Seeded decoder-only transformer with layer-by-layer prefill and per-request-exact decode.

    Build one per process from a `ModelConfig`; the weights depend only on the config. The
    API follows the disaggregated flow: a prefiller calls `prefill` (or `embed`,
    `prefill_layer` and `logits` itself) with an `on_layer_done` hook that pushes each
    layer's pages; a decoder calls `decode_step` on its running batch every iteration;
    `generate` is the one-process reference that both are compared with. All compute is on
    CPU in `config.dtype`, and every K/V read and write goes through a `PagedKVCache` whose
    `kv_layout` must equal `config.kv_layout`.
    """

    def __init__(self, config: ModelConfig) -> None:
        if config.vocab_size < VOCAB_SIZE:
            raise ValueError(
                f"vocab_size {config.vocab_size} cannot hold the byte tokenizer's {VOCAB_SIZE} ids"
            )
        self._config = config
        dtype = config.torch_dtype
        gen = torch.Generator().manual_seed(config.seed)

        def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
            # Drawn in float32 then cast, so a float16/bfloat16 config gets the same weights
            # rounded, not a different random stream.
            return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)

        hidden, inter = config.hidden_size, config.intermediate_size
        q_dim = config.num_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        # Scaling: projections use 1/sqrt(fan_in) so their outputs have unit variance after
        # RMSNorm; the two residual branches are further divided by sqrt(2 * num_layers) so the
        # residual stream stays O(1) over 32 layers and the last layers still matter. The
        # embedding has unit variance and the LM head is separate (not tied): with a tied
        # head, a random model mostly predicts its own input token and greedy output
        # collapses to one repeated token.
        residual_scale = 1.0 / math.sqrt(2 * config.num_layers)
        self._embedding = normal((config.vocab_size, hidden), 1.0)
        self._layers: list[_LayerWeights] = []
        for _ in range(config.num_layers):
            self._layers.append(
                _LayerWeights(
                    attn_norm=torch.ones(hidden, dtype=dtype),
                    qkv=normal((q_dim + 2 * kv_dim, hidden), 1.0 / math.sqrt(hidden)),
                    out=normal((hidden, q_dim), residual_scale / math.sqrt(q_dim)),
                    mlp_norm=torch.ones(hidden, dtype=dtype),
                    gate_up=normal((2 * inter, hidden), 1.0 / math.sqrt(hidden)),
                    down=normal((hidden, inter), residual_scale / math.sqrt(inter)),
                )
            )
        self._final_norm = torch.ones(hidden, dtype=dtype)
        self._lm_head = normal((config.vocab_size, hidden), 1.0 / math.sqrt(hidden))

        # Rotary tables for every position, computed once in float64: indexing a table gives
        # a position the same cos/sin whatever chunk it is computed in, which elementwise
        # trig on each chunk does not guarantee (vectorised and scalar tails may round
        # differently).
        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / config.head_dim))
        angles = torch.arange(config.max_context, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self._rope_cos = angles.cos().to(dtype)
        self._rope_sin = angles.sin().to(dtype)
        self._q_dim = q_dim
        self._kv_dim = kv_dim
        self._scale = 1.0 / math.sqrt(config.head_dim)

    @property
    def config(self) -> ModelConfig:
        """The config the weights were built from."""
        return self._config

    def num_parameters(self) -> int:
        """Total number of weight elements (embedding, layers, final norm, LM head)."""
        total = self._embedding.numel() + self._final_norm.numel() + self._lm_head.numel()
        for w in self._layers:
            total += sum(t.numel() for t in (w.attn_norm, w.qkv, w.out, w.mlp_norm, w.gate_up, w.down))
        return total

    # ---- building blocks of a prefill ---------------------------------------------------

    def embed(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Return the ``[len(tokens), hidden_size]`` input embeddings of `tokens`."""
        ids = self._token_tensor(tokens)
        return self._embedding.index_select(0, ids)

    def prefill_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        kv_cache: PagedKVCache,
        block_table: BlockTable,
        start_pos: int,
    ) -> torch.Tensor:
        """Run one layer over a chunk of one request and return the chunk's new hidden states.

        `hidden` is ``[num_tokens, hidden_size]`` for positions ``start_pos ..
        start_pos + num_tokens - 1``. The chunk's K/V for `layer` are written into the
        request's pages (`block_table`) before attention, and attention reads positions
        ``0 .. start_pos + num_tokens - 1`` back from the cache, so earlier chunks must have
        run this layer already.
        """
        self._check_cache(kv_cache)
        if not 0 <= layer < self._config.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self._config.num_layers - 1}")
        if hidden.dim() != 2 or hidden.shape[1] != self._config.hidden_size:
            raise ValueError(f"hidden must be [num_tokens, {self._config.hidden_size}], got {tuple(hidden.shape)}")
        self._check_positions(start_pos, hidden.shape[0])
        table = torch.as_tensor(block_table, dtype=torch.long)
        return self._layer_forward(layer, hidden, kv_cache, table, start_pos)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the final norm and LM head: ``[..., hidden_size]`` -> ``[..., vocab_size]``."""
        return F.linear(self._rms_norm(hidden, self._final_norm), self._lm_head)

    # ---- prefill ------------------------------------------------------------------------

    def prefill(
        self,
        tokens: Sequence[int],
        kv_cache: PagedKVCache,
        block_table: BlockTable,
        *,
        chunk_size: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS,
        on_layer_done: Optional[LayerDoneCallback] = None,
        start_pos: int = 0,
    ) -> PrefillResult:
        """Run chunked prefill of a prompt into its pages and return the greedy first token.

        The prompt is cut into chunks of `chunk_size` tokens (None: one chunk). For each
        chunk, layers run in order, and after each layer `on_layer_done(layer, chunk)` is
        called: that layer's pages for the chunk are final then, so a pusher can send them
        while the next layer computes. `chunk_size` must be a multiple of the block size so
        that no page is shared by two chunks (each page is pushed exactly once). The result
        equals one-shot prefill within float tolerance; with the same `chunk_size` it is
        bit-reproducible.

        `start_pos` (a multiple of the block size, below the prompt's length) skips a
        cached prefix: the pages of tokens ``0 .. start_pos - 1`` must already hold their
        K/V (a prefix-cache hit); they are read, never written, and only the rest is
        computed. Chunk boundaries stay at multiples of `chunk_size` counted from token 0, so
        a hit shortens only the first chunk it computes; the result equals computing
        everything within float tolerance.
        """
        self._check_cache(kv_cache)
        cfg = self._config
        num_tokens = len(tokens)
        if num_tokens == 0:
            raise ValueError("prefill needs at least one prompt token")
        self._check_positions(0, num_tokens)
        if not 0 <= start_pos < num_tokens or start_pos % cfg.block_size:
            raise ValueError(
                f"start_pos must be a multiple of block_size {cfg.block_size} below the prompt's "
                f"{num_tokens} tokens, got {start_pos}"
            )
        if chunk_size is None:
            chunk_size = num_tokens
        elif chunk_size <= 0 or chunk_size % cfg.block_size != 0:
            raise ValueError(
                f"chunk_size must be a positive multiple of block_size {cfg.block_size}, got {chunk_size}"
            )
        table = torch.as_tensor(block_table, dtype=torch.long)
        # Validate the table once up front so a short table fails before any compute or push.
        if table.dim() != 1 or table.numel() * cfg.block_size < num_tokens:
            raise KVCacheError(
                f"block table of {table.numel()} pages holds {table.numel() * cfg.block_size} tokens, "
                f"prompt has {num_tokens}"
            )
        ids = self._token_tensor(tokens)

        hidden_last = None
        num_chunks = math.ceil(num_tokens / chunk_size)
        for index in range(start_pos // chunk_size, num_chunks):
            start, end = max(index * chunk_size, start_pos), min((index + 1) * chunk_size, num_tokens)
            chunk = PrefillChunk(
                index=index,
                start_pos=start,
                end_pos=end,
                first_block=start // cfg.block_size,
                end_block=math.ceil(end / cfg.block_size),
                is_last=index == num_chunks - 1,
            )
            hidden = self._embedding.index_select(0, ids[start:end])
            for layer in range(cfg.num_layers):
                hidden = self._layer_forward(layer, hidden, kv_cache, table, start)
                if on_layer_done is not None:
                    on_layer_done(layer, chunk)
            hidden_last = hidden[-1]
        assert hidden_last is not None
        logits = self.logits(hidden_last)
        return PrefillResult(first_token=int(torch.argmax(logits)), logits=logits, num_tokens=num_tokens)

    # ---- decode -------------------------------------------------------------------------

    def decode_logits(self, batch: Sequence[DecodeRequest], kv_cache: PagedKVCache) -> torch.Tensor:
        """Run one decode step for every request of a batch and return ``[len(batch), vocab]`` logits.

        Each request writes its `last_token`'s K/V at its `position` and attends over
        positions ``0 .. position`` of its own pages. The requests are computed one at a
        time, each with exactly the shapes it would have alone: MKL's batched matmul on
        CPU does NOT give a row the same bits as a single-row matmul (measured with torch
        2.13: rows differ for every batch size above 1, and also differ between batch sizes),
        and the service compares disaggregated generation with a one-process reference
        token for token. Per-request compute makes a request's logits independent of its
        batch-mates by construction, at the cost of reading the weights once per request
        instead of once per batch. Scheduling (who joins and leaves the batch) is still
        continuous batching; only the arithmetic is per request.
        """
        self._check_cache(kv_cache)
        rows = []
        for request in batch:
            rows.append(self._decode_one(request, kv_cache))
        if not rows:
            return torch.empty((0, self._config.vocab_size), dtype=self._config.torch_dtype)
        return torch.stack(rows)

    def decode_step(self, batch: Sequence[DecodeRequest], kv_cache: PagedKVCache) -> list[int]:
        """Run one decode step for a batch and return each request's greedy next token, in order.

        See `decode_logits` for the exactness guarantee: a request's token does not depend
        on which other requests share the batch.
        """
        logits = self.decode_logits(batch, kv_cache)
        return [int(t) for t in torch.argmax(logits, dim=-1)]

    # ---- reference ----------------------------------------------------------------------

    def generate(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        chunk_size: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS,
    ) -> Generation:
        """Generate greedily in one process: prefill, then decode until EOS or `max_tokens`.

        This is the "colocated" reference that disaggregated generation is compared with.
        It uses a private cache with pages in order; the first generated token comes from
        the prefill logits, later ones from `decode_step` with a batch of one. The stopping
        rule is `finish_reason_after`.
        """
        cfg = self._config
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        total = len(prompt_tokens) + max_tokens
        if total > cfg.max_context:
            raise ValueError(f"prompt ({len(prompt_tokens)}) + max_tokens ({max_tokens}) exceeds max_context {cfg.max_context}")
        num_pages = math.ceil(total / cfg.block_size)
        kv_cache = PagedKVCache.from_config(cfg, num_pages)
        block_table = list(range(num_pages))

        token = self.prefill(prompt_tokens, kv_cache, block_table, chunk_size=chunk_size).first_token
        position = len(prompt_tokens)
        kept: list[int] = []
        while True:
            reason = finish_reason_after(token, len(kept), max_tokens)
            if reason is not FinishReason.STOP:
                kept.append(token)
            if reason is not None:
                return Generation(tokens=kept, finish_reason=reason)
            token = self.decode_step([DecodeRequest(token, position, block_table)], kv_cache)[0]
            position += 1

    # ---- internals ----------------------------------------------------------------------

    def _decode_one(self, request: DecodeRequest, kv_cache: PagedKVCache) -> torch.Tensor:
        token, position, block_table = request
        self._check_positions(position, 1)
        table = torch.as_tensor(block_table, dtype=torch.long)
        hidden = self._embedding.index_select(0, self._token_tensor([token]))
        for layer in range(self._config.num_layers):
            hidden = self._layer_forward(layer, hidden, kv_cache, table, position)
        return self.logits(hidden[0])

    def _layer_forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        kv_cache: PagedKVCache,
        table: torch.Tensor,
        start_pos: int,
    ) -> torch.Tensor:
        cfg = self._config
        w = self._layers[layer]
        num_tokens = hidden.shape[0]
        end_pos = start_pos + num_tokens

        qkv = F.linear(self._rms_norm(hidden, w.attn_norm), w.qkv)
        q, k, v = qkv.split([self._q_dim, self._kv_dim, self._kv_dim], dim=-1)
        cos = self._rope_cos[start_pos:end_pos, None, :]
        sin = self._rope_sin[start_pos:end_pos, None, :]
        q = self._rotate(q.reshape(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)
        k = self._rotate(k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)

        # Write first, then read the whole context back from the pages: attention sees
        # exactly the bytes that the cache (and so the transfer) holds, including its own
        # chunk's K/V.
        kv_cache.write_tokens(layer, table, start_pos, k, v)
        keys, values = kv_cache.gather_tokens(layer, table, end_pos)
        attn = self._attention(q, keys, values, start_pos)

        hidden = hidden + F.linear(attn, w.out)
        gate, up = F.linear(self._rms_norm(hidden, w.mlp_norm), w.gate_up).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, w.down)

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Causal grouped-query attention of ``q [T, H, D]`` over ``keys/values [S, Hkv, D]``."""
        cfg = self._config
        num_tokens, context = q.shape[0], keys.shape[0]
        group = cfg.num_heads // cfg.num_kv_heads
        # Query head h uses KV head h // group (Llama's repeat_interleave convention). Folding
        # the group into the row dimension lets one matmul per KV head serve all its query
        # heads without materialising repeated K/V.
        q = (q * self._scale).reshape(num_tokens, cfg.num_kv_heads, group, cfg.head_dim)
        q = q.permute(1, 2, 0, 3).reshape(cfg.num_kv_heads, group * num_tokens, cfg.head_dim)
        scores = torch.matmul(q, keys.permute(1, 2, 0))  # [Hkv, group * T, S]
        if num_tokens > 1:
            # Query i sits at start_pos + i and may see keys up to that position.
            query_pos = torch.arange(start_pos, start_pos + num_tokens)[:, None]
            masked = torch.arange(context)[None, :] > query_pos  # [T, S]
            scores = scores.view(cfg.num_kv_heads, group, num_tokens, context).masked_fill(masked, float("-inf"))
            scores = scores.view(cfg.num_kv_heads, group * num_tokens, context)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.permute(1, 0, 2))  # [Hkv, group * T, D]
        out = out.view(cfg.num_kv_heads, group, num_tokens, cfg.head_dim).permute(2, 0, 1, 3)
        return out.reshape(num_tokens, cfg.num_heads * cfg.head_dim)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self._config.rms_eps) * weight

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Rotate-half form (Llama/HF): the two halves of each head are the pair coordinates.
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _token_tensor(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long)
        if ids.dim() != 1:
            raise ValueError(f"tokens must be a 1-D sequence, got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._config.vocab_size):
            raise ValueError(f"token ids must lie in 0..{self._config.vocab_size - 1}")
        return ids

    def _check_positions(self, start_pos: int, num_tokens: int) -> None:
        if start_pos < 0 or start_pos + num_tokens > self._config.max_context:
            raise ValueError(
                f"positions {start_pos}..{start_pos + num_tokens - 1} outside the context 0..{self._config.max_context - 1}"
            )

    def _check_cache(self, kv_cache: PagedKVCache) -> None:
        if kv_cache.kv_layout != self._config.kv_layout:
            raise KVCacheError(f"cache layout {kv_cache.kv_layout} does not match the model's {self._config.kv_layout}")
