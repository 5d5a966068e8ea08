"""The gate in front of a worker's control API: only callers holding the cluster key get in.

A pure ASGI middleware, so it sees the raw body bytes the token's digest covers and refuses
a request before any route runs (nothing is parsed, reserved or cancelled). Open paths
(`OPEN_PATHS`: liveness, readiness, Prometheus) need no token: probes and scrapers hold no
key, and they change nothing. Every other path needs a valid `KvxferToken`
(`kvxfer.registry.control_token`) minted for this worker (its role and worker id): 401 when
it is missing, malformed, expired or replayed, 403 when it was minted for another worker or
its signature does not verify; each refusal is counted in
`kvxfer_worker_auth_rejected_total{reason}`. The verified issuer is put in the request
scope (`caller_of(request)`), so request ids and limits can be scoped to it.

The body is read here, bounded by `max_body_bytes` (413 beyond) and `body_timeout_s` (408):
no control body is legitimately large, and an unbounded read would let anyone hold memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvxfer.metrics import WorkerAuthMetrics
from kvxfer.registry.control_token import TokenRefused, TokenVerifier, WorkerIdentity
from kvxfer.registry.signing import load_cluster_key
from kvxfer.workers.worker_core import WorkerSettings

log = logging.getLogger("kvxfer.worker.auth")

#: Paths any client may call: they only report (probes, Prometheus) and change nothing.
OPEN_PATHS: frozenset[str] = frozenset({"/health", "/ready", "/metrics"})
#: The caller of requests served without a cluster key (development only).
ANONYMOUS = "anonymous"
_SCOPE_KEY = "kvxfer_caller"


def caller_of(request: Request) -> str:
    """The verified issuer of this request (`ANONYMOUS` when the worker runs without a key)."""
    return str(request.scope.get("state", {}).get(_SCOPE_KEY, ANONYMOUS))


class _Refusal(Exception):
    def __init__(self, status: int, reason: str, detail: str) -> None:
        self.status, self.reason, self.detail = status, reason, detail


class ControlAuthMiddleware:
    """Admits a control call only with a valid token for its method, path and body."""

    def __init__(self, app: ASGIApp, *, verifier: TokenVerifier, registry: CollectorRegistry,
                 max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.verifier = verifier
        self.metrics = WorkerAuthMetrics(registry)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
            header = _header(scope, b"authorization")
            try:
                caller = self.verifier.verify(header, scope["method"], scope["path"], body)
            except TokenRefused as exc:
                raise _Refusal(exc.reason.status, exc.reason.value, str(exc)) from None
        except asyncio.TimeoutError:
            await _answer(send, 408, {"detail": f"request body not received within {self.body_timeout_s} s"})
            return
        except _Refusal as refusal:
            self.metrics.rejected.labels(refusal.reason).inc()
            log.warning("refused %s %s: %s", scope["method"], scope["path"], refusal.detail)
            await _answer(send, refusal.status, {"detail": refusal.detail, "reason": refusal.reason},
                          {"WWW-Authenticate": "KvxferToken"} if refusal.status == 401 else None)
            return
        scope.setdefault("state", {})[_SCOPE_KEY] = caller.issuer
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refusal(400, "malformed", "client went away before its body was complete")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refusal(413, "too_large", f"control request body exceeds {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the real channel (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


def install_control_auth(app: FastAPI, settings: WorkerSettings, registry: CollectorRegistry,
                         identity: WorkerIdentity) -> None:
    """Puts the gate in front of `app` (the worker `identity`) when the worker has a cluster
    key; warns when it has none."""
    if settings.cluster_key_file is None:
        log.warning("no cluster key (KVXFER_CLUSTER_KEY_FILE): this worker's control API takes anyone's "
                    "requests. Development only.")
        return
    verifier = TokenVerifier(load_cluster_key(settings.cluster_key_file), identity,
                             max_lifetime_s=settings.control_token_max_lifetime_s,
                             clock_skew_s=settings.control_token_clock_skew_s)
    app.add_middleware(ControlAuthMiddleware, verifier=verifier, registry=registry,
                       max_body_bytes=settings.control_max_body_bytes,
                       body_timeout_s=settings.control_body_timeout_s)
