"""A streamed request on vLLM instances gets its KV figures counted: once the client has the
stream's `[DONE]`, the router asks the decode instance (`GET <metrics_url>/kvxfer/loads/
<transfer_id>`, with the cluster's vLLM API key) and its per-request histogram and page
counters move by the report; an endpoint that is slow or fails leaves the answer as it
was and counts in `kvxfer_router_load_report_fetch_failures_total`.

A router app (in this process, on the module's server thread) serves one prefill + decode
pair (engine "vllm") whose two instances are one stub ASGI app; the prompt picks how the
stub's load endpoint behaves for that request's transfer id."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvxfer_router import RouterSettings, StaticWorkerDirectory
from kvxfer_router.app import create_app
from kvxfer_router.directory import WorkerView
from kvxfer_router.load_report_fetch import LoadReportFetcher
from kvxfer_router.telemetry import RouterTelemetry
from kvxfer_router.vllm_http import VllmLegClient
from kvxfer_router.worker_auth import WorkerCallSigner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from support.fake_workers import ServerHost
from support.waiting import wait_until

from kvxfer.registry.signing import load_cluster_key, vllm_api_key

MODEL = "stub"
REPORT = {"role": "decode", "pages_loaded": 6, "bytes_loaded": 98304, "pages_held": 2}
#: The router's deadline for a load report; the "slow" endpoint answers after SLOW_ENDPOINT_S.
LOAD_REPORT_TIMEOUT_S = 0.3
SLOW_ENDPOINT_S = 3.0
#: How long the router may take to count a fetch once the stream ended (it runs aside).
COUNTED_TIMEOUT_S = 5.0


def _event(finish: str | None) -> bytes:
    return json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 1, "model": MODEL, "choices": [
        {"index": 0, "text": "a", "logprobs": None, "finish_reason": finish}]}).encode()


class StubInstance:
    """A vLLM instance with the connector, as the router sees it: the OpenAI API (both
    legs) and the connector's load endpoint, whose behaviour the request's prompt picks."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.behaviour: dict[str, str] = {}  # transfer id -> the prompt of its request
        self.asked: list[str] = []
        self.app = Starlette(routes=[Route("/v1/completions", self.complete, methods=["POST"]),
                                     Route("/kvxfer/loads/{transfer_id}", self.load, methods=["GET"])])

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        if not body.get("stream"):  # the prefill leg
            return JSONResponse({"id": "cmpl-p", "object": "text_completion", "created": 1, "model": MODEL,
                                 "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}})
        self.behaviour[body["kv_transfer_params"]["kvxfer"]["transfer_id"]] = body["prompt"]

        async def events() -> AsyncIterator[bytes]:
            yield b"data: " + _event(None) + b"\n\n"
            yield b"data: " + _event("length") + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def load(self, request: Request) -> Response:
        transfer_id = request.path_params["transfer_id"]
        self.asked.append(transfer_id)
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        behaviour = self.behaviour.get(transfer_id)
        if behaviour == "slow":
            await asyncio.sleep(SLOW_ENDPOINT_S)
        if behaviour == "fail":
            return JSONResponse({"error": "broken"}, status_code=500)
        return JSONResponse({"kvxfer": REPORT})


class Served:
    """The module's router and stub instance."""

    def __init__(self, host: ServerHost, key_file: Path) -> None:
        self.stub = StubInstance(vllm_api_key(load_cluster_key(key_file)))
        stub_url = host.serve(self.stub.app)
        directory = StaticWorkerDirectory([dict(
            worker_id=f"{role}-stub", role=role, http_url=stub_url, model=MODEL, kv_layout="stub",
            engine_address="00" * 8, engine="vllm", total_pages=1000, free_pages=1000,
            metrics_url=stub_url if role == "decode" else "") for role in ("prefill", "decode")])
        settings = RouterSettings(host="127.0.0.1", port=0, log_level="warning", max_retries=0,
                                  cluster_key_file=key_file, load_report_timeout_s=LOAD_REPORT_TIMEOUT_S)
        self.url = host.serve(create_app(settings, directory))
        self.client = httpx.Client(timeout=10, trust_env=False)

    def stream(self, prompt: str) -> list[str]:
        """The data lines of one streamed completion through the router."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            return [line for line in r.iter_lines() if line.startswith("data:")]

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the router's /metrics (0 when absent)."""
        text = self.client.get(self.url + "/metrics").text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    key_file = tmp_path_factory.mktemp("key") / "cluster.key"
    key_file.write_text(secrets.token_hex(32))
    host = ServerHost()
    try:
        s = Served(host, key_file)
        yield s
        s.client.close()
    finally:
        host.close()


def _figures(served: Served) -> tuple[float, float, float, float]:
    return (served.metric("kvxfer_router_request_kv_moved_bytes_count"),
            served.metric("kvxfer_router_request_kv_moved_bytes_sum"),
            served.metric("kvxfer_router_kv_pages_moved_total"),
            served.metric("kvxfer_router_kv_pages_not_sent_total"))


def test_a_streamed_requests_load_figures_are_fetched_after_done_and_counted(served: Served) -> None:
    before = _figures(served)
    lines = served.stream("ok")
    assert lines[-1] == "data: [DONE]" and len(lines) == 3
    expected = (before[0] + 1, before[1] + REPORT["bytes_loaded"], before[2] + REPORT["pages_loaded"],
                before[3] + REPORT["pages_held"])
    wait_until(lambda: _figures(served) == expected, timeout_s=COUNTED_TIMEOUT_S,
               what="the router's KV figures to move by the report")
    # The router asked with the transfer id it minted for the decode leg, and only once.
    (transfer_id,) = [t for t, prompt in served.stub.behaviour.items() if prompt == "ok"]
    assert served.stub.asked.count(transfer_id) == 1


@pytest.mark.parametrize(("prompt", "reason"), [("slow", "timeout"), ("fail", "refused")])
def test_a_slow_or_failing_load_endpoint_leaves_the_answer_whole_and_counts_a_failure(
        served: Served, prompt: str, reason: str) -> None:
    before = _figures(served)
    failures = served.metric("kvxfer_router_load_report_fetch_failures_total", reason=reason)
    lines = served.stream(prompt)
    assert lines[-1] == "data: [DONE]" and len(lines) == 3
    wait_until(lambda: served.metric("kvxfer_router_load_report_fetch_failures_total", reason=reason)
               == failures + 1, timeout_s=COUNTED_TIMEOUT_S, what=f"a {reason} failure counted")
    assert _figures(served) == before


def test_an_instance_whose_record_has_no_metrics_url_is_not_asked() -> None:
    # An older instance's record: no metrics_url, so no streamed figures and no call at all.
    settings = RouterSettings(load_report_timeout_s=LOAD_REPORT_TIMEOUT_S)
    fetcher = LoadReportFetcher(settings, RouterTelemetry(None), WorkerCallSigner(None),
                                VllmLegClient(4, settings.connect_timeout_s))
    old = WorkerView.from_record(dict(worker_id="decode-old", role="decode", http_url="http://127.0.0.1:9",
                                      model=MODEL, kv_layout="stub", engine="vllm"))

    async def after_stream() -> int:
        fetcher.after_stream(old, "kx-old")
        return fetcher.in_flight

    assert old.metrics_url == ""
    assert asyncio.run(after_stream()) == 0
