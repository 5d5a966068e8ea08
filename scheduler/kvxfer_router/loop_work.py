"""Keeping the router's event loop free: heavy work goes to a bounded thread pool, and the
loop's own lag is sampled and exported.

Under a burst of hundreds of streams the loop used to lag for seconds (tokenizing and
parsing big bodies on it), and its own connect deadlines then fired on healthy workers.
`LoopOffload` runs such work (tokenization, JSON of big bodies) in `offload_threads`
threads with at most `offload_max_queued` jobs waiting; beyond that the request is refused
with 429 + Retry-After, never queued without bound. Small inputs stay on the loop: a
thread hop costs more than they do. `sample_loop_lag` observes how late a timer fires
(`kvxfer_router_event_loop_lag_seconds`) and how much of that was the loop's own work
(what admission sheds on).
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


async def sample_loop_lag(interval_s: float, observe: Callable[[float, float], None]) -> None:
    """Forever: sleeps `interval_s`, then observes how much later than asked the loop woke
    (the lag a timer sees) and how much of that lateness was the loop's own work.

    The second figure is what admission sheds on. A timer is late for two reasons: the loop's
    thread was busy running callbacks (our overload: shedding helps), or the host did not
    run the thread at all (other processes on a busy machine: shedding only turns clients
    away). The loop's thread CPU time over the interval tells them apart: the loop cannot
    have delayed its timer by more than the time it ran. A host stall (descheduling,
    SIGSTOP, a blocking wait) costs no thread CPU, so it reads as 0; a loop spinning on its
    own work reads as its full lateness. The probe that found this shed 24 clean 429s at
    concurrency 6 on a busy host while the timer-lateness sample read 1.4-2.7 s.
    """
    while True:
        start = time.monotonic()
        cpu_start = time.thread_time()
        await asyncio.sleep(interval_s)
        late = max(0.0, time.monotonic() - start - interval_s)
        observe(late, min(late, time.thread_time() - cpu_start))
