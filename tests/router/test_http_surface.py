"""The router's public HTTP surface under hostile input: bodies are counted as they stream
in, half-sent requests time out, every bad body is a 4xx in OpenAI's error shape, and the
OpenAPI document describes the completions request.

A real uvicorn router on loopback, spoken to with raw sockets where httpx would not send
what an attacker sends (a chunked body with no end, a body cut short).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Iterator

import httpx
import pytest

from kvxfer_router import RouterSettings, StaticWorkerDirectory, create_app
from support.fake_workers import MODEL, Fabric, FakeDecodeWorker, FakePrefillWorker, ServerHost, WorkerMux

MAX_BODY = 64 * 1024
BODY_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    host = ServerHost()
    mux = WorkerMux()
    mux_url = host.serve(mux)
    fabric = Fabric()
    directory = StaticWorkerDirectory()
    for worker in (FakeDecodeWorker("d1", fabric), FakePrefillWorker("p1", fabric)):
        worker.url = mux_url + mux.add(worker.app)
        directory.put(worker.record())
    settings = RouterSettings(max_request_bytes=MAX_BODY, request_body_timeout_s=BODY_TIMEOUT_S,
                              disaggregation_min_prompt_tokens=8)
    url = host.serve(create_app(settings, directory))
    try:
        yield url
    finally:
        host.close()


def _connect(url: str) -> socket.socket:
    hostport = url.removeprefix("http://")
    host, port = hostport.split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _read_status(sock: socket.socket, timeout_s: float) -> tuple[int, bytes]:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    return resp.json()["error"]


def test_a_chunked_body_is_refused_once_it_passes_the_limit_not_after_it_is_buffered(router: str) -> None:
    # Before: the body was read whole and only then measured; a 1 GiB chunked body took
    # the router to 2.1 GB. Now the 413 comes while the client is still sending.
    sock = _connect(router)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 16384
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sent = 0
        status = None
        sock.settimeout(0.05)
        for _ in range(4096):  # up to 64 MiB, far past the 64 KiB limit
            try:
                sock.sendall(chunk)
                sent += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                peek = sock.recv(65536, socket.MSG_PEEK)
            except (socket.timeout, BlockingIOError):
                continue
            if peek:
                break
        status, body = _read_status(sock, 5)
    finally:
        sock.close()
    assert status == 413, status
    assert sent < 16 * MAX_BODY, f"router let {sent} bytes in before refusing a {MAX_BODY}-byte limit"


def test_a_half_sent_body_gets_408_within_the_body_timeout(router: str) -> None:
    sock = _connect(router)
    try:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        status, _ = _read_status(sock, 10 * BODY_TIMEOUT_S + 5)
        waited = time.monotonic() - start
    finally:
        sock.close()
    assert status == 408
    assert waited < BODY_TIMEOUT_S + 3, f"a half-sent request was held {waited:.1f} s"


@pytest.mark.parametrize(("name", "raw", "code"), [
    ("lone surrogate in the prompt", b'{"model": "%s", "prompt": "abc\\ud800def"}' % MODEL.encode(), "invalid_value"),
    ("lone surrogate in the model", b'{"model": "x\\udfff", "prompt": "hi"}', "invalid_value"),
    ("deeply nested JSON", b"[" * 20_000 + b"]" * 20_000, "invalid_json"),
    ("deeply nested object", b'{"model": ' + b"{\"a\": " * 5_000 + b"1" + b"}" * 5_001, "invalid_json"),
])
def test_hostile_bodies_get_an_openai_style_400_not_a_500(router: str, name: str, raw: bytes, code: str) -> None:
    resp = httpx.post(router + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                      timeout=10)
    assert resp.status_code == 400, f"{name}: {resp.status_code} {resp.text[:200]}"
    assert _error(resp)["code"] == code, resp.text


def test_the_router_still_serves_after_hostile_bodies(router: str) -> None:
    resp = httpx.post(router + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=10)
    assert resp.status_code == 200, resp.text


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def test_openapi_describes_the_completions_request_and_every_ref_resolves(router: str) -> None:
    doc = httpx.get(router + "/openapi.json", timeout=5).json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["required"] is True
    ref = body["content"]["application/json"]["schema"]["$ref"]
    schemas = doc["components"]["schemas"]
    request_schema = schemas[ref.rsplit("/", 1)[1]]
    assert {"model", "prompt", "max_tokens", "stream"} <= set(request_schema["properties"])
    assert set(request_schema.get("required", [])) >= {"model", "prompt"}
    for r in _refs(doc):
        assert r.startswith("#/components/schemas/") and r.rsplit("/", 1)[1] in schemas, f"dangling $ref {r}"
    responses = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "413", "408", "429"} <= set(responses)
    json.dumps(doc)


# ---- n, temperature and content type, as vLLM validates them ------------------------------

@pytest.mark.parametrize(("name", "raw", "param", "message"), [
    ("n: 1000", b'{"model": "%s", "prompt": "hi", "n": 1000}' % MODEL.encode(), "n",
     "n must be 1 when using greedy sampling, got 1000."),
    ("n: 0", b'{"model": "%s", "prompt": "hi", "n": 0}' % MODEL.encode(), "n", "n must be at least 1, got 0."),
    ("temperature: NaN", b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(), "temperature",
     "temperature must be a finite number, got nan."),
    ("temperature: -1", b'{"model": "%s", "prompt": "hi", "temperature": -1}' % MODEL.encode(), "temperature",
     "temperature must be non-negative, got -1."),
    ("temperature: Infinity", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
     b'"temperature": Infinity}' % MODEL.encode(), "temperature", "temperature must be a finite number, got inf."),
])
def test_n_and_temperature_are_refused_as_vllm_refuses_them(router: str, name: str, raw: bytes, param: str,
                                                             message: str) -> None:
    # Before: n 1000 was answered with one choice and a NaN temperature was accepted.
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    resp = httpx.post(router + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
    assert resp.status_code == 400, f"{name}: {resp.status_code} {resp.text[:200]}"
    error = _error(resp)
    assert error["param"] == param and error["message"].endswith(message), error
    assert set(error) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_a_body_not_declared_json_is_refused_as_vllm_refuses_it(router: str, content_type: str | None) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}).encode()
    headers = {"content-type": content_type} if content_type else {}
    resp = httpx.post(router + "/v1/completions", content=body, headers=headers, timeout=10)
    assert resp.status_code == 400, resp.text
    assert _error(resp)["message"].endswith("Unsupported Media Type: Only 'application/json' is allowed")
    # A charset parameter is still JSON.
    resp = httpx.post(router + "/v1/completions", content=body,
                      headers={"content-type": "application/json; charset=utf-8"}, timeout=10)
    assert resp.status_code == 200, resp.text


def test_chat_ids_read_chatcmpl_once(router: str) -> None:
    # Before: "cmpl-chatcmpl-...".
    resp = httpx.post(router + "/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["id"].startswith("chatcmpl-") and not resp.json()["id"].startswith("chatcmpl-chatcmpl")
    resp = httpx.post(router + "/v1/chat/completions", timeout=10, headers={"x-request-id": "mine-1"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert resp.json()["id"] == "chatcmpl-mine-1"
