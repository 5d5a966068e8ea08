"""The router under overload and faults (issue 28): shedding is a counted 429 with
Retry-After, never a 5xx or an orphaned reservation; a non-streamed answer survives its
decoder failing mid-generation; a completed request's id is free at once; slow-header
connections are cut at `header_timeout_s`; and event-loop shedding reacts to the loop's own
work, not to a busy host.

Runs against the in-process fake workers of tests/support/fake_workers.py (real loopback
HTTP, one event loop shared by the fakes and the router under test).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import pytest
import uvicorn
from kvxfer_router import RouterSettings, StaticWorkerDirectory, create_app
from kvxfer_router.cli import public_server_config
from support.fake_workers import (
    MODEL,
    Fabric,
    FakeDecodeWorker,
    FakePrefillWorker,
    PrefillBody,
    ReserveBody,
    ServerHost,
    WorkerMux,
)
from support.waiting import wait_until

LONG_PROMPT = "The quick brown fox jumps over the lazy dog"  # disaggregated (>= 8 tokens)
SHORT_PROMPT = "hi"  # decode alone (POST /generate_local)

SETTINGS: dict[str, Any] = dict(
    policy="least_loaded", disaggregation_min_prompt_tokens=8, max_retries=1, request_deadline_s=5.0,
    connect_timeout_s=1.0, control_timeout_s=0.5, prefill_timeout_s=3.0, kv_wait_timeout_s=2.0,
    first_token_timeout_s=3.0, token_idle_timeout_s=2.0, cancel_timeout_s=1.0, shutdown_timeout_s=2.0,
    retry_after_s=2,
)


class SlowReserveDecoder(FakeDecodeWorker):
    """Answers /reserve only after `reserve_delay_s` (a decoder whose HTTP side is starved):
    the reservation is made then, whether or not the caller still waits."""

    reserve_delay_s = 0.0

    async def _reserve(self, body: ReserveBody) -> dict[str, Any]:
        await asyncio.sleep(self.reserve_delay_s)
        return await super()._reserve(body)


class LateReplyPrefill(FakePrefillWorker):
    """Pushes the KV at once but answers /prefill `reply_delay_s` later (a real prefiller
    answers once its push's tail is acknowledged): the client has its answer first."""

    reply_delay_s = 0.0

    async def _prefill(self, body: PrefillBody) -> dict[str, Any]:
        reply = await super()._prefill(body)
        await asyncio.sleep(self.reply_delay_s)
        return reply


class Setup:
    """Fake workers and a router on loopback; `start` serves the router as the CLI does."""

    def __init__(self, host: ServerHost, mux: WorkerMux, mux_url: str) -> None:
        self.host, self.mux, self.mux_url = host, mux, mux_url
        self.fabric = Fabric()
        self.directory = StaticWorkerDirectory()
        self.client = httpx.Client(timeout=10, trust_env=False)
        self.url = ""
        self.app: Any = None
        self._server: tuple[uvicorn.Server, Any] | None = None

    def add(self, cls: type, worker_id: str, **record: Any) -> Any:
        worker = cls(worker_id, self.fabric)
        worker.url = self.mux_url + self.mux.add(worker.app)
        self.directory.put(worker.record(**record))
        return worker

    def start(self, **overrides: Any) -> None:
        """Serves a router with `overrides` through `public_server_config` (header timeout
        included) on the shared loop."""
        settings = RouterSettings(**{**SETTINGS, "log_level": "critical", **overrides})
        self.app = create_app(settings, self.directory)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(public_server_config(self.app, settings))
        done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.host.loop)
        self._server = (server, done)
        wait_until(lambda: server.started or done.done(), 10, "router start")
        assert not done.done(), done.result()

    def close(self) -> None:
        self.client.close()
        if self._server is not None:
            server, done = self._server
            server.should_exit = True
            done.result(15)

    def post(self, prompt: str = LONG_PROMPT, **kw: Any) -> httpx.Response:
        return self.client.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                    "max_tokens": 5, **kw})

    def metric(self, sample: str) -> float:
        for line in self.client.get(self.url + "/metrics").text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{sample} not exported")

    @property
    def service(self) -> Any:
        return self.app.state.router


@pytest.fixture
def setup(host: tuple[ServerHost, WorkerMux, str]) -> Iterator[Setup]:
    s = Setup(*host)
    try:
        yield s
    finally:
        s.close()


def worker_ids(decode: FakeDecodeWorker) -> list[str]:
    """The ids the router minted for its /reserve calls to `decode`."""
    return [b["request_id"] for b in decode.bodies("/reserve")]


# --- overload: a 429, never a 5xx or an orphan -------------------------------------------


def test_reserve_too_slow_everywhere_is_a_429_and_every_late_reservation_is_freed(setup: Setup) -> None:
    slow = [setup.add(SlowReserveDecoder, f"d{i}") for i in (1, 2)]
    for d in slow:
        d.reserve_delay_s = 1.0  # control_timeout_s is 0.5
    prefill = setup.add(FakePrefillWorker, "p1")
    setup.start()

    r = setup.post(request_id="starved")

    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "workers_overloaded"
    # Each decoder was told to free its reservation at once (no prefiller ever had it).
    # That the real decoder then frees a reservation completing after the cancel is
    # tests/workers/test_decode_control_hardening.py's to show (these fakes do not).
    for d in slow:
        wait_until(lambda d=d: d.released_ids() == worker_ids(d) != [], 5, f"{d.worker_id} told to release")
    assert prefill.paths() == []
    assert setup.metric('kvxfer_router_requests_total{status="rejected"}') == 1.0
    assert setup.metric('kvxfer_router_requests_total{status="error"}') == 0.0


def test_a_deadline_passing_while_reserving_is_a_429_and_the_reservation_is_freed(setup: Setup) -> None:
    d = setup.add(SlowReserveDecoder, "d1")
    d.reserve_delay_s = 1.0
    setup.add(FakePrefillWorker, "p1")
    setup.start(request_deadline_s=0.4, control_timeout_s=2.0)

    r = setup.post(request_id="never-reserved")

    assert r.status_code == 429 and "retry-after" in r.headers, r.text
    wait_until(lambda: d.released_ids() == worker_ids(d) != [], 5, "told to release")
    assert setup.metric('kvxfer_router_requests_total{status="rejected"}') == 1.0


def test_a_429_from_the_per_worker_cap_counts_as_rejected_not_error(setup: Setup) -> None:
    d = setup.add(FakeDecodeWorker, "d1")
    setup.add(FakePrefillWorker, "p1")
    d.token_delay_s = 0.1
    setup.start(max_in_flight_per_worker=1)

    with setup.client.stream("POST", setup.url + "/v1/completions",
                             json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 5, "stream": True}) as held:
        lines = held.iter_lines()
        next(lines)
        r = setup.post(request_id="over-cap")
        for _ in lines:
            pass

    assert r.status_code == 429 and r.json()["error"]["code"] == "workers_overloaded"
    wait_until(lambda: setup.service.admission.in_flight == 0, 5, "slots released")
    assert setup.metric('kvxfer_router_requests_total{status="rejected"}') == 1.0
    assert setup.metric('kvxfer_router_requests_total{status="error"}') == 0.0
    assert setup.metric('kvxfer_router_rejected_requests_total{code="429"}') == 1.0


# --- faults --------------------------------------------------------------------------------


def test_a_non_streamed_request_whose_decoder_dies_mid_generation_is_answered_by_another_pair(setup: Setup) -> None:
    dying = setup.add(FakeDecodeWorker, "d1")
    healthy = setup.add(FakeDecodeWorker, "d2", running=5)  # least_loaded tries d1 first
    setup.add(FakePrefillWorker, "p1")
    dying.break_after_tokens = 3
    setup.start()

    r = setup.post(request_id="whole")

    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello"  # the healthy decoder's 5 tokens, none of the first try's
    assert len(dying.bodies("/generate")) == 1 and len(healthy.bodies("/generate")) == 1
    assert setup.metric('kvxfer_router_retries_total{stage="generate"}') == 1.0


def test_a_streamed_request_still_ends_with_an_error_after_its_first_tokens(setup: Setup) -> None:
    dying = setup.add(FakeDecodeWorker, "d1")
    setup.add(FakeDecodeWorker, "d2", running=5)
    setup.add(FakePrefillWorker, "p1")
    dying.break_after_tokens = 3
    setup.start()

    r = setup.post(request_id="streamed", stream=True)

    assert r.status_code == 200 and '"error"' in r.text and "[DONE]" not in r.text


def test_a_completed_request_id_can_be_used_again_at_once(setup: Setup) -> None:
    setup.add(FakeDecodeWorker, "d1")
    prefill = setup.add(LateReplyPrefill, "p1")
    prefill.reply_delay_s = 1.0  # the router still waits for it after the answer went out
    setup.start()

    first = setup.post(request_id="reused")
    again = setup.post(request_id="reused")

    assert first.status_code == 200, first.text
    assert again.status_code == 200, again.text


# --- the public port ---------------------------------------------------------------------


def read_until_closed(sock: socket.socket, trickle: bytes, pause_s: float, limit_s: float) -> tuple[bytes, float]:
    """Sends `trickle` every `pause_s` until the peer closes (or `limit_s` passes); what the
    peer sent and when (monotonic) it closed."""
    sock.settimeout(pause_s)
    received = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            try:
                sock.sendall(trickle)
            except OSError:
                return received, time.monotonic()
            continue
        except OSError:
            return received, time.monotonic()
        if not chunk:
            return received, time.monotonic()
        received += chunk
    raise AssertionError(f"connection still open after {limit_s} s; received {received!r}")


def test_a_slow_header_connection_is_closed_at_header_timeout_s(setup: Setup) -> None:
    setup.add(FakeDecodeWorker, "d1")
    setup.start(header_timeout_s=1.0)
    port = int(setup.url.rsplit(":", 1)[1])

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        opened = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")
        received, closed = read_until_closed(sock, b"X-Slow: 1\r\n", 0.2, 10)
    assert received.startswith(b"HTTP/1.1 408"), received
    assert 1.0 <= closed - opened < 3.0, closed - opened

    # A kept-alive connection: its first request is served, its slow second one cut.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        sock.settimeout(5)
        answer = b""
        while not answer.endswith(b"}"):  # the head and the JSON body may come apart
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        received, closed = read_until_closed(sock, b"X-Slow: 1\r\n", 0.2, 10)
    assert received.startswith(b"HTTP/1.1 408"), received
    assert 1.0 <= closed - started < 3.0, closed - started
    # A prompt client is unaffected.
    assert setup.client.get(setup.url + "/health").status_code == 200


# --- event-loop lag ------------------------------------------------------------------------


def probes_during(setup: Setup, stall: Callable[[float], None], stall_s: float, seconds: float) -> list[int]:
    """Statuses of short requests sent one after another for `seconds` while the router's
    loop is stalled by `stall(stall_s)` again and again, with one request held in flight."""
    loop = setup.host.loop
    end = time.monotonic() + seconds

    def again() -> None:
        stall(stall_s)
        if time.monotonic() < end:
            loop.call_later(0.05, again)

    holder = threading.Thread(target=lambda: _quietly(lambda: httpx.post(
        setup.url + "/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 5},
        timeout=httpx.Timeout(seconds + 5, read=seconds + 1), trust_env=False)), daemon=True)
    holder.start()
    wait_until(lambda: setup.service.admission.in_flight == 1, 5, "a request in flight")
    loop.call_soon_threadsafe(again)
    statuses = []
    while time.monotonic() < end:
        statuses.append(setup.post(SHORT_PROMPT, max_tokens=1).status_code)
    holder.join(seconds + 10)
    return statuses


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except httpx.HTTPError:
        pass


def spin(seconds: float) -> None:
    """The loop's own work: a callback that computes for `seconds`."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def test_a_busy_host_with_an_idle_loop_sheds_nothing(setup: Setup) -> None:
    # A stalled thread that burns no CPU is what a busy host looks like from inside: the
    # loop's timers fire late although the loop had nothing to do.
    setup.add(FakeDecodeWorker, "d1")
    prefill = setup.add(FakePrefillWorker, "p1")
    prefill.delay_s = 4.0  # holds the first request in flight
    setup.start(admission_max_loop_lag_s=0.1, prefill_timeout_s=10, first_token_timeout_s=10,
                kv_wait_timeout_s=10, request_deadline_s=10)

    statuses = probes_during(setup, time.sleep, 0.4, 2.5)

    assert len(statuses) >= 3 and set(statuses) == {200}, statuses


def test_the_loops_own_work_still_sheds(setup: Setup) -> None:
    setup.add(FakeDecodeWorker, "d1")
    prefill = setup.add(FakePrefillWorker, "p1")
    prefill.delay_s = 4.0
    setup.start(admission_max_loop_lag_s=0.1, prefill_timeout_s=10, first_token_timeout_s=10,
                kv_wait_timeout_s=10, request_deadline_s=10)

    statuses = probes_during(setup, spin, 0.4, 2.5)

    assert 429 in statuses, statuses
