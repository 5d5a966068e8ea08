"""The prefix cache (kv.prefix_cache) and the page allocator that owns one: LRU order of
unreferenced pages, reference counts, and pages pinned while a request uses them."""

from __future__ import annotations

import pytest

from kvxfer.kv.page_allocator import OutOfPagesError, PageAllocator
from kvxfer.kv.prefix_cache import PrefixCache, PrefixCacheError
from kvxfer.kv.prefix_hash import block_hashes

BS = 4


def chain(first: int, blocks: int) -> list[bytes]:
    """Block hashes of a prompt of `blocks` full blocks whose tokens start at `first`."""
    return block_hashes(list(range(first, first + blocks * BS)), BS, "test")


def test_acquire_references_the_longest_held_prefix_and_counts_hits_and_misses() -> None:
    cache = PrefixCache()
    hashes = chain(0, 3)
    for i, h in enumerate(hashes[:2]):
        assert cache.publish(h, 10 + i)
    cache.release(hashes[:2])
    assert cache.acquire(hashes) == [10, 11]
    assert [cache.refs(h) for h in hashes] == [1, 1, 0]
    counters = cache.counters()
    assert (counters.hit_blocks, counters.miss_blocks) == (2, 1)
    assert (counters.held_pages, counters.referenced_pages) == (2, 2)
    assert cache.evictable_pages == 0


def test_lru_evicts_the_least_recently_released_and_a_chains_tail_first() -> None:
    cache = PrefixCache()
    a, b = chain(0, 2), chain(100, 2)
    for pages, hashes in (([1, 2], a), ([3, 4], b)):
        for page, h in zip(pages, hashes):
            cache.publish(h, page)
    cache.release(a)
    cache.release(b)
    cache.acquire(a)  # a used again: now the most recent
    cache.release(a)
    # b went idle first; within a chain the tail goes before the head.
    assert cache.evict(1) == [4]
    assert cache.evict(2) == [3, 2]
    assert cache.evict(5) == [1]
    assert cache.counters().evictions == 4 and cache.held_pages == 0


def test_a_referenced_page_is_never_evicted() -> None:
    cache = PrefixCache()
    hashes = chain(0, 2)
    cache.publish(hashes[0], 7)
    cache.publish(hashes[1], 8)
    cache.release([hashes[1]])
    cache.acquire(hashes)  # a second user of both
    cache.release(hashes)
    assert cache.refs(hashes[0]) == 1
    assert cache.evict(10) == [8]
    assert cache.holds_page(7) and not cache.holds_page(8)


def test_publish_of_a_held_hash_keeps_the_first_page_and_version_tracks_changes() -> None:
    cache = PrefixCache()
    h = chain(0, 1)[0]
    v0 = cache.version
    assert cache.publish(h, 1)
    assert not cache.publish(h, 2)
    assert cache.version == v0 + 1
    with pytest.raises(PrefixCacheError):
        cache.publish(chain(9, 1)[0], 1)  # page 1 is already cached
    cache.release([h])
    with pytest.raises(PrefixCacheError):
        cache.release([h])  # no reference left
    cache.evict(1)
    assert cache.version == v0 + 2 and cache.hashes() == []


def test_allocator_reuses_cached_pages_and_takes_only_the_rest() -> None:
    alloc = PageAllocator(8, BS, prefix_cache=PrefixCache())
    hashes = chain(0, 3)
    first = alloc.reserve("a", 3 * BS + 1, hashes)
    assert alloc.held_pages("a") == 0
    assert alloc.publish("a", hashes) == 3
    alloc.free("a")
    assert alloc.free_pages == 8 and alloc.cached_pages == 3
    second = alloc.reserve("b", 4 * BS, hashes[:2])
    assert second[:2] == first[:2] and alloc.held_pages("b") == 2
    assert not set(second[2:]) & set(first[:2])
    assert alloc.reserved_pages == 2  # its own pages only
    alloc.free("b")
    assert alloc.free_pages == 8 and alloc.reserved_pages == 0


def test_allocation_evicts_idle_cached_pages_but_never_pinned_ones() -> None:
    alloc = PageAllocator(4, BS, prefix_cache=PrefixCache())
    hashes = chain(0, 2)
    alloc.reserve("a", 2 * BS, hashes)
    alloc.publish("a", hashes)
    alloc.free("a")
    pinned = alloc.reserve("b", 2 * BS + 1, hashes)[:2]  # reuses both, takes one more
    assert alloc.free_pages == 1
    with pytest.raises(OutOfPagesError):
        alloc.reserve("c", 2 * BS)  # only one page is free: the pinned two are not
    other = alloc.reserve("c", BS)
    assert not set(other) & set(pinned)
    # A fenced request keeps its cached pages pinned until it quiesced.
    alloc.release_after_quiesce("b")
    with pytest.raises(OutOfPagesError):
        alloc.reserve("d", BS)
    alloc.confirm_quiesced("b")
    assert sorted(alloc.reserve("d", 3 * BS)) == sorted(set(range(4)) - set(other))
    assert alloc.prefix_counters().evictions == 2


def test_a_failed_reservation_drops_the_references_it_took() -> None:
    alloc = PageAllocator(3, BS, prefix_cache=PrefixCache())
    hashes = chain(0, 2)
    alloc.reserve("a", 2 * BS, hashes)
    alloc.publish("a", hashes)
    alloc.free("a")
    with pytest.raises(OutOfPagesError):
        alloc.reserve("b", 5 * BS, hashes)
    assert alloc.prefix_counters().referenced_pages == 0 and alloc.free_pages == 3


# ---- what reuse relies on outside the cache: the reservation's held pages, start_pos ----

def held_reservation(pages: list[int], first_page: int, pushed: int) -> dict:
    from kvxfer.kv.protocol import KVReservation, encode_imm

    return KVReservation(
        request_id="r1", descriptor=b"\x01", pages=pages, num_pages=16, imm=encode_imm(1, 0),
        expected_count=2 * pushed + 1, kv_layout="L2-H2-D16-float32-bs16", meta_descriptor=b"\x0a",
        meta_offset=0, nonce=1, fence_timeout_s=15.0, first_page=first_page,
    ).to_json()


def test_a_reservation_with_held_pages_lists_exactly_the_pages_to_push() -> None:
    from kvxfer.kv.protocol import KVReservation, ReservationError

    data = held_reservation([7, 8], first_page=3, pushed=2)
    assert KVReservation.from_json(data).prompt_pages == 2
    # Decode pages after the pushed ones would let a prefiller that ignores first_page
    # (one from before prefix reuse) find room for its whole prompt: refused.
    with pytest.raises(ReservationError, match="pages"):
        KVReservation.from_json({**data, "pages": [7, 8, 9, 10]})


def test_prefill_from_a_cached_prefix_equals_the_whole_computation() -> None:
    import torch

    from kvxfer.kv.cache import PagedKVCache
    from kvxfer.model.config import ModelConfig
    from kvxfer.model.transformer import Transformer

    config = ModelConfig.preset("tiny")
    model = Transformer(config)
    prompt = [(i * 7 + 3) % 256 for i in range(100)]
    pages = list(range(-(-len(prompt) // config.block_size)))
    whole = PagedKVCache.from_config(config, len(pages))
    want = model.prefill(prompt, whole, pages, chunk_size=32)
    cached = PagedKVCache.from_config(config, len(pages))
    model.prefill(prompt[:48], cached, pages, chunk_size=32)  # the prefix a cache would hold
    got = model.prefill(prompt, cached, pages, chunk_size=32, start_pos=48)
    assert got.first_token == want.first_token
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cached.tensor, whole.tensor, rtol=1e-4, atol=1e-4)
    for bad in (8, 100, -16):  # not block-aligned, past the prompt, negative
        with pytest.raises(ValueError, match="start_pos"):
            model.prefill(prompt, cached, pages, start_pos=bad)
