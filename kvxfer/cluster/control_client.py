"""An httpx `Auth` that signs calls to workers with the cluster key, for operators' tools
and the local cluster (the router signs its own calls: `kvxfer_router.worker_auth`)."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import httpx

from kvxfer.registry.control_token import TokenSigner
from kvxfer.registry.signing import load_cluster_key

#: Lifetime of the tokens a tool mints: long enough for one call, short for a leak.
TOOL_TOKEN_LIFETIME_S = 10.0


class ControlTokenAuth(httpx.Auth):
    """Adds a `KvxferToken` for the exact method, path and body of each request."""

    requires_request_body = True

    def __init__(self, key_path: Path, issuer: str = "operator") -> None:
        self._signer = TokenSigner(load_cluster_key(key_path), issuer, TOOL_TOKEN_LIFETIME_S)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(self._signer.header(request.method, request.url.path, request.content))
        yield request
