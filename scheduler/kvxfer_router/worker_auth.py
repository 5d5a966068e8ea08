"""The credential the router shows workers: a signed token per control call, and the ids
it mints for them.

With a cluster key (`cluster_key_file`) every POST to a worker carries a `KvxferToken`
(`kvxfer.registry.control_token`) bound to the worker it goes to (role and worker id, from
its signed registry record), its path and its exact body bytes, so the body is serialized
here once and sent as those bytes; a POST to a vLLM instance carries the cluster's vLLM API
key instead (`kvxfer.registry.signing.vllm_api_key`: one static key for every instance,
which vLLM checks as a bearer key, so it binds to nothing; docs/architecture.md, "Threat
model"). Without a key, calls go unsigned (workers without a key accept them; development
only).

Request ids towards workers are minted here, never taken from the client: a client's id
(echoed back to it) could collide with, or name, another request inside the cluster.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import httpx

from kvxfer.registry.control_token import TokenSigner, WorkerIdentity
from kvxfer.registry.signing import load_cluster_key, vllm_api_headers, vllm_api_key

from .directory import WorkerView
from .settings import RouterSettings

log = logging.getLogger(__name__)


def mint_worker_request_id() -> str:
    """A fresh id for one request inside the cluster (unguessable: 128 random bits)."""
    return f"kx-{uuid.uuid4().hex}"


class WorkerCallSigner:
    """Serializes a control-call body and adds the token that admits it at the worker."""

    def __init__(self, signer: TokenSigner | None, vllm_key: str | None = None) -> None:
        self._signer = signer
        self._vllm_key = vllm_key

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> WorkerCallSigner:
        """Signs with the cluster key of `settings`; unsigned (with a warning) without one."""
        if settings.cluster_key_file is None:
            log.warning("no cluster key (KVXFER_ROUTER_CLUSTER_KEY_FILE): calls to workers carry no credential; "
                        "workers with a key refuse them. Development only.")
            return cls(None)
        key = load_cluster_key(settings.cluster_key_file)
        return cls(TokenSigner(key, settings.control_issuer, settings.control_token_lifetime_s), vllm_api_key(key))

    @property
    def signs(self) -> bool:
        """Whether calls carry a token."""
        return self._signer is not None

    def request(self, worker: WorkerView, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for httpx's POST of `body` to `path` on kvxfer worker `worker`:
        its URL, the exact content and the headers, with a token for this one call to it."""
        url = worker.url(path)
        content = json.dumps(body, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"}
        if self._signer is not None:
            target = WorkerIdentity(worker.role, worker.worker_id)
            headers.update(self._signer.header(target, "POST", httpx.URL(url).path, content))
        return {"url": url, "content": content, "headers": headers}

    def vllm_request(self, worker: WorkerView, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The same for a vLLM instance: it gets the cluster's vLLM API key, the only
        credential vLLM checks (the vLLM leg type calls this one, the builtin one
        :meth:`request`)."""
        content = json.dumps(body, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", **vllm_api_headers(self._vllm_key)}
        return {"url": worker.url(path), "content": content, "headers": headers}

    def vllm_headers(self) -> dict[str, str]:
        """The headers that present the cluster's vLLM API key (none without a cluster key),
        for a call without a body to a vLLM instance's connector."""
        return vllm_api_headers(self._vllm_key)
