"""Decode-side page allocator: which KV pages belong to which request, and when they may be reused.

The decoder reserves a request's pages before the prefiller writes into them, so the
allocator is also the guard against the one fatal bug of one-sided transfers: reusing a page
that a remote writer may still be writing. A request whose transfer may still be in flight
(cancelled, failed, timed out) is released with `release_after_quiesce`: its pages go into
quarantine and come back only when `confirm_quiesced` says the prefiller has confirmed that
no write for it can land any more. Only a request whose KV is known to have fully arrived
(or was never requested) is released directly with `free`.

With a `PrefixCache` (kv.prefix_cache) the allocator also keeps finished requests' full
prompt pages for reuse: `reserve` with the prompt's block hashes starts the block table
with the cached pages of its longest held prefix (referenced, read-only for the request),
`publish` hands a request's final prompt pages to the cache, and the end of a request drops
its references. A cached page nobody references counts as free: when the free list runs
dry a reservation evicts the least recently used ones. A referenced page is never evicted,
and a request's pages go to the cache only when no write can land in them any more, so
the quarantine rule above holds for cached pages too.

The allocator is guarded by one lock: it is called a few times per request from HTTP
handlers and the decode loop, never on the per-page transfer path, so contention is not a
concern and a lock keeps the invariants obvious.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Sequence
from enum import Enum

from kvxfer.errors import KvxferError
from kvxfer.kv.layout import pages_for_tokens
from kvxfer.kv.prefix_cache import PrefixCache, PrefixCacheCounters

#: Request ids are whatever the service uses (strings in the HTTP API); any hashable works.
RequestId = Hashable


class PageAllocationError(KvxferError):
    """Base of the allocator's errors; carries the request id it concerns and the reason."""

    def __init__(self, request_id: RequestId, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"request {request_id!r}: {reason}")


class OutOfPagesError(PageAllocationError):
    """Not enough free pages for a reservation or growth; nothing was allocated.

    `needed` is the number of pages the call asked for and `available` the number of free
    pages at that moment (quarantined pages are not available).
    """

    def __init__(self, request_id: RequestId, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(request_id, f"needs {needed} pages, {available} free")


class UnknownRequestError(PageAllocationError, KeyError):
    """The request id holds no pages: never reserved, or already freed (a double free)."""

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return str(self.args[0])


class DuplicateRequestError(PageAllocationError):
    """`reserve` was called with a request id that already holds pages."""


class RequestStateError(PageAllocationError):
    """The call does not fit the request's state, e.g. `free` on a quarantined request."""


class PageHold(str, Enum):
    """How a request holds its pages: `RESERVED` (in use) or `QUARANTINED` (waiting to quiesce).

    Not the reservation's state (`handoff.reservation_state.ReservationState`, the ledger's):
    only what the pool knows of the pages.
    """

    RESERVED = "reserved"
    QUARANTINED = "quarantined"


@dataclass
class _Reservation:
    pages: list[int]
    num_tokens: int
    state: PageHold = PageHold.RESERVED
    #: Leading pages that came from the prefix cache (read-only for this request).
    held: int = 0
    #: Block hashes this request holds a prefix-cache reference on (reused or published).
    refs: list[bytes] = field(default_factory=list)


class PageAllocator:
    """Hands out KV pages to requests and takes them back, never reusing a page too early.

    `reserve(request_id, num_tokens)` returns enough fresh page ids for `num_tokens` tokens
    (prompt plus decode budget) in block-table order; `grow` adds pages; `free` returns a
    request's pages at once; `release_after_quiesce` followed by `confirm_quiesced` returns
    them only after the remote writer is known to be done. Reservations are all-or-nothing:
    `OutOfPagesError` leaves the pool unchanged. Free pages are handed out in FIFO order, so
    a freed page is reused as late as possible; with `shuffle=True` the initial order is a
    seeded permutation, so tests see non-adjacent, out-of-order block tables while staying
    deterministic. All methods are thread-safe.
    """

    def __init__(self, total_pages: int, block_size: int, *, shuffle: bool = False, seed: int = 0,
                 prefix_cache: PrefixCache | None = None) -> None:
        if total_pages <= 0 or block_size <= 0:
            raise ValueError(f"total_pages and block_size must be positive, got {total_pages} and {block_size}")
        order = list(range(total_pages))
        if shuffle:
            random.Random(seed).shuffle(order)
        self._free: deque[int] = deque(order)
        self._total = total_pages
        self._block_size = block_size
        self._requests: dict[RequestId, _Reservation] = {}
        self._reserved_count = 0
        self._quarantined_count = 0
        self._cache = prefix_cache
        self._lock = threading.Lock()

    # ---- counters ------------------------------------------------------------------------

    @property
    def total_pages(self) -> int:
        """Size of the pool."""
        return self._total

    @property
    def block_size(self) -> int:
        """Tokens per page."""
        return self._block_size

    @property
    def free_pages(self) -> int:
        """Pages that a reservation may take now: the free list and the cached pages no
        request references (evicted on demand)."""
        with self._lock:
            return len(self._free) + self._evictable()

    @property
    def prefix_cache_enabled(self) -> bool:
        """True when the allocator keeps a prefix cache."""
        return self._cache is not None

    @property
    def cached_pages(self) -> int:
        """Pages in the prefix cache, referenced or not (0 without a cache)."""
        with self._lock:
            return self._cache.held_pages if self._cache is not None else 0

    def prefix_snapshot(self) -> tuple[int, list[bytes]]:
        """The prefix cache's version and every hash it holds, read together."""
        with self._lock:
            if self._cache is None:
                return 0, []
            return self._cache.version, self._cache.hashes()

    def prefix_version(self) -> int:
        """The prefix cache's version (bumps on every change of its hashes; 0 without one)."""
        with self._lock:
            return self._cache.version if self._cache is not None else 0

    def prefix_counters(self) -> PrefixCacheCounters | None:
        """The prefix cache's counters (None without a cache)."""
        with self._lock:
            return self._cache.counters() if self._cache is not None else None

    @property
    def reserved_pages(self) -> int:
        """Pages held by requests in the RESERVED state."""
        with self._lock:
            return self._reserved_count

    @property
    def quarantined_pages(self) -> int:
        """Pages released but not yet confirmed quiescent; not reusable."""
        with self._lock:
            return self._quarantined_count

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed for `num_tokens` tokens (ceiling division, `layout.pages_for_tokens`)."""
        return pages_for_tokens(num_tokens, self._block_size)

    # ---- queries -------------------------------------------------------------------------

    def pages(self, request_id: RequestId) -> list[int]:
        """A copy of the request's block table (page ids in token order)."""
        with self._lock:
            return list(self._get(request_id).pages)

    def state(self, request_id: RequestId) -> PageHold:
        """Whether the request's pages are reserved or quarantined."""
        with self._lock:
            return self._get(request_id).state

    def held_pages(self, request_id: RequestId) -> int:
        """Leading pages of the request's block table that came from the prefix cache."""
        with self._lock:
            return self._get(request_id).held

    def capacity_tokens(self, request_id: RequestId) -> int:
        """Tokens the request's pages can hold (``len(pages) * block_size``)."""
        with self._lock:
            return len(self._get(request_id).pages) * self._block_size

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._requests

    # ---- transitions ---------------------------------------------------------------------

    def reserve(self, request_id: RequestId, num_tokens: int, prefix: Sequence[bytes] = ()) -> list[int]:
        """Reserve pages for `num_tokens` tokens and return the block table.

        `prefix`: block hashes (kv.prefix_hash) of the leading full blocks the request may
        reuse; the table starts with the cached pages of the longest held prefix of them
        (`held_pages` says how many), referenced until the request ends, and only the rest
        is taken from the pool. The caller must not write into those pages. Raises
        `DuplicateRequestError` if the id already holds pages (reserved or quarantined) and
        `OutOfPagesError` if the free pool is too small (nothing is taken then).
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        needed = self.pages_for_tokens(num_tokens)
        with self._lock:
            if request_id in self._requests:
                raise DuplicateRequestError(request_id, "already holds pages")
            reused: list[int] = []
            refs: list[bytes] = []
            if self._cache is not None and prefix:
                reused = self._cache.acquire(list(prefix[:needed]))
                refs = list(prefix[:len(reused)])
            try:
                own = self._take(request_id, needed - len(reused))
            except OutOfPagesError:
                if refs:
                    assert self._cache is not None
                    self._cache.release(refs)
                raise
            pages = reused + own
            self._requests[request_id] = _Reservation(pages=pages, num_tokens=num_tokens, held=len(reused), refs=refs)
            self._reserved_count += len(own)
            return list(pages)

    def publish(self, request_id: RequestId, hashes: Sequence[bytes]) -> int:
        """Hands the request's final full prompt pages to the prefix cache: block `i` of the
        table under `hashes[i]`, for the blocks it does not already reuse. Call it only once
        no write can land in those pages any more and nothing will rewrite them (the
        request's later tokens go to later pages). The request keeps a reference on each
        until it ends; a hash the cache already holds leaves the page the request's own.
        Returns how many pages were published (0 without a cache).
        """
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, PageHold.RESERVED, "publish")
            if self._cache is None:
                return 0
            published = 0
            for index in range(reservation.held, min(len(hashes), len(reservation.pages))):
                if self._cache.publish(hashes[index], reservation.pages[index]):
                    reservation.refs.append(hashes[index])
                    published += 1
            self._reserved_count -= published
            return published

    def grow(self, request_id: RequestId, extra_tokens: int) -> list[int]:
        """Extend a reserved request by `extra_tokens` tokens; return the newly added page ids.

        The new pages are appended to the block table; none are added while the current
        pages still have room. Only RESERVED requests can grow.
        """
        if extra_tokens < 0:
            raise ValueError(f"extra_tokens must be >= 0, got {extra_tokens}")
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, PageHold.RESERVED, "grow")
            new_tokens = reservation.num_tokens + extra_tokens
            needed = self.pages_for_tokens(new_tokens) - len(reservation.pages)
            added = self._take(request_id, needed) if needed > 0 else []
            reservation.pages.extend(added)
            reservation.num_tokens = new_tokens
            self._reserved_count += len(added)
            return list(added)

    def free(self, request_id: RequestId) -> None:
        """Return a RESERVED request's pages to the pool at once.

        Only for requests no remote write can still reach (their KV fully arrived, or the
        prefiller never got the pages). A second `free` raises `UnknownRequestError`; a
        quarantined request raises `RequestStateError` (use `confirm_quiesced`).
        """
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, PageHold.RESERVED, "free")
            del self._requests[request_id]
            own = self._drop_refs(reservation)
            self._reserved_count -= len(own)
            self._free.extend(own)

    def release_after_quiesce(self, request_id: RequestId) -> None:
        """Move a RESERVED request's pages into quarantine until `confirm_quiesced`.

        Use it when a remote write for the request may still be in flight (cancel, timeout,
        failed prefill): the pages stay out of the free pool, so no new request can be given
        a page that a late write would corrupt.
        """
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, PageHold.RESERVED, "release_after_quiesce")
            reservation.state = PageHold.QUARANTINED
            # Its cached pages keep their references (pinned) until the quiesce too.
            own = self._own_pages(reservation)
            self._reserved_count -= len(own)
            self._quarantined_count += len(own)

    def confirm_quiesced(self, request_id: RequestId) -> None:
        """Return a quarantined request's pages to the pool: no write for it can land any more.

        Call it once the prefiller confirmed that nothing for the request is in flight.
        """
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, PageHold.QUARANTINED, "confirm_quiesced")
            del self._requests[request_id]
            own = self._drop_refs(reservation)
            self._quarantined_count -= len(own)
            self._free.extend(own)

    # ---- internals (lock held) -----------------------------------------------------------

    def _get(self, request_id: RequestId) -> _Reservation:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(request_id, "holds no pages (never reserved or already freed)") from None

    @staticmethod
    def _require(reservation: _Reservation, request_id: RequestId, state: PageHold, action: str) -> None:
        if reservation.state is not state:
            raise RequestStateError(request_id, f"cannot {action}: pages are {reservation.state.value}")

    def _evictable(self) -> int:
        return self._cache.evictable_pages if self._cache is not None else 0

    def _own_pages(self, reservation: _Reservation) -> list[int]:
        """The request's pages that are not the prefix cache's."""
        if self._cache is None or not reservation.refs:
            return reservation.pages
        return [p for p in reservation.pages if not self._cache.holds_page(p)]

    def _drop_refs(self, reservation: _Reservation) -> list[int]:
        """Drops the request's prefix-cache references; returns its own pages."""
        own = self._own_pages(reservation)
        if reservation.refs:
            assert self._cache is not None
            self._cache.release(reservation.refs)
            reservation.refs = []
        return own

    def _take(self, request_id: RequestId, count: int) -> list[int]:
        if count > len(self._free):
            short = count - len(self._free)
            if short > self._evictable():
                raise OutOfPagesError(request_id, count, len(self._free) + self._evictable())
            assert self._cache is not None
            self._free.extend(self._cache.evict(short))
        return [self._free.popleft() for _ in range(count)]
