"""Decode-side page allocator: which KV pages belong to which request, and when they may be reused.

The decoder reserves a request's pages before the prefiller writes into them, so the
allocator is also the guard against the one fatal bug of one-sided transfers: reusing a page
that a remote writer may still be writing. A request whose transfer may still be in flight
(cancelled, failed, timed out) is released with `release_after_quiesce`: its pages go into
quarantine and come back only when `confirm_quiesced` says the prefiller has confirmed that
no write for it can land any more. Only a request whose KV is known to have fully arrived
(or was never requested) is released directly with `free`.

The allocator is guarded by one lock: it is called a few times per request from HTTP
handlers and the decode loop, never on the per-page transfer path, so contention is not a
concern and a lock keeps the invariants obvious.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum

from kvxfer.errors import KvxferError
from kvxfer.kv.layout import pages_for_tokens

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


class ReservationState(str, Enum):
    """State of a request's pages: `RESERVED` (in use) or `QUARANTINED` (waiting to quiesce)."""

    RESERVED = "reserved"
    QUARANTINED = "quarantined"


@dataclass
class _Reservation:
    pages: list[int]
    num_tokens: int
    state: ReservationState = ReservationState.RESERVED


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

    def __init__(self, total_pages: int, block_size: int, *, shuffle: bool = False, seed: int = 0) -> None:
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
        """Pages that a reservation may take now."""
        with self._lock:
            return len(self._free)

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

    def state(self, request_id: RequestId) -> ReservationState:
        """Whether the request's pages are reserved or quarantined."""
        with self._lock:
            return self._get(request_id).state

    def capacity_tokens(self, request_id: RequestId) -> int:
        """Tokens the request's pages can hold (``len(pages) * block_size``)."""
        with self._lock:
            return len(self._get(request_id).pages) * self._block_size

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._requests

    # ---- transitions ---------------------------------------------------------------------

    def reserve(self, request_id: RequestId, num_tokens: int) -> list[int]:
        """Reserve pages for `num_tokens` tokens and return the block table.

        Raises `DuplicateRequestError` if the id already holds pages (reserved or
        quarantined) and `OutOfPagesError` if the free pool is too small.
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        needed = self.pages_for_tokens(num_tokens)
        with self._lock:
            if request_id in self._requests:
                raise DuplicateRequestError(request_id, "already holds pages")
            pages = self._take(request_id, needed)
            self._requests[request_id] = _Reservation(pages=pages, num_tokens=num_tokens)
            self._reserved_count += needed
            return list(pages)

    def grow(self, request_id: RequestId, extra_tokens: int) -> list[int]:
        """Extend a reserved request by `extra_tokens` tokens; return the newly added page ids.

        The new pages are appended to the block table; none are added while the current
        pages still have room. Only RESERVED requests can grow.
        """
        if extra_tokens < 0:
            raise ValueError(f"extra_tokens must be >= 0, got {extra_tokens}")
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, ReservationState.RESERVED, "grow")
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
            self._require(reservation, request_id, ReservationState.RESERVED, "free")
            del self._requests[request_id]
            self._reserved_count -= len(reservation.pages)
            self._free.extend(reservation.pages)

    def release_after_quiesce(self, request_id: RequestId) -> None:
        """Move a RESERVED request's pages into quarantine until `confirm_quiesced`.

        Use it when a remote write for the request may still be in flight (cancel, timeout,
        failed prefill): the pages stay out of the free pool, so no new request can be given
        a page that a late write would corrupt.
        """
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, ReservationState.RESERVED, "release_after_quiesce")
            reservation.state = ReservationState.QUARANTINED
            self._reserved_count -= len(reservation.pages)
            self._quarantined_count += len(reservation.pages)

    def confirm_quiesced(self, request_id: RequestId) -> None:
        """Return a quarantined request's pages to the pool: no write for it can land any more.

        Call it once the prefiller confirmed that nothing for the request is in flight.
        """
        with self._lock:
            reservation = self._get(request_id)
            self._require(reservation, request_id, ReservationState.QUARANTINED, "confirm_quiesced")
            del self._requests[request_id]
            self._quarantined_count -= len(reservation.pages)
            self._free.extend(reservation.pages)

    # ---- internals (lock held) -----------------------------------------------------------

    def _get(self, request_id: RequestId) -> _Reservation:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(request_id, "holds no pages (never reserved or already freed)") from None

    @staticmethod
    def _require(reservation: _Reservation, request_id: RequestId, state: ReservationState, action: str) -> None:
        if reservation.state is not state:
            raise RequestStateError(request_id, f"cannot {action}: pages are {reservation.state.value}")

    def _take(self, request_id: RequestId, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(request_id, count, len(self._free))
        return [self._free.popleft() for _ in range(count)]
