"""Specification of PagedKVCache: layer-major layout, byte offsets the engine relies on, validation."""

from __future__ import annotations

import pytest
import torch

from kvxfer.errors import KvxferError
from kvxfer.kv.cache import KVCacheError, PagedKVCache, format_kv_layout
from kvxfer.model.config import ModelConfig

NUM_LAYERS, NUM_PAGES, BLOCK, HEADS, DIM = 3, 5, 4, 2, 8
FLOAT32 = 4


@pytest.fixture()
def cache() -> PagedKVCache:
    """A small cache filled with seeded random values, so every byte is distinguishable."""
    kv = PagedKVCache(NUM_LAYERS, NUM_PAGES, BLOCK, HEADS, DIM, "float32")
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(0)))
    return kv


def test_tensor_is_one_contiguous_layer_major_allocation(cache: PagedKVCache) -> None:
    assert tuple(cache.tensor.shape) == (NUM_LAYERS, NUM_PAGES, 2, BLOCK, HEADS, DIM)
    assert cache.tensor.is_contiguous()
    assert cache.tensor.dtype == torch.float32
    assert cache.nbytes == NUM_LAYERS * NUM_PAGES * 2 * BLOCK * HEADS * DIM * FLOAT32
    assert cache.nbytes == cache.tensor.numel() * cache.tensor.element_size()
    assert cache.data_ptr == cache.tensor.data_ptr()


def test_page_bytes_is_k_and_v_of_one_block() -> None:
    kv = PagedKVCache(NUM_LAYERS, NUM_PAGES, BLOCK, HEADS, DIM, "float32")
    assert kv.page_bytes == 2 * BLOCK * HEADS * DIM * FLOAT32
    assert kv.layer_bytes == NUM_PAGES * kv.page_bytes


def test_layer_offset_is_the_real_byte_offset_of_the_layers_page_zero(cache: PagedKVCache) -> None:
    for layer in range(NUM_LAYERS):
        real = cache.page_view(layer, 0).data_ptr() - cache.tensor.data_ptr()
        assert cache.layer_offset_bytes(layer) == real == layer * NUM_PAGES * cache.page_bytes


def test_page_offset_is_layer_offset_plus_page_times_page_bytes(cache: PagedKVCache) -> None:
    for layer in range(NUM_LAYERS):
        for page in range(NUM_PAGES):
            real = cache.page_view(layer, page).data_ptr() - cache.tensor.data_ptr()
            assert cache.page_offset_bytes(layer, page) == real
            assert real == cache.layer_offset_bytes(layer) + page * cache.page_bytes


def test_a_page_of_one_layer_is_one_contiguous_run_with_k_then_v(cache: PagedKVCache) -> None:
    page = cache.page_view(2, 3)
    assert page.is_contiguous()
    assert tuple(page.shape) == (2, BLOCK, HEADS, DIM)
    assert page.nbytes == cache.page_bytes
    # K fills the first half of the run and V the second half.
    assert page[1].data_ptr() - page[0].data_ptr() == cache.page_bytes // 2
    # The next page of the same layer starts right where this one ends.
    assert cache.page_view(2, 4).data_ptr() - page.data_ptr() == cache.page_bytes


def test_read_page_bytes_returns_the_memory_at_the_page_offset(cache: PagedKVCache) -> None:
    raw = cache.read_page_bytes(1, 2)
    start = cache.page_offset_bytes(1, 2)
    assert raw == cache.as_bytes()[start : start + cache.page_bytes].numpy().tobytes()
    assert raw == cache.page_view(1, 2).numpy().tobytes()


def test_write_page_bytes_changes_exactly_that_page(cache: PagedKVCache) -> None:
    before = cache.tensor.clone()
    payload = bytes(range(256)) * (cache.page_bytes // 256)
    cache.write_page_bytes(2, 1, payload)
    assert cache.read_page_bytes(2, 1) == payload
    changed = (cache.tensor != before).reshape(NUM_LAYERS, NUM_PAGES, -1).any(dim=-1)
    assert changed.nonzero().tolist() == [[2, 1]]


def test_write_page_bytes_rejects_wrong_length(cache: PagedKVCache) -> None:
    with pytest.raises(KVCacheError, match=f"a page is {cache.page_bytes} bytes, got 3"):
        cache.write_page_bytes(0, 0, b"abc")


def test_read_pages_returns_pages_in_the_given_order(cache: PagedKVCache) -> None:
    pages = cache.read_pages(1, [4, 0, 2])
    assert tuple(pages.shape) == (3, 2, BLOCK, HEADS, DIM)
    for i, page in enumerate([4, 0, 2]):
        assert torch.equal(pages[i], cache.page_view(1, page))


def test_write_pages_copies_pages_between_two_caches_like_a_remote_paged_write(cache: PagedKVCache) -> None:
    other = PagedKVCache(NUM_LAYERS, 7, BLOCK, HEADS, DIM, "float32")
    other.write_pages(2, [6, 1], cache.read_pages(2, [0, 3]))
    assert torch.equal(other.page_view(2, 6), cache.page_view(2, 0))
    assert torch.equal(other.page_view(2, 1), cache.page_view(2, 3))
    assert int(torch.count_nonzero(other.tensor[:2])) == 0


def test_write_tokens_puts_position_p_in_block_table_entry_p_div_block_slot_p_mod_block() -> None:
    kv = PagedKVCache(NUM_LAYERS, NUM_PAGES, BLOCK, HEADS, DIM, "float32")
    block_table = [3, 0, 4]
    k = torch.arange(1, 6 * HEADS * DIM + 1, dtype=torch.float32).reshape(6, HEADS, DIM)
    v = -k
    kv.write_tokens(1, block_table, 3, k, v)  # positions 3..8
    for i, position in enumerate(range(3, 9)):
        page, slot = block_table[position // BLOCK], position % BLOCK
        assert torch.equal(kv.tensor[1, page, 0, slot], k[i])
        assert torch.equal(kv.tensor[1, page, 1, slot], v[i])
    # Nothing else was touched: exactly the 6 tokens' K and V head rows are non-zero.
    assert int(torch.count_nonzero(kv.tensor.reshape(-1, DIM).abs().sum(-1))) == 2 * 6 * HEADS


def test_gather_tokens_reads_back_the_written_tokens_in_position_order() -> None:
    kv = PagedKVCache(NUM_LAYERS, NUM_PAGES, BLOCK, HEADS, DIM, "float32")
    gen = torch.Generator().manual_seed(1)
    k = torch.randn((10, HEADS, DIM), generator=gen)
    v = torch.randn((10, HEADS, DIM), generator=gen)
    kv.write_tokens(0, [2, 4, 1], 0, k, v)
    got_k, got_v = kv.gather_tokens(0, [2, 4, 1], 10)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_out_of_range_page_index_raises_kv_cache_error_naming_the_range(cache: PagedKVCache) -> None:
    message = f"page {NUM_PAGES} out of range: the cache has pages 0..{NUM_PAGES - 1}"
    with pytest.raises(KVCacheError, match=message):
        cache.page_view(0, NUM_PAGES)
    with pytest.raises(KVCacheError, match=message):
        cache.read_pages(0, [0, NUM_PAGES])
    with pytest.raises(KVCacheError, match=message):
        cache.page_offset_bytes(0, NUM_PAGES)
    with pytest.raises(KVCacheError, match="page -1 out of range"):
        cache.read_pages(0, [1, -1])
    with pytest.raises(KVCacheError, match=message):
        cache.gather_tokens(0, [NUM_PAGES], 1)


def test_out_of_range_layer_raises_kv_cache_error(cache: PagedKVCache) -> None:
    with pytest.raises(KVCacheError, match=f"layer {NUM_LAYERS} out of range"):
        cache.layer_offset_bytes(NUM_LAYERS)
    with pytest.raises(KVCacheError, match="layer -1 out of range"):
        cache.page_view(-1, 0)


def test_block_table_too_short_for_the_positions_raises(cache: PagedKVCache) -> None:
    k = torch.zeros((BLOCK + 1, HEADS, DIM))
    with pytest.raises(KVCacheError, match=f"block table of 1 pages holds {BLOCK} tokens, {BLOCK + 1} needed"):
        cache.write_tokens(0, [0], 0, k, k)
    with pytest.raises(KVCacheError, match="needed"):
        cache.gather_tokens(0, [0, 1], 2 * BLOCK + 1)


def test_write_tokens_rejects_wrongly_shaped_k_or_v(cache: PagedKVCache) -> None:
    with pytest.raises(KVCacheError, match="k and v must be shaped"):
        cache.write_tokens(0, [0], 0, torch.zeros((2, HEADS, DIM)), torch.zeros((2, HEADS, DIM + 1)))


def test_kv_cache_error_is_a_kvxfer_value_error() -> None:
    assert issubclass(KVCacheError, KvxferError)
    assert issubclass(KVCacheError, ValueError)


def test_cache_built_from_a_config_has_the_configs_layout_and_page_bytes() -> None:
    config = ModelConfig.preset("llama3-8b-kv")
    kv = PagedKVCache.from_config(config, 2)
    assert kv.kv_layout == config.kv_layout == "L32-H8-D128-float32-bs16"
    assert kv.page_bytes == config.page_bytes == 2 * 16 * 8 * 128 * 4
    assert tuple(kv.tensor.shape) == (32, 2, 2, 16, 8, 128)


def test_layout_string_names_every_field_that_changes_page_bytes() -> None:
    assert format_kv_layout(32, 8, 128, "bfloat16", 32) == "L32-H8-D128-bfloat16-bs32"


def test_unsupported_dtype_raises() -> None:
    with pytest.raises(KVCacheError, match="unsupported dtype 'int8'"):
        PagedKVCache(1, 1, 1, 1, 1, "int8")
