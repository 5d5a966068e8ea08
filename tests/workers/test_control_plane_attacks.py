"""Attacks on a worker's control API and its ImmCounter, against real processes with a
cluster key: each is refused (401/403/404/429), counted, changes nothing, and a legitimate
request running beside it still matches the colocated reference.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.cluster_load import get_metrics, metric_value
from support.kv_requests import (
    DIGEST_ENV,
    PREFILL_ENV,
    check_against_reference,
    disaggregated,
    text_prompt,
    tokens_of,
)
from support.waiting import wait_until
from support.worker_procs import WorkerProc, WorkerSet

from kvxfer.cluster.control_client import ControlTokenAuth
from kvxfer.kv.protocol import encode_imm
from kvxfer.registry.control_token import TokenSigner, WorkerIdentity
from kvxfer.transfer.engine import TransferEngine

pytestmark = pytest.mark.timeout(240)

MAX_REQUESTS = 8
PER_CALLER = 3
PROMPT = tokens_of(text_prompt(15, 200))


class Cluster:
    """A decode and a prefill worker sharing a cluster key, and the key's clients."""

    def __init__(self, key_path: Path, decode: WorkerProc, prefill: WorkerProc) -> None:
        self.key_path = key_path
        self.decode = decode
        self.prefill = prefill

    def client(self, issuer: str = "router") -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=30, trust_env=False, auth=ControlTokenAuth(self.key_path, issuer))

    def auth_rejections(self, worker: WorkerProc, reason: str | None = None) -> float:
        sample = "kvxfer_worker_auth_rejected_total" + (f'{{reason="{reason}"}}' if reason else "")
        return metric_value(get_metrics(worker.url), sample)

    def decode_info(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.decode.url}/info", auth=ControlTokenAuth(self.key_path), trust_env=False)
        assert resp.status_code == 200, resp.text
        return resp.json()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("secure-workers")
    key_path = tmp / "cluster.key"
    key_path.write_bytes(base64.b64encode(secrets.token_bytes(48)))
    workers = WorkerSet(tmp)
    env = {"KVXFER_CLUSTER_KEY_FILE": str(key_path)}
    try:
        decode, prefill = workers.start_many([
            ("decode", {"env": {**env, **DIGEST_ENV, "KVXFER_MAX_REQUESTS": str(MAX_REQUESTS),
                                "KVXFER_MAX_RESERVATIONS_PER_CALLER": str(PER_CALLER)}}),
            ("prefill", {"env": {**env, **PREFILL_ENV}}),
        ])
        yield Cluster(key_path, decode, prefill)
    except BaseException:
        print(workers.logs())
        raise
    finally:
        workers.close()


async def legit_request(cluster: Cluster, rid: str) -> None:
    async with cluster.client("router") as client:
        reservation, pre, gen = await disaggregated(client, cluster.decode, cluster.prefill, rid, PROMPT)
    check_against_reference(rid, PROMPT, reservation, pre, gen)


def identity_of(worker: WorkerProc) -> WorkerIdentity:
    """The role and worker id a worker's open /health names (what its tokens must target)."""
    health = httpx.get(f"{worker.url}/health", trust_env=False).json()
    return WorkerIdentity(health["role"], health["worker_id"])


def body_of(path: str, rid: str) -> dict[str, Any]:
    if path == "/reserve":
        return {"request_id": rid, "prompt_tokens": PROMPT, "max_tokens": 16}
    if path == "/prefill":
        return {"request_id": rid, "prompt_tokens": PROMPT, "decode": {"pages": [0, 1, 2]}}
    return {"request_id": rid}


TARGETS = [("decode", "/reserve"), ("decode", "/cancel"), ("decode", "/generate"), ("prefill", "/prefill"),
           ("prefill", "/cancel"), ("decode", "/prefix_index"), ("prefill", "/prefix_index")]


def test_calls_without_a_valid_token_are_refused_counted_and_change_nothing(cluster: Cluster) -> None:
    before_pages = cluster.decode_info()["free_pages"]
    forger = TokenSigner(secrets.token_bytes(48), "router", 10.0)  # the right format, another key
    stale = TokenSigner(cluster.key_path.read_bytes().strip(), "router", 10.0)
    counted = {w: cluster.auth_rejections(getattr(cluster, w)) for w in ("decode", "prefill")}

    async def attack() -> list[tuple[str, str, int, str]]:
        out = []
        async with httpx.AsyncClient(timeout=10, trust_env=False) as outsider:
            for role, path in TARGETS:
                url = getattr(cluster, role).url + path
                target = identity_of(getattr(cluster, role))
                content = httpx.Request("POST", url, json=body_of(path, "victim")).content
                for kind, headers in [
                    ("missing", {}),
                    ("malformed", {"Authorization": "Bearer hunter2"}),
                    ("bad_signature", forger.header(target, "POST", path, content)),
                    ("expired", {"Authorization": "KvxferToken " + stale.token(target, "POST", path, content,
                                                                              now_s=time.time() - 60)}),
                ]:
                    resp = await outsider.post(url, content=content,
                                               headers={**headers, "Content-Type": "application/json"})
                    out.append((role, path + " " + kind, resp.status_code, resp.json().get("reason", "")))
        return out

    async def both() -> list[tuple[str, str, int, str]]:
        results, _ = await asyncio.gather(attack(), legit_request(cluster, "legit-beside-forgeries"))
        return results

    results = asyncio.run(both())
    for role, what, status, reason in results:
        kind = what.split()[-1]
        assert status == (403 if kind == "bad_signature" else 401), (role, what, status)
        assert reason == kind, (role, what, reason)
    # Each refusal is counted, by reason, on the worker that refused it.
    for role in ("decode", "prefill"):
        n = sum(1 for r in results if r[0] == role)
        assert cluster.auth_rejections(getattr(cluster, role)) - counted[role] == n, role
    # Nothing changed: every page is back, no reservation named "victim" exists.
    assert cluster.decode_info()["free_pages"] == before_pages


def test_a_captured_token_cannot_be_replayed(cluster: Cluster) -> None:
    signer = TokenSigner(cluster.key_path.read_bytes().strip(), "router", 10.0)
    header = signer.header(identity_of(cluster.decode), "GET", "/info", b"")
    url = f"{cluster.decode.url}/info"
    before = cluster.auth_rejections(cluster.decode, "replayed")
    assert httpx.get(url, headers=header, trust_env=False).status_code == 200
    replay = httpx.get(url, headers=header, trust_env=False)
    assert replay.status_code == 401 and replay.json()["reason"] == "replayed"
    assert cluster.auth_rejections(cluster.decode, "replayed") == before + 1


def test_probes_and_metrics_stay_open(cluster: Cluster) -> None:
    for worker in (cluster.decode, cluster.prefill):
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(worker.url + path, trust_env=False).status_code in (200, 503), path
        assert httpx.get(worker.url + "/info", trust_env=False).status_code == 401


def test_another_caller_cannot_cancel_or_take_over_a_request(cluster: Cluster) -> None:
    async def run() -> None:
        async with cluster.client("router") as router, cluster.client("intruder") as intruder:
            rid = "kx-owned-by-router"
            reservation = (await router.post(f"{cluster.decode.url}/reserve", json=body_of("/reserve", rid))).json()
            # Same cluster key, other issuer: the id is unknown to it.
            for path, body in [("/cancel", {"request_id": rid}), ("/generate", {"request_id": rid, "timeout_s": 1})]:
                resp = await intruder.post(f"{cluster.decode.url}{path}", json=body)
                assert resp.status_code == 404, (path, resp.text)
            # The owner's request goes on and is correct.
            from support.kv_requests import generate_call, prefill_call
            pre, gen = await asyncio.gather(prefill_call(router, cluster.prefill, rid, PROMPT, reservation),
                                            generate_call(router, cluster.decode, rid, stream=True))
            check_against_reference(rid, PROMPT, reservation, pre, gen)

    asyncio.run(run())


def test_one_caller_cannot_squat_every_reservation(cluster: Cluster) -> None:
    before = metric_value(get_metrics(cluster.decode.url), "kvxfer_decode_caller_limit_rejections_total")

    async def run() -> None:
        async with cluster.client("squatter") as squatter:
            held = []
            for i in range(PER_CALLER):
                resp = await squatter.post(f"{cluster.decode.url}/reserve", json=body_of("/reserve", f"sq-{i}"))
                assert resp.status_code == 200, resp.text
                held.append(f"sq-{i}")
            refused = await squatter.post(f"{cluster.decode.url}/reserve", json=body_of("/reserve", "sq-more"))
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "max_reservations_per_caller" in refused.json()["detail"]
            # Another caller still gets its share and a correct answer.
            await legit_request(cluster, "legit-beside-squatter")
            for rid in held:
                resp = await squatter.post(f"{cluster.decode.url}/cancel",
                                           json={"request_id": rid, "prefill_stopped": True})
                assert resp.status_code == 200 and resp.json()["state"] == "free"

    asyncio.run(run())
    assert metric_value(get_metrics(cluster.decode.url), "kvxfer_decode_caller_limit_rejections_total") == before + 1


def test_immediates_injected_before_a_reservation_are_dropped_on_arrival_never_credited(cluster: Cluster) -> None:
    # An outside process with the decoder's engine address (stolen from /info here) credits
    # every slot's next generations before the reservations exist. A decoder that counted
    # them would find the next request "complete" before its KV landed. Its engine counts
    # only the immediates of live reservations (claimed when reserved), so every injected
    # one is dropped on arrival and none is even left for /reserve's stray check.
    address = bytes.fromhex(cluster.decode_info()["engine_address"])
    generations = 24  # well beyond what the tests of this module use per slot
    metrics = get_metrics(cluster.decode.url)
    stray_before = metric_value(metrics, "kvxfer_decode_stray_immediates_total")
    unclaimed_before = metric_value(metrics, "kvxfer_engine_imm_unclaimed_dropped_total")
    injected = MAX_REQUESTS * generations
    with TransferEngine("net", bind_host="127.0.0.1") as outsider:
        for slot in range(MAX_REQUESTS):
            for generation in range(generations):
                outsider.write_imm(address, encode_imm(slot, generation)).wait(timeout=5)
    wait_until(lambda: metric_value(get_metrics(cluster.decode.url), "kvxfer_engine_imm_unclaimed_dropped_total")
               - unclaimed_before >= injected, 10, "every injected immediate dropped on arrival")

    async def run() -> None:
        await asyncio.gather(*(legit_request(cluster, f"legit-after-injection-{i}") for i in range(2)))

    asyncio.run(run())
    stray = metric_value(get_metrics(cluster.decode.url), "kvxfer_decode_stray_immediates_total") - stray_before
    assert stray == 0, f"{stray} injected immediates were counted for a reservation"
