"""How the router maps a worker's error to the client: a worker refusing the request's own
content (400/422 on decode POST /reserve or POST /generate_local, e.g. a prompt longer than
the model's context) is the client's 400 and is not retried; a 5xx, 409/429 or a broken
connection is the worker's trouble and is retried on another pair. Also: the text a decode
worker's done line carries (the rest of an unfinished UTF-8 character) reaches the client.

Runs against the in-process fake workers of tests/fake_workers.py (real loopback HTTP).
"""

from __future__ import annotations

import json
import asyncio
from typing import Any, Iterator

import httpx
import pytest
from fastapi import HTTPException
from fastapi.responses import StreamingResponse

from support.fake_workers import MODEL, Fabric, FakeDecodeWorker, FakePrefillWorker, PrefillBody, ServerHost, WorkerMux

from kvxfer_router import RouterSettings, StaticWorkerDirectory, create_app

LONG_PROMPT = "The quick brown fox jumps over the lazy dog"  # disaggregated (>= 8 tokens)
SHORT_PROMPT = "hi"  # decode alone (POST /generate_local)

SETTINGS: dict[str, Any] = dict(
    policy="round_robin", disaggregation_min_prompt_tokens=8, max_retries=1, request_deadline_s=5.0,
    connect_timeout_s=1.0, control_timeout_s=2.0, prefill_timeout_s=3.0, kv_wait_timeout_s=2.0,
    first_token_timeout_s=3.0, token_idle_timeout_s=2.0, cancel_timeout_s=1.0, shutdown_timeout_s=2.0,
)


class TailDecodeWorker(FakeDecodeWorker):
    """Streams the byte tokens b"ok\xc3" as the real decode worker does: text per line
    decoded incrementally ("o", "k", "" for the lead byte), then the done line with the
    unfinished character's U+FFFD as its "text"."""

    def _token_stream(self, request_id: str, max_tokens: int, prompt_len: int) -> StreamingResponse:
        async def lines():
            for token, text in ((111, "o"), (107, "k"), (0xC3, "")):
                yield json.dumps({"token": token, "text": text}) + "\n"
            self.reservations.pop(request_id, None)
            usage = {"prompt_tokens": prompt_len, "completion_tokens": 3}
            yield json.dumps({"done": True, "finish_reason": "length", "text": "\ufffd", "usage": usage}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")


class Setup:
    """Two decode and two prefill fakes behind one router."""

    def __init__(self, host: ServerHost, mux: WorkerMux, mux_url: str, decode_cls: type = FakeDecodeWorker,
                 prefill_cls: type = FakePrefillWorker) -> None:
        self.host = host
        fabric = Fabric()
        directory = StaticWorkerDirectory()
        self.decoders = [decode_cls(f"d{i}", fabric) for i in (1, 2)]
        self.prefillers = [prefill_cls(f"p{i}", fabric) for i in (1, 2)]
        for w in [*self.decoders, *self.prefillers]:
            w.url = mux_url + mux.add(w.app)
            directory.put(w.record())
        self.app = create_app(RouterSettings(**SETTINGS), directory)
        self.url = host.serve(self.app)
        self.client = httpx.Client(timeout=10, trust_env=False)

    def post(self, prompt: str, **kw: Any) -> httpx.Response:
        return self.client.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, **kw})

    def calls(self, path: str) -> int:
        return sum(len(w.bodies(path)) for w in [*self.decoders, *self.prefillers])

    def retries(self) -> float:
        total = 0.0
        for line in self.client.get(self.url + "/metrics").text.splitlines():
            if line.startswith("kvxfer_router_retries_total{"):
                total += float(line.split()[-1])
        return total

    def close(self) -> None:
        self.client.close()
        self.host.stop(self.url)


@pytest.fixture
def setup(host: tuple[ServerHost, WorkerMux, str]) -> Iterator[Setup]:
    s = Setup(*host)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("status", [400, 422])
@pytest.mark.parametrize("stream", [False, True])
def test_reserve_refusing_the_request_is_a_400_without_retry(setup: Setup, status: int, stream: bool) -> None:
    for d in setup.decoders:
        d.reserve_status = status

    r = setup.post(LONG_PROMPT, stream=stream, request_id="too-long")

    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "rejected_by_worker"
    assert err["type"] == "invalid_request_error"
    assert err["request_id"] == "too-long"
    assert f"answered {status}: reserve refused for kx-" in err["message"]  # the id the router minted
    assert "rejected the request at reserve" in err["message"]
    # One worker asked, once: no retry on the other decode worker, no prefill started.
    assert setup.calls("/reserve") == 1
    assert setup.calls("/prefill") == 0 and setup.calls("/generate") == 0
    assert setup.retries() == 0
    assert r.headers["x-request-id"] == "too-long"


@pytest.mark.parametrize("status", [400, 422])
def test_generate_local_refusing_the_request_is_a_400_without_retry(setup: Setup, status: int) -> None:
    for d in setup.decoders:
        d.generate_status = status

    r = setup.post(SHORT_PROMPT, stream=True)

    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "rejected_by_worker"
    assert "rejected the request at generate" in err["message"]
    assert f"answered {status}: generate_local refused" in err["message"]
    assert setup.calls("/generate_local") == 1
    assert setup.retries() == 0


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_other_reserve_errors_are_retried_on_another_decode_worker(setup: Setup, status: int) -> None:
    first = setup.decoders[0]  # round robin starts here
    first.reserve_status = status

    r = setup.post(LONG_PROMPT)

    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello"
    assert len(first.bodies("/reserve")) == 1
    assert len(setup.decoders[1].bodies("/reserve")) == 1
    assert setup.retries() == 1


def test_generate_local_5xx_is_retried_on_another_decode_worker(setup: Setup) -> None:
    setup.decoders[0].generate_status = 500

    r = setup.post(SHORT_PROMPT)

    assert r.status_code == 200, r.text
    assert [len(d.bodies("/generate_local")) for d in setup.decoders] == [1, 1]
    assert setup.retries() == 1


def test_reserve_400_on_every_worker_after_5xx_still_ends_as_400(setup: Setup) -> None:
    # First attempt: a worker error (retried); second: the request itself is refused.
    setup.decoders[0].reserve_status = 503
    setup.decoders[1].reserve_status = 400

    r = setup.post(LONG_PROMPT)

    assert r.status_code == 400
    assert r.json()["error"]["code"] == "rejected_by_worker"
    assert [len(d.bodies("/reserve")) for d in setup.decoders] == [1, 1]


def test_a_normal_request_after_a_refusal_succeeds(setup: Setup) -> None:
    for d in setup.decoders:
        d.reserve_status = 400
    assert setup.post(LONG_PROMPT).status_code == 400
    for d in setup.decoders:
        d.reserve_status = None

    r = setup.post(LONG_PROMPT)

    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
    assert all(d.active_reservations() == [] for d in setup.decoders)


@pytest.mark.parametrize("prompt", [LONG_PROMPT, SHORT_PROMPT])
def test_done_line_text_is_the_end_of_the_completion(host: tuple[ServerHost, WorkerMux, str], prompt: str) -> None:
    s = Setup(*host, decode_cls=TailDecodeWorker)
    try:
        full = s.post(prompt, max_tokens=3)
        streamed = s.post(prompt, max_tokens=3, stream=True)
    finally:
        s.close()

    assert full.status_code == 200 and full.json()["choices"][0]["text"] == "ok\ufffd"
    assert streamed.status_code == 200
    events = [e[len("data: "):] for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    # One chunk per token, then the finish chunk carrying the done line's text.
    assert [(c["text"], c["finish_reason"]) for c in chunks] == [("o", None), ("k", None), ("", None),
                                                                  ("\ufffd", "length")]


class LateFailingPrefillWorker(FakePrefillWorker):
    """Pushes the KV (the decoder starts streaming), then fails its own reply: the worker
    died after its last write landed, before it answered /prefill."""

    reply_delay_s = 0.3

    async def _prefill(self, body: PrefillBody) -> dict[str, Any]:
        await super()._prefill(body)
        await asyncio.sleep(self.reply_delay_s)
        raise HTTPException(500, "prefill worker died before replying")


@pytest.mark.parametrize("stream", [True, False])
def test_a_prefill_reply_failing_after_the_decoder_began_its_output_does_not_cut_the_answer(
        host: tuple[ServerHost, WorkerMux, str], stream: bool) -> None:
    """The decoder emits output only once the prompt's KV landed; the prefill leg failing
    after that cannot change the answer, so the client gets it whole (no error event in a
    stream, no retry of a buffered answer)."""
    s = Setup(*host, prefill_cls=LateFailingPrefillWorker)
    try:
        for d in s.decoders:
            d.token_delay_s = 0.1  # streams while the prefill reply is still pending
        r = s.post(LONG_PROMPT, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), r.text
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
        else:
            text = r.json()["choices"][0]["text"]
        assert text == "hello"
        assert s.retries() == 0
    finally:
        s.close()
