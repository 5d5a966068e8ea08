"""Specification of the model package: config presets, byte tokenizer, and the paged-attention
transformer's exactness guarantees (chunked prefill, batch-independent decode, disaggregation)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvxfer.kv.cache import KVCacheError, PagedKVCache
from kvxfer.model import (
    BOS_ID,
    EOS_ID,
    ByteTokenizer,
    DecodeRequest,
    FinishReason,
    ModelConfig,
    PrefillChunk,
    Transformer,
    finish_reason_after,
)
from kvxfer.kv.page_allocator import PageAllocator

TINY = ModelConfig.preset("tiny")
BLOCK = TINY.block_size


@pytest.fixture(scope="module")
def model() -> Transformer:
    """One tiny model shared by the module: weights are immutable, building it once saves time."""
    return Transformer(TINY)


def random_prompt(seed: int, length: int) -> list[int]:
    """A seeded prompt: BOS followed by `length - 1` random bytes."""
    rng = random.Random(seed)
    return [BOS_ID] + [rng.randrange(256) for _ in range(length - 1)]


def fresh_cache(num_pages: int = 16, config: ModelConfig = TINY) -> PagedKVCache:
    """A zeroed cache for `config` with `num_pages` pages."""
    return PagedKVCache.from_config(config, num_pages)


# ---- config ------------------------------------------------------------------------------


def test_llama3_8b_kv_preset_has_llama3_8b_kv_cache_shape() -> None:
    config = ModelConfig.preset("llama3-8b-kv")
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (32, 8, 128)
    assert config.max_context >= 16384
    assert config.dtype == "float32" and config.block_size == 16
    assert config.kv_layout == "L32-H8-D128-float32-bs16"
    assert config.page_bytes == 2 * 16 * 8 * 128 * 4 == 131072


def test_tiny_preset_uses_grouped_query_attention() -> None:
    assert TINY.num_heads == 2 * TINY.num_kv_heads
    assert TINY.kv_layout == "L2-H2-D16-float32-bs16"
    assert TINY.page_bytes == 2 * 16 * 2 * 16 * 4


def test_kv_layout_changes_with_block_size_and_dtype() -> None:
    assert TINY.replace(block_size=32).kv_layout == "L2-H2-D16-float32-bs32"
    assert TINY.replace(dtype="bfloat16").kv_layout == "L2-H2-D16-bfloat16-bs16"
    assert TINY.replace(dtype="bfloat16").page_bytes == TINY.page_bytes // 2


def test_preset_overrides_are_applied_and_validated() -> None:
    assert ModelConfig.preset("tiny", num_layers=4).num_layers == 4
    with pytest.raises(ValueError, match="num_heads .* must be a multiple of num_kv_heads"):
        ModelConfig.preset("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ModelConfig.preset("tiny", head_dim=15)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        ModelConfig.preset("tiny", block_size=0)


def test_unknown_preset_raises_and_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt5'; known: \['llama3-8b-kv', 'tiny'\]"):
        ModelConfig.preset("gpt5")


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.num_layers = 3  # type: ignore[misc]


# ---- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_encodes_utf8_bytes_after_bos_and_round_trips() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.encode("Hi") == [BOS_ID, 72, 105]
    assert tokenizer.encode("Hi", add_bos=False) == [72, 105]
    text = "KV-Cache über RDMA → 42 ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_decode_skips_specials_and_replaces_invalid_utf8() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([BOS_ID, 104, 105, EOS_ID]) == "hi"
    assert tokenizer.decode([104, 0xE2, 0x82]) == "h\ufffd"  # a cut multi-byte character
    with pytest.raises(ValueError, match="token id 258 is outside"):
        tokenizer.decode([258])


# ---- weights -----------------------------------------------------------------------------


def test_same_seed_gives_bit_identical_models_and_another_seed_does_not(model: Transformer) -> None:
    prompt = random_prompt(0, 20)
    logits = model.prefill(prompt, fresh_cache(), list(range(16))).logits
    same = Transformer(TINY).prefill(prompt, fresh_cache(), list(range(16))).logits
    other = Transformer(TINY.replace(seed=1)).prefill(prompt, fresh_cache(), list(range(16))).logits
    assert torch.equal(logits, same)
    assert not torch.allclose(logits, other)


def test_model_rejects_a_cache_with_another_layout(model: Transformer) -> None:
    cache = PagedKVCache.from_config(TINY.replace(block_size=8), 8)
    with pytest.raises(KVCacheError, match="does not match the model's L2-H2-D16-float32-bs16"):
        model.prefill(random_prompt(0, 4), cache, [0])


# ---- prefill -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 32, 48])
def test_chunked_prefill_matches_one_shot_prefill(model: Transformer, chunk_size: int) -> None:
    prompt = random_prompt(1, 100)
    table = list(range(7))
    one_shot_cache, chunked_cache = fresh_cache(), fresh_cache()
    one_shot = model.prefill(prompt, one_shot_cache, table, chunk_size=None)
    chunked = model.prefill(prompt, chunked_cache, table, chunk_size=chunk_size)
    assert chunked.first_token == one_shot.first_token
    assert chunked.num_tokens == one_shot.num_tokens == 100
    torch.testing.assert_close(chunked.logits, one_shot.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_cache.tensor, one_shot_cache.tensor, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_gives_the_same_greedy_tokens_as_one_shot(model: Transformer) -> None:
    prompt = random_prompt(2, 90)
    assert model.generate(prompt, 24, chunk_size=16).tokens == model.generate(prompt, 24, chunk_size=None).tokens


def test_prefill_result_does_not_depend_on_which_pages_hold_the_request(model: Transformer) -> None:
    prompt = random_prompt(3, 70)
    in_order = model.prefill(prompt, fresh_cache(), [0, 1, 2, 3, 4], chunk_size=32)
    scattered_cache = fresh_cache()
    scattered = model.prefill(prompt, scattered_cache, [9, 2, 15, 0, 7], chunk_size=32)
    assert torch.equal(in_order.logits, scattered.logits)


def test_prefill_built_from_embed_prefill_layer_and_logits_equals_prefill(model: Transformer) -> None:
    prompt = random_prompt(4, 40)
    expected = model.prefill(prompt, fresh_cache(), list(range(3)), chunk_size=None)
    cache = fresh_cache()
    hidden = model.embed(prompt)
    for layer in range(TINY.num_layers):
        hidden = model.prefill_layer(layer, hidden, cache, list(range(3)), start_pos=0)
    assert torch.equal(model.logits(hidden[-1]), expected.logits)


def test_on_layer_done_runs_after_every_layer_of_every_chunk_in_order(model: Transformer) -> None:
    calls: list[tuple[int, PrefillChunk]] = []
    model.prefill(random_prompt(5, 70), fresh_cache(), list(range(5)), chunk_size=32,
                  on_layer_done=lambda layer, chunk: calls.append((layer, chunk)))
    chunks = [
        PrefillChunk(index=0, start_pos=0, end_pos=32, first_block=0, end_block=2, is_last=False),
        PrefillChunk(index=1, start_pos=32, end_pos=64, first_block=2, end_block=4, is_last=False),
        PrefillChunk(index=2, start_pos=64, end_pos=70, first_block=4, end_block=5, is_last=True),
    ]
    assert calls == [(layer, chunk) for chunk in chunks for layer in range(TINY.num_layers)]
    assert list(chunks[1].blocks) == [2, 3]


def test_pages_reported_by_on_layer_done_are_already_final(model: Transformer) -> None:
    cache = fresh_cache()
    table = [11, 3, 8, 0, 14]
    snapshots: dict[tuple[int, int], torch.Tensor] = {}

    def snapshot(layer: int, chunk: PrefillChunk) -> None:
        for block in chunk.blocks:
            snapshots[(layer, block)] = cache.page_view(layer, table[block]).clone()

    model.prefill(random_prompt(6, 80), cache, table, chunk_size=16, on_layer_done=snapshot)
    assert sorted(snapshots) == [(layer, block) for layer in range(TINY.num_layers) for block in range(5)]
    for (layer, block), page in snapshots.items():
        assert torch.equal(page, cache.page_view(layer, table[block]))


def test_prefill_rejects_chunk_size_that_is_not_a_multiple_of_block_size(model: Transformer) -> None:
    with pytest.raises(ValueError, match="chunk_size must be a positive multiple of block_size 16, got 24"):
        model.prefill(random_prompt(0, 40), fresh_cache(), list(range(3)), chunk_size=24)


def test_prefill_rejects_a_block_table_too_short_for_the_prompt(model: Transformer) -> None:
    with pytest.raises(KVCacheError, match="block table of 2 pages holds 32 tokens, prompt has 33"):
        model.prefill(random_prompt(0, 33), fresh_cache(), [0, 1])


def test_prefill_rejects_tokens_outside_the_vocabulary(model: Transformer) -> None:
    with pytest.raises(ValueError, match="token ids must lie in 0..257"):
        model.prefill([BOS_ID, 258], fresh_cache(), [0])


def test_llama3_8b_kv_shaped_layers_prefill_chunked_like_one_shot() -> None:
    # Two layers of the big preset: same head_dim 128 / 8 KV heads pages, cheap to build.
    config = ModelConfig.preset("llama3-8b-kv", num_layers=2)
    big = Transformer(config)
    prompt = random_prompt(7, 48)
    one_shot = big.prefill(prompt, fresh_cache(3, config), [0, 1, 2], chunk_size=None)
    chunked = big.prefill(prompt, fresh_cache(3, config), [2, 0, 1], chunk_size=16)
    assert chunked.first_token == one_shot.first_token
    torch.testing.assert_close(chunked.logits, one_shot.logits, rtol=1e-5, atol=1e-5)


# ---- decode ------------------------------------------------------------------------------


def test_decode_output_of_a_request_does_not_depend_on_its_batch_bit_for_bit(model: Transformer) -> None:
    steps, num_requests = 10, 6
    rng = random.Random(7)
    allocator = PageAllocator(64, BLOCK, shuffle=True, seed=7)
    cache = fresh_cache(64)
    prompts = {f"r{i}": random_prompt(100 + i, rng.randrange(5, 60)) for i in range(num_requests)}
    tables = {rid: allocator.reserve(rid, len(p) + steps) for rid, p in prompts.items()}
    first = {rid: model.prefill(p, cache, tables[rid], chunk_size=16).first_token for rid, p in prompts.items()}
    after_prefill = cache.tensor.clone()

    # Reference: every request decoded alone.
    solo: dict[str, list[torch.Tensor]] = {}
    for rid, prompt in prompts.items():
        token, rows = first[rid], []
        for step in range(steps):
            row = model.decode_logits([DecodeRequest(token, len(prompt) + step, tables[rid])], cache)[0]
            rows.append(row)
            token = int(torch.argmax(row))
        solo[rid] = rows
    after_solo = cache.tensor.clone()

    # Continuous batching: requests join at random steps, sit out some steps, and the batch
    # order is shuffled every step; each request's logits must match its solo run exactly.
    cache.tensor.copy_(after_prefill)
    done = {rid: 0 for rid in prompts}
    token = dict(first)
    join = {rid: rng.randrange(0, 5) for rid in prompts}
    largest_batch, iteration = 0, 0
    while any(n < steps for n in done.values()):
        batch_ids = [rid for rid in prompts if join[rid] <= iteration and done[rid] < steps and rng.random() < 0.8]
        rng.shuffle(batch_ids)
        iteration += 1
        if not batch_ids:
            continue
        largest_batch = max(largest_batch, len(batch_ids))
        batch = [DecodeRequest(token[rid], len(prompts[rid]) + done[rid], tables[rid]) for rid in batch_ids]
        logits = model.decode_logits(batch, cache)
        for rid, row in zip(batch_ids, logits):
            assert torch.equal(row, solo[rid][done[rid]]), f"{rid} step {done[rid]} differs in a batch"
            token[rid] = int(torch.argmax(row))
            done[rid] += 1
    assert largest_batch >= 4
    assert torch.equal(cache.tensor, after_solo)


def test_decode_step_returns_the_greedy_token_of_each_request_in_batch_order(model: Transformer) -> None:
    cache = fresh_cache(8)
    requests = []
    for i, table in enumerate(([0, 1], [5, 2], [7, 3])):
        prompt = random_prompt(200 + i, 20)
        first = model.prefill(prompt, cache, table).first_token
        requests.append(DecodeRequest(first, len(prompt), table))
    snapshot = cache.tensor.clone()
    logits = model.decode_logits(requests, cache)
    cache.tensor.copy_(snapshot)
    assert model.decode_step(requests, cache) == [int(t) for t in torch.argmax(logits, dim=-1)]
    assert model.decode_step([], cache) == []


def test_decode_rejects_a_position_beyond_the_block_table(model: Transformer) -> None:
    with pytest.raises(KVCacheError, match="block table of 1 pages holds 16 tokens, 17 needed"):
        model.decode_step([DecodeRequest(65, 16, [0])], fresh_cache())


def test_prefill_on_one_worker_and_decode_on_another_matches_generate_token_for_token(model: Transformer) -> None:
    # The disaggregated flow without an engine: the prefiller pushes each layer's pages of
    # each chunk into the decoder's (different, scattered) pages from on_layer_done; the
    # decoder then continues from its own cache. It must reproduce the one-process reference.
    prompt, max_tokens, chunk_size = random_prompt(8, 75), 30, 32
    reference = model.generate(prompt, max_tokens, chunk_size=chunk_size)

    prefill_cache, decode_cache = fresh_cache(20), fresh_cache(24)
    src = PageAllocator(20, BLOCK, shuffle=True, seed=1).reserve("r", len(prompt))
    dst = PageAllocator(24, BLOCK, shuffle=True, seed=2).reserve("r", len(prompt) + max_tokens)
    assert src != dst[: len(src)]

    def push(layer: int, chunk: PrefillChunk) -> None:
        blocks = slice(chunk.first_block, chunk.end_block)
        decode_cache.write_pages(layer, dst[blocks], prefill_cache.read_pages(layer, src[blocks]))

    token = model.prefill(prompt, prefill_cache, src, chunk_size=chunk_size, on_layer_done=push).first_token
    kept: list[int] = []
    position = len(prompt)
    while True:
        reason = finish_reason_after(token, len(kept), max_tokens)
        if reason is not FinishReason.STOP:
            kept.append(token)
        if reason is not None:
            break
        token = model.decode_step([DecodeRequest(token, position, dst)], decode_cache)[0]
        position += 1
    assert kept == reference.tokens
    assert reason is reference.finish_reason


# ---- generate ----------------------------------------------------------------------------


def test_generate_stops_at_max_tokens_and_greedy_output_is_not_one_repeated_token(model: Transformer) -> None:
    generation = model.generate(ByteTokenizer().encode("disaggregated prefill and decode"), 40)
    assert generation.finish_reason is FinishReason.LENGTH
    assert len(generation.tokens) == 40
    assert len(set(generation.tokens)) >= 5


def test_generate_stops_at_eos_and_does_not_return_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Random weights rarely pick EOS, so force it: the fourth logits vector computed
    # (prefill's, then three decode steps) has EOS on top.
    forced = Transformer(TINY)
    original_logits = forced.logits
    calls = {"n": 0}

    def logits_with_eos_on_fourth_call(hidden: torch.Tensor) -> torch.Tensor:
        out = original_logits(hidden)
        calls["n"] += 1
        if calls["n"] == 4:
            out = out.clone()
            out[..., EOS_ID] = out.max() + 1.0
        return out

    monkeypatch.setattr(forced, "logits", logits_with_eos_on_fourth_call)
    generation = forced.generate(random_prompt(11, 20), 10)
    assert generation.finish_reason is FinishReason.STOP
    assert len(generation.tokens) == 3
    assert EOS_ID not in generation.tokens


def test_generate_with_one_token_returns_the_prefill_token(model: Transformer) -> None:
    prompt = random_prompt(9, 30)
    first = model.prefill(prompt, fresh_cache(), [0, 1]).first_token
    assert model.generate(prompt, 1).tokens == [first]


def test_generate_is_deterministic(model: Transformer) -> None:
    prompt = random_prompt(10, 50)
    assert model.generate(prompt, 20) == model.generate(prompt, 20)


def test_generate_rejects_a_request_longer_than_the_context(model: Transformer) -> None:
    with pytest.raises(ValueError, match="exceeds max_context 1024"):
        model.generate(random_prompt(0, 1000), 25)


def test_finish_rule_drops_eos_and_keeps_the_token_that_reaches_max_tokens() -> None:
    assert finish_reason_after(EOS_ID, 0, 5) is FinishReason.STOP
    assert finish_reason_after(EOS_ID, 4, 5) is FinishReason.STOP
    assert finish_reason_after(65, 4, 5) is FinishReason.LENGTH
    assert finish_reason_after(65, 3, 5) is None
    assert finish_reason_after(65, 0, 1) is FinishReason.LENGTH
