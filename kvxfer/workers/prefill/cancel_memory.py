"""The request ids a prefill worker was asked to cancel, remembered for a while.

A decoder that got a /cancel answer may reuse the request's pages at once, so a /prefill
for that id that arrives later (the router's two calls race) must be refused, not pushed
into pages that belong to another request by then. The memory is bounded in time, not in
size: an id is forgotten `memory_s` after its cancel.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CancelMemory:
    """Request ids cancelled within the last `memory_s` seconds.

    Not locked: the service calls it under its own lock, together with the request table
    the answer must agree with. `clock` is CLOCK_MONOTONIC seconds unless the caller gives
    another (a unit test steps its own clock instead of sleeping).
    """

    def __init__(self, memory_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if memory_s <= 0:
            raise ValueError(f"cancel memory_s must be positive, got {memory_s}")
        self.memory_s = memory_s
        self._clock = clock
        self._expiry: dict[str, float] = {}  # request id -> clock time it is forgotten at

    def remember(self, request_id: str) -> None:
        """`request_id` was cancelled now (known here or not: its /prefill may be on its way)."""
        self._forget_expired()
        self._expiry[request_id] = self._clock() + self.memory_s

    def was_cancelled(self, request_id: str) -> bool:
        """Whether `request_id` was cancelled within the last `memory_s` seconds."""
        self._forget_expired()
        return request_id in self._expiry

    def __len__(self) -> int:
        """Ids remembered now."""
        self._forget_expired()
        return len(self._expiry)

    def _forget_expired(self) -> None:
        now = self._clock()
        for request_id in [r for r, expiry in self._expiry.items() if expiry <= now]:
            del self._expiry[request_id]
