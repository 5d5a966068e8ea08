"""The HTTP face both worker roles share: JSON body parsing, the mapping of a service's
`Rejection` to a status code, the common routes, and the serve loop with graceful drain.

Drain on SIGTERM: the worker marks itself `draining` in etcd (routers stop picking it),
finishes what is in flight (bounded by `drain_timeout_s`), revokes its lease and exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvxfer.kv.page_allocator import PageAllocationError
from kvxfer.registry.control_token import WorkerIdentity
from kvxfer.workers.control_auth import install_control_auth
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore

log = logging.getLogger("kvxfer.worker")

#: Seconds a worker keeps an idle HTTP keep-alive connection open; longer than any client
#: pool's idle expiry (the router's httpx pool: 5 s), so only the client closes idle ones.
KEEP_ALIVE_S = 75

#: The status each rejection answers with; the router maps these onward (docs/architecture.md).
STATUS_OF: dict[Rejection, int] = {
    Rejection.DRAINING: 503,
    Rejection.BAD_REQUEST: 400,
    Rejection.INVALID: 422,
    Rejection.CONFLICT: 409,
    Rejection.OVERLOADED: 429,
    Rejection.UNKNOWN_REQUEST: 404,
    Rejection.PUSH_FAILED: 502,
    Rejection.DESTINATION_DOWN: 502,
    Rejection.KV_TIMEOUT: 504,
    Rejection.INTEGRITY: 502,
    Rejection.FAILED: 500,
}


def create_worker_app(title: str, core: WorkerCore, info: Callable[[], dict[str, Any]]) -> FastAPI:
    """A FastAPI app with the common routes and the rejection-to-status mapping installed."""
    app = FastAPI(title=title)
    add_common_routes(app, core, info)
    install_control_auth(app, core.settings, core.metrics_registry, WorkerIdentity(core.role, core.worker_id))

    @app.exception_handler(RequestRejected)
    async def rejected(_: Request, exc: RequestRejected) -> JSONResponse:
        retry_after_s = exc.retry_after_s
        if retry_after_s is None and exc.reason is Rejection.OVERLOADED:
            # Every "no room now" is a 429 the caller may retry: always say when.
            retry_after_s = core.settings.retry_after_s
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
        return JSONResponse({"detail": str(exc), "reason": exc.reason.value}, status_code=STATUS_OF[exc.reason],
                            headers=headers)

    @app.exception_handler(PageAllocationError)
    async def allocation_error(_: Request, exc: PageAllocationError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    return app


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; 400 when it is not JSON or not an object."""
    try:
        body = await request.json()
    except ValueError:
        raise HTTPException(400, "malformed JSON body") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "JSON body must be an object")
    return body


def body_field(body: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    """`body[name]` checked to be a `kind` (bools are not ints); 422 when missing or wrong."""
    if name not in body:
        if default is ...:
            raise HTTPException(422, f"missing field {name!r}")
        return default
    value = body[name]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise HTTPException(422, f"field {name!r} must be {kind.__name__}")
    return value


def token_list(body: dict[str, Any], vocab: int) -> list[int]:
    """`body["prompt_tokens"]`: a list of token ids in ``[0, vocab)``; 422 otherwise."""
    tokens = body_field(body, "prompt_tokens", list)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise HTTPException(422, f"prompt_tokens must be integers in [0, {vocab})")
    return tokens


def add_common_routes(app: FastAPI, core: WorkerCore, info: Callable[[], dict[str, Any]]) -> None:
    """GET /health, /ready, /info and /metrics."""

    @app.get("/health")
    def health() -> dict[str, str]:
        # Who answers: a tool that signs calls (`kvxfer.cluster.control_client`) mints its
        # tokens for this worker. Not a secret (the registry lists it); it grants nothing.
        return {"status": "ok", "worker_id": core.worker_id, "role": core.role}

    @app.get("/ready")
    def ready(response: Response) -> dict[str, Any]:
        registered = core.registration is None or core.registration.is_registered
        ok = registered and not core.engine.closed and not core.draining
        response.status_code = 200 if ok else 503
        return {"ready": ok, "registered": registered, "draining": core.draining}

    @app.get("/info")
    def get_info() -> dict[str, Any]:
        return info()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(core.metrics_registry), media_type=CONTENT_TYPE_LATEST)


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) for uvicorn to serve on (port 0: any free one).

    Made with its protocol named (IPPROTO_TCP), not 0: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on accepted connections whose socket says TCP, and uvicorn writes a
    response's head and body separately. With Nagle on, the body waited for the client's
    delayed ACK of the head: every call to a worker took 44 ms instead of about 1 ms, twice
    in every request's time to first token (/reserve, then /prefill and /generate).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def serve(
    app: FastAPI,
    core: WorkerCore,
    load: Callable[[], dict[str, Any]],
    in_flight: Callable[[], int],
) -> None:
    """Runs the worker's HTTP server until SIGINT/SIGTERM, then drains and exits."""
    settings = core.settings
    sock = bind_listener(settings.host, settings.port)
    port = sock.getsockname()[1]
    advertise = settings.advertise_host or settings.host
    core.http_url = f"http://{advertise}:{port}"
    # Keep idle connections open well past the router's pool expiry (httpx: 5 s). With
    # uvicorn's default of 5 s both sides expire together, and a router reusing a connection
    # the worker is just closing gets a ReadError (a spurious failure and retry).
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = uvicorn.Server(config)

    async def drain() -> None:
        if core.draining:
            return
        core.draining = True
        log.info("%s draining: %d requests in flight", core.worker_id, in_flight())
        core.update_load(draining=True)
        deadline = time.monotonic() + settings.drain_timeout_s
        while in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if core.registration is not None:
            core.registration.revoke()
            core.registration = None
        server.should_exit = True

    async def main() -> None:
        loop = asyncio.get_running_loop()
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.02)
        # Replace uvicorn's handlers: exit only after the drain.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(drain()))
        await asyncio.to_thread(core.register, load())  # off the loop: /health answers meanwhile
        print(f"kvxfer {core.role} worker {core.worker_id} serving on {core.http_url} "
              f"(engine {core.engine.provider} x{core.engine.rails})", flush=True)
        await serve_task

    try:
        asyncio.run(main())
    finally:
        core.close()
        log.info("%s stopped", core.worker_id)
