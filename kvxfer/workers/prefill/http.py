"""The prefill worker's HTTP API (docs/architecture.md): parses bodies, calls `PrefillService`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from kvxfer.handoff.push_hooks import NO_PUSH_HOOKS, PushHooks, load_hooks
from kvxfer.workers.control_auth import caller_of
from kvxfer.workers.http_server import (
    body_field,
    create_worker_app,
    json_body,
    serve,
    token_list,
)
from kvxfer.workers.prefill.service import PrefillService, PrefillSettings
from kvxfer.workers.prefix_index import PrefixIndexReport, add_prefix_index_route


def create_prefill_app(service: PrefillService) -> FastAPI:
    """The prefill worker's HTTP API (docs/architecture.md)."""
    app = create_worker_app(
        "kvxfer prefill worker", service.core, lambda: {**service.core.base_info(), **service.load()}
    )

    @app.post("/prefill")
    async def prefill(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        request_id = body_field(body, "request_id", str)
        prompt = token_list(body, service.core.config.vocab_size)
        decode = body_field(body, "decode", dict)
        reservation = service.accept_reservation(request_id, decode)
        return await service.prefill(request_id, prompt, reservation, caller_of(request))

    @app.post("/cancel")
    async def cancel(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        return await service.cancel(body_field(body, "request_id", str), caller_of(request))

    add_prefix_index_route(app, PrefixIndexReport(service.core, service.allocator))
    return app


def run_prefill_worker(settings: PrefillSettings) -> None:
    """Starts a prefill worker process: engine, model, HTTP API, etcd registration; its
    pushes call the hooks `settings.push_hooks` names (none when empty)."""
    hooks = load_hooks(settings.push_hooks, PushHooks) if settings.push_hooks else NO_PUSH_HOOKS
    service = PrefillService(settings, hooks)
    serve(create_prefill_app(service), service.core, service.load, service.in_flight)
