"""The decode worker's HTTP API (docs/architecture.md): parses bodies, calls `DecodeService`,
and streams tokens as NDJSON."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvxfer.errors import TransferTimeout
from kvxfer.workers.control_auth import caller_of
from kvxfer.workers.decode.job import DecodeJob, DecodePhase, token_events
from kvxfer.workers.decode.service import DecodeService, DecodeSettings
from kvxfer.workers.http_server import (
    body_field,
    create_worker_app,
    json_body,
    serve,
    token_list,
)
from kvxfer.workers.prefix_index import PrefixIndexReport, add_prefix_index_route
from kvxfer.workers.rejection import Rejection, RequestRejected

#: Response header with the transfer receipt (kv.integrity.TransferReceipt.header_value).
RECEIPT_HEADER = "X-Kvxfer-Transfer-Receipt"


async def _respond(service: DecodeService, job: DecodeJob, stream: bool) -> Any:
    headers = {RECEIPT_HEADER: job.receipt.header_value()} if job.receipt is not None else {}
    if stream:

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for item in token_events(job):
                    yield (json.dumps(item) + "\n").encode()
            finally:
                # Client went away mid-stream: stop decoding for it.
                if job.phase is DecodePhase.RUNNING:
                    service.end(job, DecodePhase.CANCELLED)

        return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)
    items = [item async for item in token_events(job)]
    tokens = [i["token"] for i in items if "token" in i]
    last = items[-1]
    if last.get("finish_reason") == "error":
        raise HTTPException(500, last.get("error", "generation failed"))
    body = {
        "request_id": job.request_id,
        "tokens": tokens,
        "text": service.tokenizer.decode(tokens),
        "finish_reason": last["finish_reason"],
        "usage": last["usage"],
        # Prompt tokens this worker had in its prefix cache: neither received nor computed.
        "cached_tokens": job.held_pages * job.block_size,
    }
    if job.receipt is not None:
        body["receipt"] = job.receipt.to_json()
    return JSONResponse(body, headers=headers)


def create_decode_app(service: DecodeService) -> FastAPI:
    """The decode worker's HTTP API (docs/architecture.md)."""
    app = create_worker_app(
        "kvxfer decode worker", service.core, lambda: {**service.core.base_info(), **service.load()}
    )

    @app.post("/reserve")
    async def reserve(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        request_id = str(body_field(body, "request_id", str))
        tokens = token_list(body, service.core.config.vocab_size)
        max_tokens = body_field(body, "max_tokens", int)
        prefill_hex = str(body_field(body, "prefill_engine_address", str, ""))
        try:
            prefill_address = bytes.fromhex(prefill_hex) if prefill_hex else None
        except ValueError:
            raise HTTPException(422, "field 'prefill_engine_address' must be hex") from None
        # In a thread: a reservation's registrations and immediate binding are hand-offs to
        # the engine's progress thread, which must not stall every other request's I/O.
        reservation = await run_in_threadpool(service.reserve, request_id, len(tokens), max_tokens,
                                              caller_of(request), prefill_address=prefill_address, prompt=tokens)
        if await request.is_disconnected():
            # The caller gave up waiting (under load a reservation can queue past its
            # timeout): nobody will use or cancel these pages, and no prefiller has the
            # reservation, so they go back at once rather than after reservation_ttl_s.
            service.cancel(request_id, True, caller_of(request))
            raise RequestRejected(Rejection.CONFLICT, f"request {request_id}: the caller went away before its "
                                  "reservation was made; released", request_id)
        # Prompt tokens whose KV this worker already holds (prefix cache): not pushed.
        block_size = service.core.config.block_size
        return {**reservation.to_json(), "cached_tokens": reservation.first_page * block_size}

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await json_body(request)
        job = service.job(str(body_field(body, "request_id", str)), caller_of(request))
        timeout_s = body.get("timeout_s", service.settings.kv_wait_timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise HTTPException(422, f"timeout_s must be a positive number, got {timeout_s!r}")
        try:
            await service.wait_for_kv(job, timeout_s)
        except TransferTimeout as exc:
            raise RequestRejected(Rejection.KV_TIMEOUT, str(exc), job.request_id) from None
        return await _respond(service, job, bool(body.get("stream", False)))

    @app.post("/generate_local")
    async def generate_local(request: Request) -> Any:
        body = await json_body(request)
        request_id = str(body_field(body, "request_id", str))
        tokens = token_list(body, service.core.config.vocab_size)
        max_tokens = body_field(body, "max_tokens", int)
        service.reserve(request_id, len(tokens), max_tokens, caller_of(request), prompt=tokens)
        job = service.job(request_id, caller_of(request))
        await service.prefill_locally(job, tokens)
        return await _respond(service, job, bool(body.get("stream", False)))

    @app.post("/cancel")
    async def cancel(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        prefill_stopped = body_field(body, "prefill_stopped", bool, False)
        return service.cancel(str(body_field(body, "request_id", str)), prefill_stopped, caller_of(request))

    add_prefix_index_route(app, PrefixIndexReport(service.core, service.allocator))
    return app


def run_decode_worker(settings: DecodeSettings) -> None:
    """Starts a decode worker process: engine, model, HTTP API, etcd registration."""
    service = DecodeService(settings)
    app = create_decode_app(service)
    try:
        serve(app, service.core, service.load, service.in_flight)
    finally:
        service.stop_threads()
