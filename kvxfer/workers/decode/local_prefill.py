"""The colocated path (/generate_local): the decode worker prefills a request itself into
its reserved pages, then decodes it. With a reused prefix only the tokens after it are
computed."""

from __future__ import annotations

import asyncio

from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.workers.decode.job import DecodeJob
from kvxfer.workers.decode.job_table import JobTable
from kvxfer.workers.worker_core import WorkerCore


async def prefill_locally(job: DecodeJob, prompt: list[int], *, table: JobTable, core: WorkerCore,
                          chunk_tokens: int) -> None:
    """Prefills `job`'s prompt on this worker (off the event loop) and starts decoding it."""
    loop = asyncio.get_running_loop()
    with table.lock:
        # No remote writer: the pages are this worker's from here on.
        table.ledger.move(job.request_id, Res.ADMITTED)
    result = await loop.run_in_executor(
        None,
        lambda: core.model.prefill(
            prompt, core.cache, job.pages, chunk_size=chunk_tokens,
            start_pos=job.held_pages * core.config.block_size,
        ),
    )
    with table.lock:
        if not job.phase.ended:
            # Computed and not ended meanwhile: its full prompt pages are final.
            table.allocator.publish(job.request_id, job.prefix_hashes)
    table.start_decoding(job, result.first_token)
