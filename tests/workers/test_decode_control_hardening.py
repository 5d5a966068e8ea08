"""A decoder's control API under the two attacks and races of issue 28 that are not about the
fabric, against real processes with a cluster key:

1. a token captured on its way to one decoder is refused by another (403, counted), and
   the other decoder's pages stay free;
2. a reservation whose caller gave up never outlives it: a cancel that arrives before its
   /reserve completed makes that /reserve fail and take nothing, and a /reserve whose
   caller hung up before it completed is released at once (the router gives up waiting
   for a /reserve under overload; before, the late reservation held its pages for
   reservation_ttl_s plus the fence, 135 s).
"""

from __future__ import annotations

import base64
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.cluster_load import get_metrics, metric_value
from support.worker_procs import WorkerProc, WorkerSet

from kvxfer.registry.control_token import TokenSigner, WorkerIdentity

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(1, 40))


class Decoders:
    """Two decode workers sharing a cluster key, and a router's signer for that key."""

    def __init__(self, key_path: Path, first: WorkerProc, second: WorkerProc) -> None:
        self.first = first
        self.second = second
        self.signer = TokenSigner(key_path.read_bytes().strip(), "router", 10.0)

    def signed_post(self, worker: WorkerProc, path: str, body: dict[str, Any], *,
                    target: WorkerProc | None = None) -> httpx.Response:
        """POST `body` to `worker` with a token minted for `target` (default: `worker` itself)."""
        content = httpx.Request("POST", worker.url + path, json=body).content
        header = self.signer.header(identity_of(target or worker), "POST", path, content)
        return httpx.post(worker.url + path, content=content, trust_env=False, timeout=10,
                          headers={**header, "Content-Type": "application/json"})

    def free_pages(self, worker: WorkerProc) -> float:
        return metric_value(get_metrics(worker.url), "kvxfer_decode_kv_pages_free")


def identity_of(worker: WorkerProc) -> WorkerIdentity:
    """The role and worker id a worker's open /health names."""
    health = httpx.get(f"{worker.url}/health", trust_env=False, timeout=5).json()
    return WorkerIdentity(health["role"], health["worker_id"])


@pytest.fixture(scope="module")
def decoders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Decoders]:
    tmp = tmp_path_factory.mktemp("two-decoders")
    key_path = tmp / "cluster.key"
    key_path.write_bytes(base64.b64encode(secrets.token_bytes(48)))
    workers = WorkerSet(tmp)
    env = {"KVXFER_CLUSTER_KEY_FILE": str(key_path)}
    try:
        first, second = workers.start_many([("decode", {"env": env, "num_pages": 64}),
                                            ("decode", {"env": env, "num_pages": 64})])
        yield Decoders(key_path, first, second)
    except BaseException:
        print(workers.logs())
        raise
    finally:
        workers.close()


def test_a_reserve_captured_for_one_decoder_is_refused_by_another(decoders: Decoders) -> None:
    first, second = decoders.first, decoders.second
    free_before = decoders.free_pages(second)
    refused_before = metric_value(get_metrics(second.url), "kvxfer_worker_auth_rejected_total")
    body = {"request_id": "kx-captured", "prompt_tokens": PROMPT, "max_tokens": 8}
    content = httpx.Request("POST", first.url + "/reserve", json=body).content
    captured = decoders.signer.header(identity_of(first), "POST", "/reserve", content)
    headers = {**captured, "Content-Type": "application/json"}

    replayed = httpx.post(second.url + "/reserve", content=content, headers=headers, trust_env=False, timeout=10)
    genuine = httpx.post(first.url + "/reserve", content=content, headers=headers, trust_env=False, timeout=10)

    assert replayed.status_code == 403 and replayed.json()["reason"] == "wrong_worker", replayed.text
    assert genuine.status_code == 200, genuine.text  # the same token where it was meant to go
    assert decoders.free_pages(second) == free_before
    assert metric_value(get_metrics(second.url), 'kvxfer_worker_auth_rejected_total{reason="wrong_worker"}') >= 1
    assert metric_value(get_metrics(second.url), "kvxfer_worker_auth_rejected_total") == refused_before + 1
    assert decoders.signed_post(first, "/cancel", {"request_id": "kx-captured", "prefill_stopped": True}).is_success


def test_a_reserve_cancelled_before_it_ran_takes_nothing(decoders: Decoders) -> None:
    worker = decoders.first
    free_before = decoders.free_pages(worker)
    cancel = decoders.signed_post(worker, "/cancel", {"request_id": "kx-gave-up", "prefill_stopped": True})
    late = decoders.signed_post(worker, "/reserve", {"request_id": "kx-gave-up", "prompt_tokens": PROMPT,
                                                     "max_tokens": 8})
    assert cancel.status_code == 200, cancel.text
    assert late.status_code == 409 and late.json()["reason"] == "conflict", late.text
    assert decoders.free_pages(worker) == free_before
    # Another id of the same caller reserves as usual.
    ok = decoders.signed_post(worker, "/reserve", {"request_id": "kx-next", "prompt_tokens": PROMPT, "max_tokens": 8})
    assert ok.status_code == 200, ok.text
    decoders.signed_post(worker, "/cancel", {"request_id": "kx-next", "prefill_stopped": True})
    assert decoders.free_pages(worker) == free_before


def test_a_reserve_whose_caller_hung_up_is_released_when_it_completes(decoders: Decoders) -> None:
    # The router's side of a /reserve it stopped waiting for: the request was sent whole,
    # then the connection closed before any answer. The worker reserves anyway (the request
    # is complete) and must notice the caller is gone before answering.
    worker = decoders.second
    free_before = decoders.free_pages(worker)
    body = httpx.Request("POST", worker.url + "/reserve", json={
        "request_id": "kx-hung-up", "prompt_tokens": PROMPT, "max_tokens": 8}).content
    header = decoders.signer.header(identity_of(worker), "POST", "/reserve", body)
    host, port = worker.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        head = (f"POST /reserve HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Authorization: {header['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        sock.sendall(head + body)  # and closed at once: the caller is gone before any answer
    deadline = time.monotonic() + 10
    while decoders.free_pages(worker) != free_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert decoders.free_pages(worker) == free_before
