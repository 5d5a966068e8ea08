"""POST /prefix_index: what a builtin worker's prefix cache holds, for a router's KV index.

The router polls each worker on its control port (authenticated like every other POST by
`control_auth`; no new port, JSON only). The body is ``{"since_version": int}``; the answer
is ``{"worker_id", "epoch", "version", "block_size", "namespace", "capacity_pages",
"blocks"}`` where `blocks` is every block hash (kv.prefix_hash, hex) the worker holds now,
or null when `since_version` equals `version` (nothing changed since the router's last
look). `epoch` is random per process start: a router that sees a new epoch knows the
worker restarted and its version counts again from 0. `version` bumps on every change of
the held set; a worker without a prefix cache reports version 0 and no blocks.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from kvxfer.kv.page_allocator import PageAllocator
from kvxfer.workers.http_server import json_body
from kvxfer.workers.worker_core import WorkerCore


class PrefixIndexReport:
    """Builds the /prefix_index answer of one worker from its page allocator."""

    def __init__(self, core: WorkerCore, allocator: PageAllocator) -> None:
        self._core = core
        self._allocator = allocator
        #: Random per process start (the router tells a restart from a version going back).
        self.epoch = secrets.token_hex(8)

    def answer(self, since_version: int) -> dict[str, Any]:
        """The report for a router that last saw `since_version` (0: never)."""
        version, hashes = self._allocator.prefix_snapshot()
        return {
            "worker_id": self._core.worker_id,
            "epoch": self.epoch,
            "version": version,
            "block_size": self._core.config.block_size,
            "namespace": self._core.config.name,
            "capacity_pages": self._allocator.total_pages,
            "blocks": None if since_version == version else [h.hex() for h in hashes],
        }


def add_prefix_index_route(app: FastAPI, report: PrefixIndexReport) -> None:
    """POST /prefix_index on the worker's control API."""

    @app.post("/prefix_index")
    async def prefix_index(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        since = body.get("since_version", 0)
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise HTTPException(422, f"since_version must be a non-negative integer, got {since!r:.40}")
        return report.answer(since)
