"""Router specification: pair selection, admission, retries, cancellation and the OpenAI
surface, against in-process fake workers that follow the worker HTTP API contract."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from kvxfer_router import (
    EtcdWorkerDirectory,
    RouterSettings,
    StaticWorkerDirectory,
    WorkerView,
    create_app,
    make_policy,
)
from kvxfer_router.admin import create_admin_app
from kvxfer_router.cli import build_parser, settings_from_args
from kvxfer_router.policies import LocalLoad, WorkerPair, select_pair
from support.fake_workers import (
    LAYOUT_A,
    LAYOUT_B,
    MODEL,
    Fabric,
    FakeDecodeWorker,
    FakePrefillWorker,
    ServerHost,
    WorkerMux,
)
from support.waiting import wait_until

LONG_PROMPT = "The quick brown fox jumps over the lazy dog"  # disaggregated (>= 8 tokens)
SHORT_PROMPT = "hi"  # runs on decode alone
BOS = 256

TEST_SETTINGS: dict[str, Any] = dict(
    policy="round_robin",
    disaggregation_min_prompt_tokens=8,
    max_prompt_tokens=64,
    max_tokens_limit=100,
    request_deadline_s=5.0,
    connect_timeout_s=1.0,
    control_timeout_s=2.0,
    prefill_timeout_s=3.0,
    kv_wait_timeout_s=2.0,
    first_token_timeout_s=3.0,
    token_idle_timeout_s=2.0,
    cancel_timeout_s=1.0,
    shutdown_timeout_s=2.0,
)


class Cluster:
    """Fake workers plus a router on loopback, registered in a static directory."""

    def __init__(self, host: ServerHost, mux: WorkerMux, mux_url: str) -> None:
        self.host = host
        self.mux = mux
        self.mux_url = mux_url
        self.fabric = Fabric()
        self.directory = StaticWorkerDirectory()
        self.decoders: dict[str, FakeDecodeWorker] = {}
        self.prefillers: dict[str, FakePrefillWorker] = {}
        self.url = ""
        self.app: Any = None
        self.client = httpx.Client(timeout=10, trust_env=False)

    def _add(self, worker: Any, register: bool, record: dict[str, Any]) -> Any:
        worker.url = self.mux_url + self.mux.add(worker.app)
        if register:
            self.directory.put(worker.record(**record))
        return worker

    def decode(self, worker_id: str, register: bool = True, **record: Any) -> FakeDecodeWorker:
        kw = {k: record.pop(k) for k in ("model", "kv_layout") if k in record}
        w = self.decoders[worker_id] = FakeDecodeWorker(worker_id, self.fabric, **kw)
        return self._add(w, register, record)

    def prefill(self, worker_id: str, register: bool = True, **record: Any) -> FakePrefillWorker:
        kw = {k: record.pop(k) for k in ("model", "kv_layout") if k in record}
        w = self.prefillers[worker_id] = FakePrefillWorker(worker_id, self.fabric, **kw)
        return self._add(w, register, record)

    def start_router(self, **overrides: Any) -> None:
        settings = RouterSettings(**{**TEST_SETTINGS, **overrides})
        self.app = create_app(settings, self.directory)
        self.url = self.host.serve(self.app)

    def close(self) -> None:
        self.client.close()
        if self.url:
            self.host.stop(self.url)

    @property
    def service(self) -> Any:
        return self.app.state.router

    def post(self, body: Any, **kw: Any) -> httpx.Response:
        return self.client.post(self.url + "/v1/completions", json=body, **kw)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(self.url + path)

    def all_workers(self) -> list[Any]:
        return [*self.decoders.values(), *self.prefillers.values()]


@pytest.fixture
def cluster(host: tuple[ServerHost, WorkerMux, str]) -> Iterator[Cluster]:
    c = Cluster(*host)
    try:
        yield c
    finally:
        c.close()


def completion(prompt: str = LONG_PROMPT, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 5, **kw}


def minted(decode: Any) -> str:
    """The id the router minted for the (one) request a fake decode worker saw."""
    for path in ("/reserve", "/generate_local"):
        if decode.bodies(path):
            return str(decode.bodies(path)[0]["request_id"])
    raise AssertionError("the decode worker saw no request")


def raw_post(path: str, body: dict[str, Any]) -> bytes:
    """One HTTP/1.1 POST of ``body`` as JSON, as bytes for a socket the test closes itself."""
    content = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(content)}\r\n\r\n").encode() + content


def sse_events(text: str) -> list[str]:
    """The data payloads of a server-sent event stream, checking the framing."""
    assert text.endswith("\n\n"), text[-50:]
    events = text.split("\n\n")[:-1]
    for e in events:
        assert e.startswith("data: "), e
    return [e[len("data: "):] for e in events]


def metric(cluster: Cluster, sample: str) -> float:
    for line in cluster.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not exported")


# --- happy paths --------------------------------------------------------------------------


def test_streaming_completion_is_openai_sse_ending_in_done(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    cluster.start_router()

    r = cluster.post(completion(stream=True, request_id="req-1"))

    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"] == "req-1"
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-req-1" and c["model"] == MODEL for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    # The reservation the decode worker handed out is exactly what the prefill worker got.
    tokens = [BOS, *LONG_PROMPT.encode()]
    # Inside the cluster the request has an id the router minted, never the client's.
    wrid = d.bodies("/reserve")[0]["request_id"]
    assert re.fullmatch(r"kx-[0-9a-f]{32}", wrid)
    # It names the prefiller it chose: the decoder credits immediates only from that engine.
    assert d.bodies("/reserve") == [{"request_id": wrid, "prompt_tokens": tokens, "max_tokens": 5,
                                     "prefill_engine_address": p.engine_address}]
    assert d.bodies("/generate") == [{"request_id": wrid, "stream": True, "timeout_s": 2.0}]
    assert p.bodies("/prefill")[0]["request_id"] == wrid
    reservation = d.reserved[0]
    assert p.bodies("/prefill")[0]["decode"] == {"engine_address": d.engine_address, **reservation}
    assert p.bodies("/prefill")[0]["prompt_tokens"] == tokens
    assert d.active_reservations() == []
    assert d.cancelled_ids() == [] and p.cancelled_ids() == []


@pytest.mark.parametrize("stream", [True, False])
def test_the_router_reuses_its_connections_to_the_workers(cluster: Cluster, stream: bool) -> None:
    # The decode leg is a stream the router stops reading at its done line. Left with the
    # end of the body unread, httpx closed the connection: one new TCP connection per
    # request, and a socket in TIME-WAIT for a minute each (port exhaustion at a few
    # hundred requests per second to one worker).
    d = cluster.decode("d1")
    cluster.prefill("p1")
    cluster.start_router()
    requests = 8
    for _ in range(requests):
        assert cluster.post(completion(stream=stream)).status_code == 200
    prefix = d.url[len(cluster.mux_url):]
    ports = cluster.mux.client_ports[prefix]
    assert len(ports) == 2 * requests  # /reserve and /generate each time
    # The two legs of a request overlap (/prefill and /generate), so the pool may hold a
    # few connections; one per request would be 8 or more.
    assert len(set(ports)) <= 3, f"{len(set(ports))} connections for {requests} requests"


def test_stream_options_include_usage_adds_a_usage_chunk(cluster: Cluster) -> None:
    cluster.decode("d1")
    cluster.prefill("p1")
    cluster.start_router()

    r = cluster.post(completion(stream=True, stream_options={"include_usage": True}))

    events = sse_events(r.text)
    usage_chunk = json.loads(events[-2])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": len(LONG_PROMPT) + 1, "completion_tokens": 5, "total_tokens": len(LONG_PROMPT) + 6}


def test_non_streaming_completion_returns_text_and_usage(cluster: Cluster) -> None:
    cluster.decode("d1")
    cluster.prefill("p1")
    cluster.start_router()

    r = cluster.post(completion(max_tokens=50))

    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "hello world", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["completion_tokens"] == 11
    assert body["id"].startswith("cmpl-") and r.headers["x-request-id"] in body["id"]


def test_chat_completion_on_kvxfer_workers_sends_the_rendered_messages(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    cluster.prefill("p1")
    cluster.start_router()
    messages = [{"role": "user", "content": LONG_PROMPT}]

    r = cluster.client.post(cluster.url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": messages, "max_tokens": 50})
    streamed = cluster.client.post(cluster.url + "/v1/chat/completions",
                                   json={"model": MODEL, "messages": messages, "max_tokens": 50, "stream": True})

    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello world"}
    rendered = f"user: {LONG_PROMPT}\nassistant: "
    assert d.bodies("/reserve")[0]["prompt_tokens"] == [BOS, *rendered.encode()]
    chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "hello world"


def test_short_prompt_skips_disaggregation_and_runs_on_decode_alone(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    cluster.start_router()

    r = cluster.post(completion(SHORT_PROMPT, request_id="short"))

    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
    assert d.paths() == ["/generate_local"]
    wrid = d.bodies("/generate_local")[0]["request_id"]
    assert wrid != "short" and wrid.startswith("kx-")
    assert d.bodies("/generate_local") == [
        {"request_id": wrid, "prompt_tokens": [BOS, *SHORT_PROMPT.encode()], "max_tokens": 5, "stream": True}
    ]
    assert p.paths() == []


# --- failures, retry and cancellation -----------------------------------------------------


def test_failed_prefill_is_retried_once_on_another_pair(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p1 = cluster.prefill("p1")
    p2 = cluster.prefill("p2")
    p1.status = 500
    cluster.start_router()

    r = cluster.post(completion(request_id="r1"))

    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
    [first] = [b["request_id"] for b in p1.bodies("/prefill")]
    [second] = [b["request_id"] for b in p2.bodies("/prefill")]
    # Each attempt has its own minted id.
    assert first.startswith("kx-") and second.startswith("kx-") and first != second
    # The failed attempt was cancelled on both workers and its pages freed.
    wait_until(lambda: d.cancelled_ids() == [first] and p1.cancelled_ids() == [first], what="cancels")
    # The prefiller answered in_flight false: the router tells the decoder, which then
    # reuses the fenced pages at once instead of at its fence deadline.
    wait_until(lambda: d.released_ids() == [first], what="prefill_stopped relayed to the decoder")
    assert d.active_reservations() == []
    assert metric(cluster, 'kvxfer_router_retries_total{stage="prefill"}') == 1.0


def test_retry_happens_only_once(cluster: Cluster) -> None:
    cluster.decode("d1")
    for name in ("p1", "p2", "p3"):
        cluster.prefill(name).status = 500
    cluster.start_router()

    r = cluster.post(completion(request_id="twice"))

    assert r.status_code == 502
    err = r.json()["error"]
    assert err["request_id"] == "twice" and "twice" in err["message"] and "after a retry" in err["message"]
    assert sorted(len(p.bodies("/prefill")) for p in cluster.prefillers.values()) == [0, 1, 1]
    assert metric(cluster, 'kvxfer_router_retries_total{stage="prefill"}') == 1.0


def test_reserve_failure_is_retried_on_another_decode_worker(cluster: Cluster) -> None:
    d1 = cluster.decode("d1")
    d2 = cluster.decode("d2")
    cluster.prefill("p1")
    d1.reserve_status = 507
    cluster.start_router()

    r = cluster.post(completion(request_id="res"))

    assert r.status_code == 200
    assert d1.paths()[0] == "/reserve" and "/generate" not in d1.paths()
    assert d2.paths() == ["/reserve", "/generate"]
    assert metric(cluster, 'kvxfer_router_retries_total{stage="reserve"}') == 1.0


def test_decode_stream_breaking_before_first_token_is_retried(cluster: Cluster) -> None:
    d1 = cluster.decode("d1")
    d2 = cluster.decode("d2")
    p = cluster.prefill("p1")
    d1.break_after_tokens = 0
    cluster.start_router()

    r = cluster.post(completion(stream=True, request_id="brk"))

    assert r.status_code == 200
    assert "".join(json.loads(e)["choices"][0]["text"] for e in sse_events(r.text)[:-1]) == "hello"
    first = d1.bodies("/generate")[0]["request_id"]
    assert d2.bodies("/generate")[0]["request_id"] not in (first, "brk")
    wait_until(lambda: d1.cancelled_ids() == [first] and first in p.cancelled_ids(), what="cancels")
    assert metric(cluster, 'kvxfer_router_retries_total{stage="generate"}') == 1.0


def test_decode_stream_breaking_after_first_token_ends_stream_with_error_and_cancels_both(cluster: Cluster) -> None:
    d1 = cluster.decode("d1")
    d2 = cluster.decode("d2")
    p = cluster.prefill("p1")
    d1.break_after_tokens = 2
    cluster.start_router()

    r = cluster.post(completion(stream=True, request_id="mid"))

    assert r.status_code == 200
    events = sse_events(r.text)
    assert "[DONE]" not in events
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["h", "e"]
    error = json.loads(events[-1])["error"]
    assert error["request_id"] == "mid" and error["code"] == "worker_failed"
    wait_until(lambda: d1.cancelled_ids() == [minted(d1)] and p.cancelled_ids() == [minted(d1)], what="cancels")
    assert d2.paths() == []  # tokens already sent: no retry
    assert metric(cluster, 'kvxfer_router_retries_total{stage="generate"}') == 0.0


def test_error_done_line_from_decode_is_a_failure_not_a_completion(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    d.fail_generation = True
    d.output = ""  # fails before any token: retried, and with no other decode worker -> 502
    cluster.prefill("p1")
    cluster.start_router()

    r = cluster.post(completion(request_id="errline"))

    assert r.status_code == 502
    assert "fake generation failure" in r.json()["error"]["message"]
    wait_until(lambda: d.cancelled_ids() == [minted(d)], what="decode cancel")


def test_prefill_failure_without_alternative_cancels_decode_and_frees_its_pages(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    p.status = 500
    cluster.start_router(colocated_fallback=False)

    r = cluster.post(completion(request_id="solo"))

    assert r.status_code == 502
    assert r.json()["error"]["code"] == "worker_failed"
    assert "prefill worker p1" in r.json()["error"]["message"]
    wait_until(lambda: d.cancelled_ids() == [minted(d)] and p.cancelled_ids() == [minted(d)], what="cancels")
    assert d.active_reservations() == []
    assert cluster.service.admission.in_flight == 0


def test_no_prefill_worker_serves_colocated_on_decode_then_disaggregates_again(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    cluster.start_router()

    alone = cluster.post(completion(request_id="alone"))

    assert cluster.get("/ready").status_code == 200  # a decode worker alone can serve
    assert alone.status_code == 200, alone.text
    assert alone.headers["x-kvxfer-serving-mode"] == "colocated_fallback"
    assert [path for path, _ in d.calls] == ["/generate_local"]
    assert metric(cluster, 'kvxfer_router_colocated_fallbacks_total{reason="no_prefiller"}') == 1.0
    # A short prompt is decode-only by design, not a fallback.
    short = cluster.post(completion(SHORT_PROMPT))
    assert short.headers["x-kvxfer-serving-mode"] == "decode_only"
    assert metric(cluster, 'kvxfer_router_colocated_fallbacks_total{reason="no_prefiller"}') == 1.0

    p = cluster.prefill("p1")
    back = cluster.post(completion(request_id="back"))

    assert back.status_code == 200 and back.headers["x-kvxfer-serving-mode"] == "disaggregated"
    assert len(p.bodies("/prefill")) == 1
    assert alone.json()["choices"][0]["text"] == back.json()["choices"][0]["text"]


def test_failing_prefill_worker_falls_back_to_colocated_and_frees_the_reservation(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    p.status = 500
    cluster.start_router()

    r = cluster.post(completion(request_id="solo", stream=True))

    assert r.status_code == 200, r.text
    assert r.headers["x-kvxfer-serving-mode"] == "colocated_fallback"
    assert sse_events(r.text)[-1] == "[DONE]"
    assert metric(cluster, 'kvxfer_router_colocated_fallbacks_total{reason="prefill_failed"}') == 1.0
    reserved = str(d.bodies("/reserve")[0]["request_id"])
    wait_until(lambda: d.cancelled_ids() == [reserved], what="the failed attempt's reservation cancelled")
    assert d.active_reservations() == []
    assert [path for path, _ in d.calls if path.startswith("/generate")] == ["/generate", "/generate_local"]


def test_unreachable_prefill_worker_frees_the_decode_pages_at_once(cluster: Cluster) -> None:
    # A dead prefiller still registered (its lease not yet expired) refuses connections: it
    # never got the /prefill, so nothing of the reservation can land and the decode worker
    # is told to free the pages now rather than fence them.
    d = cluster.decode("d1")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    cluster.prefill("p-dead", http_url=dead_url)
    cluster.start_router()

    r = cluster.post(completion(request_id="to-the-dead"))

    assert r.status_code == 200 and r.headers["x-kvxfer-serving-mode"] == "colocated_fallback", r.text
    reserved = str(d.bodies("/reserve")[0]["request_id"])
    wait_until(lambda: d.released_ids() == [reserved], what="the reservation released, not fenced")
    assert d.cancelled_ids() == []
    assert d.active_reservations() == []


def test_slow_prefill_runs_into_the_deadline_with_504_and_both_legs_cancelled(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    p.delay_s = 3.0
    cluster.start_router(request_deadline_s=0.5)

    r = cluster.post(completion(request_id="slow"))

    assert r.status_code == 504
    assert r.json()["error"]["code"] == "deadline_exceeded" and r.json()["error"]["request_id"] == "slow"
    wait_until(lambda: d.cancelled_ids() == [minted(d)] and p.cancelled_ids() == [minted(d)], what="cancels")
    assert d.active_reservations() == []
    assert metric(cluster, 'kvxfer_router_requests_total{status="timeout"}') == 1.0


def test_deadline_passing_mid_stream_ends_it_with_an_error_event_and_cancels_both(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    d.token_delay_s = 0.25
    cluster.start_router(request_deadline_s=0.6)

    r = cluster.post(completion(stream=True, max_tokens=50, request_id="late"))

    events = sse_events(r.text)
    assert r.status_code == 200 and "[DONE]" not in events and len(events) >= 2
    assert json.loads(events[-1])["error"]["code"] == "deadline_exceeded"
    wait_until(lambda: d.cancelled_ids() == [minted(d)] and p.cancelled_ids() == [minted(d)], what="cancels")
    assert d.active_reservations() == []


def test_client_disconnect_mid_stream_cancels_both_legs(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    d.token_delay_s = 0.2
    cluster.start_router()

    with cluster.client.stream("POST", cluster.url + "/v1/completions",
                               json=completion(stream=True, max_tokens=50, request_id="gone")) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # Leaving the block closed the connection halfway through the stream.

    wait_until(lambda: d.cancelled_ids() == [minted(d)] and p.cancelled_ids() == [minted(d)], what="cancels")
    assert d.active_reservations() == []
    wait_until(lambda: cluster.service.admission.in_flight == 0, what="slot released")
    assert metric(cluster, 'kvxfer_router_requests_total{status="cancelled"}') == 1.0


def test_client_disconnect_before_first_token_cancels_both_legs(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    p = cluster.prefill("p1")
    p.delay_s = 10.0  # cut short by the cancel
    cluster.start_router()

    # The client leaves once both legs are running (the prefiller has the reservation), not
    # after a fixed delay: a loaded machine may not have reached the decoder in that time.
    with socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1]))) as conn:
        conn.sendall(raw_post("/v1/completions", completion(request_id="early")))
        wait_until(lambda: p.bodies("/prefill"), what="the prefill leg to start")
        assert not d.cancelled_ids()

    wait_until(lambda: d.cancelled_ids() == [minted(d)] and p.cancelled_ids() == [minted(d)], what="cancels")
    assert d.active_reservations() == []
    wait_until(lambda: cluster.service.admission.in_flight == 0, what="slot released")
    # Cancelled for the disconnect, not ended later by the request's deadline.
    assert metric(cluster, 'kvxfer_router_requests_total{status="cancelled"}') == 1.0


# --- admission ----------------------------------------------------------------------------


def test_full_router_answers_429_with_retry_after_and_recovers(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    cluster.prefill("p1")
    d.token_delay_s = 0.1
    cluster.start_router(max_in_flight=1, retry_after_s=3)

    with cluster.client.stream("POST", cluster.url + "/v1/completions",
                               json=completion(stream=True, request_id="holder")) as held:
        lines = held.iter_lines()
        next(lines)
        r = cluster.post(completion(request_id="extra"))
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["request_id"] == "extra"
        for _ in lines:
            pass

    wait_until(lambda: cluster.service.admission.in_flight == 0, what="slot released")
    assert cluster.post(completion()).status_code == 200
    assert metric(cluster, 'kvxfer_router_rejected_requests_total{code="429"}') == 1.0


def test_a_worker_of_an_engine_without_a_leg_type_gets_nothing_and_the_client_a_clear_502(
        cluster: Cluster) -> None:
    d = cluster.decode("d1", engine="sglang")
    cluster.start_router()

    r = cluster.post(completion(SHORT_PROMPT, request_id="odd"))

    assert r.status_code == 502
    assert r.json()["error"]["code"] == "unknown_engine"
    assert "no leg type for engine 'sglang'" in r.json()["error"]["message"]
    assert d.paths() == []


def test_no_compatible_pair_answers_503_and_router_is_not_ready(cluster: Cluster) -> None:
    cluster.decode("d1")
    cluster.start_router(colocated_fallback=False)

    r = cluster.post(completion(request_id="nopair"))

    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_worker_pair"
    assert cluster.get("/ready").status_code == 503
    # A short prompt needs no prefill worker.
    assert cluster.post(completion(SHORT_PROMPT)).status_code == 200

    cluster.prefill("p1")
    assert cluster.get("/ready").status_code == 200
    assert cluster.post(completion()).status_code == 200


def test_incompatible_kv_layout_is_never_paired(cluster: Cluster) -> None:
    d = cluster.decode("d1", kv_layout=LAYOUT_A)
    p_b = cluster.prefill("p-b", kv_layout=LAYOUT_B)
    cluster.start_router(colocated_fallback=False)

    assert cluster.get("/ready").status_code == 503
    assert cluster.post(completion()).status_code == 503

    p_a = cluster.prefill("p-a", kv_layout=LAYOUT_A)
    for _ in range(4):
        assert cluster.post(completion()).status_code == 200
    assert p_b.paths() == []
    assert len(p_a.bodies("/prefill")) == 4 and len(d.bodies("/generate")) == 4


def test_other_model_workers_are_never_paired(cluster: Cluster) -> None:
    cluster.decode("d1")
    other = cluster.prefill("p-other", model="other-model")
    cluster.start_router(colocated_fallback=False)

    assert cluster.post(completion()).status_code == 503
    assert other.paths() == []


def test_draining_worker_gets_no_new_requests(cluster: Cluster) -> None:
    d_drain = cluster.decode("d1", draining=True)
    d_ok = cluster.decode("d2")
    p_drain = cluster.prefill("p1", draining=True)
    p_ok = cluster.prefill("p2")
    cluster.start_router()

    for _ in range(3):
        assert cluster.post(completion()).status_code == 200
    assert cluster.post(completion(SHORT_PROMPT)).status_code == 200

    assert d_drain.paths() == [] and p_drain.paths() == []
    assert len(d_ok.bodies("/generate")) == 3 and len(p_ok.bodies("/prefill")) == 3


def test_duplicate_request_id_in_flight_is_refused_with_409(cluster: Cluster) -> None:
    d = cluster.decode("d1")
    cluster.prefill("p1")
    d.token_delay_s = 0.1
    cluster.start_router()

    with cluster.client.stream("POST", cluster.url + "/v1/completions",
                               json=completion(stream=True, request_id="dup")) as held:
        lines = held.iter_lines()
        next(lines)
        r = cluster.post(completion(request_id="dup"))
        for _ in lines:
            pass

    assert r.status_code == 409 and r.json()["error"]["param"] == "request_id"


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, "invalid_json"),
        (b"[1, 2]", 400, None, "invalid_json"),
        ({"prompt": LONG_PROMPT}, 400, "model", "invalid_value"),
        ({"model": "no-such-model", "prompt": LONG_PROMPT}, 404, "model", "model_not_found"),
        ({"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": -3}, 400, "max_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 101}, 400, "max_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
        ({"model": MODEL, "prompt": "x" * 64}, 400, "prompt", "context_length_exceeded"),
        ({"model": MODEL, "prompt": LONG_PROMPT, "stream": "yes"}, 400, "stream", "invalid_value"),
        ({"model": MODEL, "prompt": LONG_PROMPT, "request_id": "bad id/"}, 400, "request_id", "invalid_value"),
    ],
)
def test_invalid_request_gets_openai_4xx_and_disturbs_nothing(
    cluster: Cluster, body: Any, status: int, param: str | None, code: str
) -> None:
    cluster.decode("d1")
    cluster.prefill("p1")
    cluster.start_router()

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = cluster.client.post(cluster.url + "/v1/completions", content=content,
                            headers={"content-type": "application/json", "x-request-id": "hdr-7"})

    assert r.status_code == status
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["request_id"] == "hdr-7" and error["message"].startswith("request hdr-7: ")
    assert all(w.paths() == [] for w in cluster.all_workers())
    assert cluster.service.admission.in_flight == 0
    assert cluster.post(completion()).status_code == 200


def test_oversized_body_is_refused_with_413(cluster: Cluster) -> None:
    cluster.decode("d1")
    cluster.prefill("p1")
    cluster.start_router(max_request_bytes=2048)

    r = cluster.post(completion("x" * 4096))

    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# --- informational endpoints --------------------------------------------------------------


def test_health_models_workers_and_metrics_endpoints(cluster: Cluster) -> None:
    cluster.decode("d1")
    cluster.prefill("p1", draining=True)
    cluster.start_router()

    assert cluster.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in cluster.get("/v1/models").json()["data"]] == [MODEL]
    # The worker inventory (engine addresses) is internal: not on the public port...
    assert cluster.get("/workers").status_code == 404
    # ...but on the admin app.
    admin_url = cluster.host.serve(create_admin_app(cluster.service))
    try:
        workers = cluster.client.get(admin_url + "/workers").json()
    finally:
        cluster.host.stop(admin_url)
    assert {w["worker_id"]: w["draining"] for w in workers["workers"]} == {"d1": False, "p1": True}
    assert workers["in_flight"] == 0 and workers["policy"] == "round_robin"
    assert metric(cluster, 'kvxfer_router_workers{role="prefill",state="draining"}') == 1.0
    assert metric(cluster, 'kvxfer_router_workers{role="decode",state="ready"}') == 1.0


# --- pair selection (no network) ---------------------------------------------------------


def view(worker_id: str, role: str, **kw: Any) -> WorkerView:
    base = dict(worker_id=worker_id, role=role, http_url=f"http://{worker_id}", model=MODEL, kv_layout=LAYOUT_A,
                total_pages=64, free_pages=64)
    return WorkerView(**{**base, **kw})  # type: ignore[arg-type]


def test_least_loaded_picks_decode_by_running_batch_then_free_pages_and_prefill_by_queue() -> None:
    directory = StaticWorkerDirectory([
        view("d-busy", "decode", running=5, free_pages=60),
        view("d-full", "decode", running=0, free_pages=0),
        view("d-few-pages", "decode", running=1, free_pages=10),
        view("d-best", "decode", running=1, free_pages=50),
        view("p-queued", "prefill", queue_depth=3),
        view("p-idle", "prefill", queue_depth=0),
    ])
    pair = select_pair(directory, MODEL, needs_prefill=True, policy=make_policy("least_loaded"), load=LocalLoad())
    assert pair is not None
    assert (pair.decode.worker_id, pair.prefill.worker_id if pair.prefill else None) == ("d-best", "p-idle")


def test_least_loaded_counts_the_routers_own_in_flight_requests() -> None:
    directory = StaticWorkerDirectory([view("d1", "decode"), view("d2", "decode"), view("p1", "prefill"), view("p2", "prefill")])
    policy, load = make_policy("least_loaded"), LocalLoad()
    chosen = []
    for _ in range(4):
        pair = select_pair(directory, MODEL, needs_prefill=True, policy=policy, load=load)
        assert pair is not None
        load.acquire(pair)
        chosen.append(pair.worker_ids)
    assert chosen == [("d1", "p1"), ("d2", "p2"), ("d1", "p1"), ("d2", "p2")]


def test_round_robin_cycles_through_eligible_workers() -> None:
    directory = StaticWorkerDirectory([view("d1", "decode"), view("d2", "decode"), view("p1", "prefill")])
    policy = make_policy("round_robin")
    picks = [select_pair(directory, MODEL, needs_prefill=True, policy=policy, load=LocalLoad()) for _ in range(3)]
    assert [p.decode.worker_id for p in picks if p] == ["d1", "d2", "d1"]


def test_selection_skips_excluded_draining_and_incompatible_workers() -> None:
    directory = StaticWorkerDirectory([
        view("d-bad-layout", "decode", kv_layout=LAYOUT_B),
        view("d-draining", "decode", draining=True),
        view("d-excluded", "decode"),
        view("d-ok", "decode"),
        view("p1", "prefill"),
    ])
    pair = select_pair(directory, MODEL, needs_prefill=True, policy=make_policy("least_loaded"), load=LocalLoad(),
                       exclude={"d-excluded"})
    assert pair == WorkerPair(directory.workers("decode")[3], directory.workers("prefill")[0])
    assert select_pair(directory, MODEL, needs_prefill=True, policy=make_policy("least_loaded"), load=LocalLoad(),
                       exclude={"d-ok", "d-excluded"}) is None


def test_unknown_policy_name_fails_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="least_loaded, round_robin"):
        make_policy("random")


# --- directory adapter and settings -------------------------------------------------------


def test_etcd_directory_adapts_watcher_records_and_skips_unreadable_ones() -> None:
    class Record:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

        def model_dump(self) -> dict[str, Any]:
            return dict(self.__dict__)

    good = Record(worker_id="d1", role="decode", http_url="http://d1", engine_address="ab01", model=MODEL,
                  kv_layout=LAYOUT_A, total_pages=8, free_pages=4, queue_depth=0, running=1, draining=False,
                  updated_at=1.0)
    broken = Record(worker_id="d2", role="decode")

    class Watcher:
        def workers(self, role: str | None = None) -> list[Any]:
            return [good, broken]

    directory = EtcdWorkerDirectory(Watcher())
    views = directory.workers("decode")

    assert [(v.worker_id, v.free_pages, v.layout_key) for v in views] == [("d1", 4, LAYOUT_A)]
    assert directory.workers("decode")[0] is views[0]  # unchanged record: cached view


def test_etcd_directory_reads_real_registry_records() -> None:
    registry = pytest.importorskip("kvxfer.registry")
    record = registry.WorkerRecord(worker_id="p1", role="prefill", http_url="http://p1", engine_address="ab01",
                                   model=MODEL, kv_layout=LAYOUT_A, total_pages=8, queue_depth=2)

    class Watcher:
        def workers(self, role: str | None = None) -> list[Any]:
            return [record]

    (view_,) = EtcdWorkerDirectory(Watcher()).workers("prefill")
    assert (view_.worker_id, view_.queue_depth, view_.kv_layout, view_.draining) == ("p1", 2, LAYOUT_A, False)


def test_object_kv_layouts_compare_by_content_not_key_order() -> None:
    a = view("d1", "decode", kv_layout={"block_size": 16, "num_layers": 2})
    b = view("p1", "prefill", kv_layout={"num_layers": 2, "block_size": 16})
    assert a.layout_key == b.layout_key


def test_settings_read_environment_and_flags_override_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_ROUTER_MAX_IN_FLIGHT", "7")
    monkeypatch.setenv("KVXFER_ROUTER_MODEL_MAX_PROMPT_TOKENS", '{"m": 9}')
    assert RouterSettings().max_in_flight == 7 and RouterSettings().prompt_limit("m") == 9

    args = build_parser().parse_args(["--max-in-flight", "3", "--policy", "round_robin"])
    settings = settings_from_args(args)
    assert (settings.max_in_flight, settings.policy, settings.prompt_limit("m")) == (3, "round_robin", 9)


def test_file_settings_take_paths_on_the_command_line() -> None:
    # Path-valued settings (certificates, the cluster key) once got the JSON-object flag type.
    args = build_parser().parse_args(["--etcd-ca-file", "/run/etcd/ca.crt", "--cluster-key-file", "/run/key"])
    settings = settings_from_args(args)
    assert (settings.etcd_ca_file, settings.cluster_key_file) == (Path("/run/etcd/ca.crt"), Path("/run/key"))


def test_settings_reject_inconsistent_timeouts() -> None:
    with pytest.raises(ValueError, match="first_token_timeout_s"):
        RouterSettings(kv_wait_timeout_s=10, first_token_timeout_s=5)


def test_cli_help_documents_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer_router.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])

    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    missing = [n for n in RouterSettings.model_fields if f"--{n.replace('_', '-')}" not in out]
    assert missing == [] and "KVXFER_ROUTER_REQUEST_DEADLINE_S" in out
