"""kv.integrity: page checksums of a real cache, the decoder's check in each mode, the
receipt, and the oracle digest (which a swap of two pages of one layer changes)."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from kvxfer.kv.cache import PagedKVCache
from kvxfer.kv.integrity import (
    KVIntegrity,
    TransferReceipt,
    crc32c,
    layer_checksums,
    prompt_kv_digest,
    verify_pages,
)
from kvxfer.model.config import ModelConfig

CONFIG = ModelConfig.preset("tiny")


def filled_cache(num_pages: int = 16, seed: int = 3) -> PagedKVCache:
    cache = PagedKVCache.from_config(CONFIG, num_pages)
    gen = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen, dtype=torch.float32).to(cache.dtype))
    return cache


def test_crc32c_known_answer_and_hardware_agrees_with_tables() -> None:
    from kvxfer import _native

    assert crc32c(b"123456789") == 0xE3069283
    data = np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8)
    assert crc32c(data) == _native.crc32c(data, portable=True)
    assert crc32c(data) != zlib.crc32(data.tobytes())  # Castagnoli, not the zlib polynomial


def test_layer_checksums_are_crc32c_of_each_page_in_the_order_given() -> None:
    cache = filled_cache()
    got = layer_checksums(cache, 1, [7, 2, 9])
    want = [crc32c(np.frombuffer(cache.read_page_bytes(1, p), dtype=np.uint8)) for p in (7, 2, 9)]
    assert got.dtype == np.uint32 and got.tolist() == want


@pytest.mark.parametrize("mode", [KVIntegrity.FULL, KVIntegrity.SAMPLED])
def test_verify_finds_a_flipped_bit(mode: KVIntegrity) -> None:
    cache = filled_cache()
    pages = [4, 1, 8, 11]
    expected = np.stack([layer_checksums(cache, layer, pages) for layer in range(CONFIG.num_layers)])
    assert verify_pages(cache, pages, expected, mode, 1.0).ok
    cache.as_bytes()[cache.page_offset_bytes(1, 8) + 100] ^= 1
    # sample_rate 1.0: the sample is every page, so SAMPLED must find it too.
    result = verify_pages(cache, pages, expected, mode, 1.0)
    assert result.mismatches == [(1, 2, 8)] and result.checked == 2 * len(pages)


def test_sampled_checks_at_least_one_page_per_layer_and_off_checks_none() -> None:
    cache = filled_cache()
    pages = list(range(10))
    expected = np.stack([layer_checksums(cache, layer, pages) for layer in range(CONFIG.num_layers)])
    sampled = verify_pages(cache, pages, expected, KVIntegrity.SAMPLED, 0.01, random.Random(5))
    assert sampled.checked == CONFIG.num_layers and sampled.ok
    assert verify_pages(cache, pages, expected, KVIntegrity.OFF, 1.0).checked == 0


def test_prompt_digest_ignores_the_tail_of_the_last_page_and_catches_a_swap() -> None:
    cache = filled_cache()
    pages, tokens = [3, 5, 6], 2 * CONFIG.block_size + 5
    digest = prompt_kv_digest(cache, pages, tokens)
    # Bytes past the prompt in its last page (stale on either side) do not count...
    last = cache.page_view(0, 6)
    last[:, 5:] = 0
    assert prompt_kv_digest(cache, pages, tokens) == digest
    # ...misplaced KV does: two full pages of one layer swapped.
    a, b = cache.page_view(1, 3), cache.page_view(1, 5)
    a_copy = a.clone()
    a.copy_(b)
    b.copy_(a_copy)
    assert prompt_kv_digest(cache, pages, tokens) != digest


def test_receipt_header_is_one_line_with_every_field() -> None:
    receipt = TransferReceipt("r", kv_bytes=4096, pages=2, layers=2, wire_ms=1.5, verify_ms=0.2,
                              verdict="verified", pages_checked=4, kv_digest=0xAB)
    header = receipt.header_value()
    assert "\n" not in header and "verdict=verified" in header and "kv_digest=000000ab" in header
    assert receipt.to_json()["pages_checked"] == 4
