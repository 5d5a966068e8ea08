"""A worker's prefix cache: full prompt pages kept after their request, named by block hash.

A page enters the cache when the request that filled it knows it is final (the decoder at
admission, the prefiller once its compute finished); it is named by the chained hash of
its block (`kv.prefix_hash.block_hashes`), so a later prompt that shares the first
``(i + 1) * block_size`` tokens finds block `i` under the same name. Every page in the
cache has a reference count: the request that published it and every request that reuses
it hold one until they end. A referenced page is pinned: it is never evicted, so no other
request is ever handed it to write into, and a page a write may still read from or land
next to stays what its name says. Only unreferenced pages are evictable, least recently
used first; a hit touches a chain's blocks from the last to the first, so a chain's tail
goes before its head (a head without its tail still serves shorter prompts; a tail without
its head serves nothing).

Pure bookkeeping: no lock and no thread. `kv.page_allocator.PageAllocator` owns one and
calls it under its own lock; evicted pages go back to its free list. `version` bumps on
every change of the set of held hashes, which is what the worker's ``/prefix_index``
reports.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer.errors import KvxferError


class PrefixCacheError(KvxferError, ValueError):
    """A call that breaks the cache's bookkeeping (a release without a reference, a page
    published twice): a bug in the caller, never a client error."""


@dataclass
class _Entry:
    page: int
    refs: int


@dataclass(frozen=True)
class PrefixCacheCounters:
    """What the cache did since it was made: blocks found and not found by `acquire`,
    pages evicted, and what it holds now (`held_pages`, of which `referenced_pages` are
    pinned by a live request)."""

    hit_blocks: int
    miss_blocks: int
    evictions: int
    held_pages: int
    referenced_pages: int


class PrefixCache:
    """Block hash -> page, with reference counts and LRU eviction of unreferenced pages.

    `acquire(hashes)` references the pages of the leading blocks it holds (a prefix match);
    `publish(hash, page)` adds a page its caller filled, referenced once by that caller;
    `release(hashes)` drops one reference per hash; `evict(n)` takes up to `n` unreferenced
    pages, least recently used first, and returns their ids for reuse.
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, _Entry] = {}
        # Unreferenced entries, least recently used first: exactly the evictable ones.
        self._idle: OrderedDict[bytes, None] = OrderedDict()
        self._pages: set[int] = set()
        self._version = 0
        self._hit_blocks = 0
        self._miss_blocks = 0
        self._evictions = 0

    # ---- queries -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Bumps on every change of the set of held hashes."""
        return self._version

    @property
    def held_pages(self) -> int:
        """Pages in the cache, referenced or not."""
        return len(self._entries)

    @property
    def evictable_pages(self) -> int:
        """Pages no live request references: what `evict` can take."""
        return len(self._idle)

    def hashes(self) -> list[bytes]:
        """Every hash held now (order unspecified)."""
        return list(self._entries)

    def holds_page(self, page: int) -> bool:
        """True if `page` belongs to the cache (referenced or not)."""
        return page in self._pages

    def refs(self, block_hash: bytes) -> int:
        """References on `block_hash`'s page (0 when unreferenced or absent)."""
        entry = self._entries.get(block_hash)
        return entry.refs if entry is not None else 0

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the cache holds (no side effect)."""
        count = 0
        for h in hashes:
            if h not in self._entries:
                break
            count += 1
        return count

    def counters(self) -> PrefixCacheCounters:
        """Hits, misses, evictions and holdings (see `PrefixCacheCounters`)."""
        return PrefixCacheCounters(
            hit_blocks=self._hit_blocks, miss_blocks=self._miss_blocks, evictions=self._evictions,
            held_pages=len(self._entries), referenced_pages=len(self._entries) - len(self._idle),
        )

    # ---- transitions -------------------------------------------------------------------

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        """References the pages of the leading blocks of `hashes` the cache holds and returns
        them in block order; the blocks after the first miss count as misses."""
        matched = self.matched_blocks(hashes)
        pages: list[int] = []
        for h in hashes[:matched]:
            entry = self._entries[h]
            if entry.refs == 0:
                del self._idle[h]
            entry.refs += 1
            pages.append(entry.page)
        self._hit_blocks += matched
        self._miss_blocks += len(hashes) - matched
        return pages

    def publish(self, block_hash: bytes, page: int) -> bool:
        """Adds `page` (final, filled by the caller) under `block_hash`, referenced once by the
        caller. False, and nothing changes, when the hash is already held: the caller keeps
        its page as its own."""
        if block_hash in self._entries:
            return False
        if page in self._pages:
            raise PrefixCacheError(f"page {page} is already in the prefix cache under another hash")
        self._entries[block_hash] = _Entry(page=page, refs=1)
        self._pages.add(page)
        self._version += 1
        return True

    def release(self, hashes: Sequence[bytes]) -> None:
        """Drops one reference per hash. The last block's page becomes evictable first, then
        the one before (released in reverse, so a chain's tail is older than its head)."""
        for h in reversed(hashes):
            entry = self._entries.get(h)
            if entry is None or entry.refs <= 0:
                raise PrefixCacheError(f"release of block {h.hex()} that holds no reference")
            entry.refs -= 1
            if entry.refs == 0:
                self._idle[h] = None

    def evict(self, count: int) -> list[int]:
        """Removes up to `count` unreferenced pages, least recently used first, and returns
        their page ids (the caller reuses them). Referenced pages are never taken."""
        pages: list[int] = []
        while len(pages) < count and self._idle:
            h, _ = self._idle.popitem(last=False)
            entry = self._entries.pop(h)
            self._pages.discard(entry.page)
            pages.append(entry.page)
        if pages:
            self._evictions += len(pages)
            self._version += 1
        return pages
