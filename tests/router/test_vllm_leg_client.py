"""The vLLM legs' own HTTP client (`kvxfer_router.vllm_http`): connections kept alive
between requests, a client leaving mid-stream closing the decode leg's connection (which
is how vLLM aborts the request), and a stream cut before `data: [DONE]` reaching the
client as an error event.

A real router process serves one prefill + decode pair (engine "vllm") whose two
instances are one stub vLLM instance in a thread of the test process: a raw asyncio HTTP/1.1
server that counts its connections and answers at once. The prompt picks its behaviour:
"hang" streams one event and then nothing, "cut" streams one event and ends the body.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from support.vllm_instances import free_port
from support.waiting import wait_until

MODEL = "stub"
ROUTER_START_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 30.0

_EVENT = json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 1, "model": MODEL, "choices": [
    {"index": 0, "text": "a", "logprobs": None, "finish_reason": None, "token_ids": [5]}], "usage": None}).encode()
_LAST = _EVENT.replace(b'"finish_reason": null', b'"finish_reason": "length"')
_ANSWER = json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 1, "model": MODEL, "choices": [
    {"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}}).encode()


@dataclass
class StubInstance:
    """A stub vLLM instance: its port and what it saw."""

    port: int = 0
    connections_opened: int = 0
    #: Streams of "hang" requests whose connection the router closed.
    hung_streams_closed: int = 0
    hung_streams: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve_connection(stub: StubInstance, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with stub.lock:
        stub.connections_opened += 1
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = json.loads(await reader.readexactly(length))
            if not body.get("stream"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(_ANSWER), _ANSWER))
                await writer.drain()
                continue
            hang = body["prompt"] == "hang"
            if hang:  # counted before its event leaves: the client may see the event first
                with stub.lock:
                    stub.hung_streams += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(_chunk(b"data: " + _EVENT + b"\n\n"))
            await writer.drain()
            if hang:
                await reader.read(1)  # b"" once the router closes the connection
                with stub.lock:
                    stub.hung_streams_closed += 1
                return
            if body["prompt"] == "cut":
                writer.write(b"0\r\n\r\n")  # the body ends without [DONE]
            else:
                writer.write(_chunk(b"data: " + _LAST + b"\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _start_stub() -> StubInstance:
    stub = StubInstance()
    ready = threading.Event()

    async def serve() -> None:
        server = await asyncio.start_server(lambda r, w: _serve_connection(stub, r, w), "127.0.0.1", 0)
        stub.port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await server.serve_forever()

    threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
    assert ready.wait(10), "the stub instance did not start"
    return stub


_ROUTER = """
import os
from kvxfer_router import StaticWorkerDirectory, RouterSettings, app
from kvxfer_router.cli import serve
url = os.environ["STUB_URL"]
workers = [dict(worker_id=f"{role}-stub", role=role, http_url=url, model="stub", kv_layout="stub",
                engine_address="00" * 8, engine="vllm", total_pages=1000, free_pages=1000)
           for role in ("prefill", "decode")]
settings = RouterSettings(host="127.0.0.1", port=int(os.environ["ROUTER_PORT"]), log_level="warning", max_retries=0)
serve(app.create_app(settings, StaticWorkerDirectory(workers)), None, settings)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, StubInstance]]:
    """(router URL, stub instance) for the module."""
    stub = _start_stub()
    port = free_port()
    env = {**os.environ, "STUB_URL": f"http://127.0.0.1:{stub.port}", "ROUTER_PORT": str(port)}
    env.pop("KVXFER_ROUTER_CLUSTER_KEY_FILE", None)
    log_path = Path(tmp_path_factory.mktemp("router")) / "router.log"
    with log_path.open("wb") as log:
        router = subprocess.Popen([sys.executable, "-c", _ROUTER], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(lambda: up() or router.poll() is not None, ROUTER_START_TIMEOUT_S, "the router's /health")
        assert router.poll() is None, log_path.read_text(errors="replace")
        yield url, stub
    finally:
        router.terminate()
        try:
            router.wait(20)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(10)


def _body(prompt: str) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}


def test_consecutive_requests_reuse_the_legs_kept_alive_connections(served: tuple[str, StubInstance]) -> None:
    url, stub = served
    requests = 10
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        before = stub.connections_opened
        for _ in range(requests):
            with client.stream("POST", url + "/v1/completions", json=_body("ok")) as r:
                assert r.status_code == 200, r.read()
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[0][6:])["id"].startswith("cmpl-") and "cmpl-stub" not in lines[0]
    # Two legs a request, twenty POSTs: one connection each would be twenty.
    assert stub.connections_opened - before <= 4, f"{stub.connections_opened - before} connections for " \
                                                   f"{2 * requests} legs"


def test_a_client_leaving_mid_stream_closes_the_decode_legs_connection(served: tuple[str, StubInstance]) -> None:
    url, stub = served
    closed_before, hung_before = stub.hung_streams_closed, stub.hung_streams
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        with client.stream("POST", url + "/v1/completions", json=_body("hang")) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line)
            assert first.startswith("data: {")
    assert stub.hung_streams == hung_before + 1
    # vLLM aborts a request when its connection closes: the router must close it.
    wait_until(lambda: stub.hung_streams_closed == closed_before + 1, 10,
               "the decode leg's connection closed after the client left")


def test_a_stream_cut_before_done_ends_with_an_error_event(served: tuple[str, StubInstance]) -> None:
    url, _stub = served
    started = time.monotonic()
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        with client.stream("POST", url + "/v1/completions", json=_body("cut")) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
    assert time.monotonic() - started < CLIENT_TIMEOUT_S
    assert lines[0].startswith("data: {") and "data: [DONE]" not in lines, lines
    error = json.loads(lines[-1][6:])["error"]
    assert "stream ended before [DONE]" in error["message"], error
