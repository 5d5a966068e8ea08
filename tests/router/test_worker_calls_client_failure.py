"""An exception from the HTTP client that is none of httpx's own errors fails the leg (so
the request goes to another pair) instead of escaping as the router's 500.

Seen in tests/e2e/test_cluster_e2e.py::TestCrashes::test_sigkill_prefill_under_load:
httpcore's pool, checking whether an idle connection to a prefill worker SIGKILLed a moment
before was readable, asked anyio for the socket of an already closed transport and raised
AttributeError ('NoneType' object has no attribute 'getpeername'); the client got "internal
router error". Here the client's transport raises that same error.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvxfer_router import RouterSettings
from kvxfer_router.directory import WorkerView
from kvxfer_router.leg_failure import LegFailure
from kvxfer_router.worker_auth import WorkerCallSigner
from kvxfer_router.worker_calls import WorkerCalls

WORKER = WorkerView(worker_id="p1", role="prefill", http_url="http://127.0.0.1:9", model="m", kv_layout={})


def _closed_socket_transport(request: httpx.Request) -> httpx.Response:
    raise AttributeError("'NoneType' object has no attribute 'getpeername'")


def _calls() -> tuple[WorkerCalls, httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(_closed_socket_transport))
    return WorkerCalls(RouterSettings(), client, WorkerCallSigner(None)), client


def test_a_post_whose_client_fails_is_a_leg_failure() -> None:
    async def run() -> None:
        calls, client = _calls()
        async with client:
            await calls.post_json(WORKER, "/prefill", {}, stage="prefill", request_id="r1", total_timeout_s=5.0)

    with pytest.raises(LegFailure, match="the HTTP client failed on this worker's connection: AttributeError"):
        asyncio.run(run())


def test_a_stream_whose_client_fails_is_a_leg_failure() -> None:
    async def run() -> None:
        calls, client = _calls()
        async with client:
            async for _ in calls.stream_lines(WORKER, "/generate", {}, stage="generate", request_id="r2",
                                              rejected_statuses=(400,), end_marker="done",
                                              is_last=lambda line: False):
                pass

    with pytest.raises(LegFailure, match="the HTTP client failed on this worker's connection: AttributeError"):
        asyncio.run(run())
