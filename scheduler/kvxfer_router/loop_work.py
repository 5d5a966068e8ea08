"""Keeping the router's event loop free: heavy work goes to a bounded thread pool, and the
loop's own lag is sampled and exported.

Under a burst of hundreds of streams the loop used to lag for seconds (tokenizing and
parsing big bodies on it), and its own connect deadlines then fired on healthy workers.
`LoopOffload` runs such work (tokenization, JSON of big bodies) in `offload_threads`
threads with at most `offload_max_queued` jobs waiting; beyond that the request is refused
with 429 + Retry-After, never queued without bound. Small inputs stay on the loop: a
thread hop costs more than they do. `sample_loop_lag` observes how late a timer fires
(`kvxfer_router_event_loop_lag_seconds`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Callable, TypeVar

from .openai_api import RouterError

T = TypeVar("T")


class LoopOffload:
    """A bounded thread pool for work that would stall the event loop."""

    def __init__(self, threads: int, max_queued: int, retry_after_s: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="router-offload")
        self._slots = threads + max_queued
        self._taken = 0
        self._retry_after_s = retry_after_s

    async def run(self, request_id: str | None, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the pool; a 429 RouterError when the pool and its queue are full."""
        if self._taken >= self._slots:
            raise RouterError(429, "router is busy preparing other requests; retry later", request_id=request_id,
                              type="rate_limit_error", code="rate_limit_exceeded",
                              headers={"Retry-After": str(self._retry_after_s)})
        self._taken += 1  # only the loop thread touches the count
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._taken -= 1

    def close(self) -> None:
        """Stops the threads once their current jobs end."""
        self._pool.shutdown(wait=False, cancel_futures=True)


async def sample_loop_lag(interval_s: float, observe: Callable[[float], None]) -> None:
    """Forever: sleeps `interval_s` and observes how much later than asked the loop woke."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(interval_s)
        observe(max(0.0, time.monotonic() - start - interval_s))
