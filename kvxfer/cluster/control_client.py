"""An httpx `Auth` that signs calls to workers with the cluster key, for operators' tools
and the local cluster (the router signs its own calls: `kvxfer_router.worker_auth`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from pathlib import Path

import httpx

from kvxfer.registry.control_token import TokenSigner, WorkerIdentity
from kvxfer.registry.signing import load_cluster_key

#: Lifetime of the tokens a tool mints: long enough for one call, short for a leak.
TOOL_TOKEN_LIFETIME_S = 10.0


class ControlTokenAuth(httpx.Auth):
    """Adds a `KvxferToken` for the exact method, path and body of each request, minted for
    the worker it goes to.

    A token names its target worker (role and worker id). A tool given only a URL learns
    them from the worker's open `GET /health`, once per address, and again when the worker
    refuses a token as minted for another (it restarted under a new id). The router never
    asks: it takes identities from the signed registry records.
    """

    def __init__(self, key_path: Path, issuer: str = "operator") -> None:
        self._signer = TokenSigner(load_cluster_key(key_path), issuer, TOOL_TOKEN_LIFETIME_S)
        self._identities: dict[str, WorkerIdentity] = {}

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.read()
        origin = _origin(request)
        for attempt in range(2):
            if attempt or origin not in self._identities:
                health = yield httpx.Request("GET", f"{origin}/health")
                health.read()
                self._learn(origin, health, request)
            response = yield self._signed(origin, request)
            if response.status_code != 403:
                return
            response.read()
            if "wrong_worker" not in response.text:
                return

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        await request.aread()
        origin = _origin(request)
        for attempt in range(2):
            if attempt or origin not in self._identities:
                health = yield httpx.Request("GET", f"{origin}/health")
                await health.aread()
                self._learn(origin, health, request)
            response = yield self._signed(origin, request)
            if response.status_code != 403:
                return
            await response.aread()
            if "wrong_worker" not in response.text:
                return

    def _learn(self, origin: str, health: httpx.Response, request: httpx.Request) -> None:
        info = health.json() if health.status_code == 200 else {}
        if not isinstance(info.get("worker_id"), str) or not isinstance(info.get("role"), str):
            raise httpx.HTTPStatusError(f"{origin}/health does not name a worker", request=request, response=health)
        self._identities[origin] = WorkerIdentity(info["role"], info["worker_id"])

    def _signed(self, origin: str, request: httpx.Request) -> httpx.Request:
        request.headers.update(self._signer.header(self._identities[origin], request.method, request.url.path,
                                                   request.content))
        return request


def _origin(request: httpx.Request) -> str:
    return f"{request.url.scheme}://{request.url.netloc.decode()}"
