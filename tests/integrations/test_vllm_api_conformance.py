"""The OpenAI API as vLLM serves it, through kvxfer's router: one set of requests sent to
colocated vLLM and through the router in front of a vLLM prefill + decode pair, compared
field by field (structure, greedy text and token ids, logprobs within one bf16 step,
usage, finish reasons, ids, error statuses and bodies), streamed and not, on both
endpoints and with the `openai` client.

The colocated reference is the decode instance answering alone, without a hand-off (its
own cache salt, so no prefix cache is shared): the same instance and configuration that
answers through the router, which then computes on KV the prefill instance pushed.
Through the router the same body gets another salt, so the decoder's prefix cache never
stands in for the transfer. The pair is the one
test_vllm_connector.py uses (tests/integrations/conftest.py).
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_instances import SharedConnectorFleet, VllmFleet  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
REFERENCE = "decode-a"  # the colocated reference (see the module's docs)
MAX_MODEL_LEN = 4096  # VllmInstanceSpec's default, the context both instances serve
# One bf16 step at these magnitudes (|logprob| < 16): 2**-8 relative, 0.0625 absolute at most.
LOGPROB_TOLERANCE = 0.0625
REQUEST_TIMEOUT_S = 120.0
# Fields that differ between any two answers of plain vLLM too.
UNCOMPARED = ("id", "created")
PROMPT = "The license grants permission to copy and distribute verbatim copies of this document. " * 2
TOKEN_PROMPT = [3 + (i * 104729) % 1900 for i in range(90)]  # over the prefiller's 64-token chunk


@pytest.fixture(scope="module")
def fleet(shared_vllm_pair: SharedConnectorFleet) -> VllmFleet:
    return shared_vllm_pair.fleet()


@pytest.fixture(scope="module")
def router(shared_vllm_pair: SharedConnectorFleet) -> str:
    return shared_vllm_pair.router_url()


# ---- sending one request both ways ----------------------------------------------------------

def _path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _salted(body: dict[str, Any], who: str) -> dict[str, Any]:
    return {"model": MODEL, **body, "cache_salt": f"{who}-{uuid.uuid4().hex}"}


def _answer(resp: httpx.Response) -> Any:
    """A non-streamed body, or the list of a stream's events (objects, then "[DONE]")."""
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        return resp.json()
    events: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _send(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[httpx.Response, Any]:
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=REQUEST_TIMEOUT_S) as resp:
        resp.read()
        return resp, _answer(resp)


def both(fleet: VllmFleet, router: str, body: dict[str, Any]) -> tuple[tuple[httpx.Response, Any],
                                                                         tuple[httpx.Response, Any]]:
    """(colocated (response, answer), routed (response, answer)) for one body."""
    path = _path(body)
    colocated = _send(fleet.instances[REFERENCE].url, path, _salted(body, "ref"), fleet.headers)
    routed = _send(router, path, _salted(body, "rt"), {})
    return colocated, routed


# ---- comparing field by field ---------------------------------------------------------------

def assert_conforms(ref: Any, got: Any, where: str = "") -> None:
    """Same structure and values; floats (logprobs) within one bf16 step; ids and
    timestamps not compared."""
    if isinstance(ref, dict):
        assert isinstance(got, dict) and set(got) == set(ref), f"{where}: keys {sorted(got)} != {sorted(ref)}"
        for key, value in ref.items():
            if key not in UNCOMPARED:
                assert_conforms(value, got[key], f"{where}.{key}")
    elif isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref), f"{where}: {got!r:.200} != {ref!r:.200}"
        if where.endswith("top_logprobs") and ref and all(isinstance(x, dict) and "token" in x for x in ref):
            # Chat's alternatives are sorted by logprob: a tie within a bf16 step may swap two.
            ref, got = sorted(ref, key=lambda x: x["token"]), sorted(got, key=lambda x: x["token"])
        for i, (r, g) in enumerate(zip(ref, got)):
            assert_conforms(r, g, f"{where}[{i}]")
    elif isinstance(ref, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)), f"{where}: {got!r} != {ref!r}"
        both_inf = math.isinf(ref) and ref == got
        assert both_inf or abs(got - ref) <= LOGPROB_TOLERANCE, f"{where}: {got} != {ref}"
    else:
        assert got == ref, f"{where}: {got!r:.300} != {ref!r:.300}"


def assert_ids(resp: httpx.Response, answer: Any, chat: bool) -> None:
    """The answer's ids are the client-facing one, with one prefix (never cmpl-chatcmpl-)."""
    prefix = "chatcmpl-" if chat else "cmpl-"
    rid = resp.headers["x-request-id"]
    want = rid if rid.startswith(prefix) else prefix + rid
    for obj in answer if isinstance(answer, list) else [answer]:
        if isinstance(obj, dict):
            assert obj["id"] == want and not obj["id"].startswith("cmpl-chatcmpl"), obj["id"]


def assert_served_like_colocated(fleet: VllmFleet, router: str, body: dict[str, Any],
                                 mode: str = "disaggregated") -> Any:
    (ref_resp, ref), (resp, got) = both(fleet, router, body)
    assert ref_resp.status_code == 200, ref_resp.text
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvxfer-serving-mode"] == mode
    assert_conforms(ref, got, _path(body))
    assert_ids(resp, got, chat="messages" in body)
    return got


# ---- completions and chat, streamed and not -------------------------------------------------

GREEDY = {"temperature": 0, "return_token_ids": True}

CONFORMING = {
    "string prompt, logprobs": {"prompt": PROMPT, "max_tokens": 6, "logprobs": 3, **GREEDY},
    "token-id prompt": {"prompt": TOKEN_PROMPT, "max_tokens": 5, "logprobs": 2, **GREEDY},
    "list of one string": {"prompt": [PROMPT], "max_tokens": 4, **GREEDY},
    "default max_tokens (completions: 16)": {"prompt": PROMPT, "ignore_eos": True, **GREEDY},
    "min_tokens, stop_token_ids, seed": {"prompt": PROMPT, "max_tokens": 6, "min_tokens": 4, "seed": 3,
                                         "stop_token_ids": [5], **GREEDY},
    "chat, logprobs": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "logprobs": True,
                       "top_logprobs": 3, **GREEDY},
    "chat, content parts": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": PROMPT}, {"type": "text", "text": "Why?"}]}], "max_tokens": 5, **GREEDY},
    "chat, tools passed on": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "tool_choice": "none",
                              "tools": [{"type": "function", "function": {
                                  "name": "lookup", "parameters": {"type": "object", "properties": {}}}}], **GREEDY},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(CONFORMING))
def test_a_request_through_the_router_is_answered_as_colocated_vllm_answers_it(
        fleet: VllmFleet, router: str, name: str, stream: bool) -> None:
    body = {**CONFORMING[name], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    got = assert_served_like_colocated(fleet, router, body)
    if name.startswith("default max_tokens"):
        usage = got["usage"] if not stream else next(e for e in got if isinstance(e, dict) and e.get("usage"))["usage"]
        assert usage["completion_tokens"] == 16


def test_prompt_batches_and_prompt_logprobs_are_served_on_the_decoder_alone(fleet: VllmFleet, router: str) -> None:
    # A batch is one vLLM request per prompt, and prompt logprobs need the prompt computed
    # where the answer is made: the decode instance computes these itself, exactly.
    assert_served_like_colocated(fleet, router, {"prompt": [PROMPT, "Another prompt"], "max_tokens": 3, **GREEDY},
                                 mode="decode_only")
    assert_served_like_colocated(fleet, router, {"prompt": TOKEN_PROMPT, "max_tokens": 3, "prompt_logprobs": 2,
                                                 **GREEDY}, mode="decode_only")
    assert_served_like_colocated(fleet, router, {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1,
                                                 **GREEDY}, mode="decode_only")


def _chat_near_the_context(fleet: VllmFleet, room: int) -> list[dict[str, Any]]:
    """Messages whose templated prompt leaves between `room` and twice `room` tokens of the
    context (a default max_tokens of "up to the context" stays short to generate)."""
    url = fleet.instances[REFERENCE].url + "/tokenize"

    def count(text: str) -> int:
        r = httpx.post(url, headers=fleet.headers, timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": text}], "add_generation_prompt": True})
        assert r.status_code == 200, r.text
        return int(r.json()["count"])

    words = PROMPT.split()
    text = " ".join(words * (MAX_MODEL_LEN // len(words)))
    while (n := count(text)) > MAX_MODEL_LEN - room:
        text = text.rsplit(" ", max(1, (n - MAX_MODEL_LEN + room) // 2))[0]
    while count(text) < MAX_MODEL_LEN - 2 * room:
        text += " copies"
    return [{"role": "user", "content": text}]


def test_chat_without_max_tokens_generates_up_to_the_context_as_vllm_does(fleet: VllmFleet, router: str) -> None:
    # Before: the router sent 16 as max_tokens (and refused more than 2048).
    messages = _chat_near_the_context(fleet, room=24)
    for stream in (False, True):
        body: dict[str, Any] = {"messages": messages, "ignore_eos": True, "stream": stream, **GREEDY}
        if stream:
            body["stream_options"] = {"include_usage": True}
        got = assert_served_like_colocated(fleet, router, body)
        answer = got if not stream else next(e for e in got if isinstance(e, dict) and e.get("usage"))
        usage = answer["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
        assert usage["completion_tokens"] > 16


# ---- n > 1: one transfer serves every choice --------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_4_is_four_choices_from_one_transfer(fleet: VllmFleet, router: str, chat: bool, stream: bool) -> None:
    # Before: a 504 after 30 s (non-streamed) or the first choice then an error event: vLLM's
    # children each reserved for the one transfer, and all but one waited for KV.
    body: dict[str, Any] = {"max_tokens": 5, "n": 4, "temperature": 0.8, "seed": 7, "ignore_eos": True,
                            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    body.update({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})
    (ref_resp, ref), (resp, got) = both(fleet, router, body)
    assert ref_resp.status_code == 200 and resp.status_code == 200, resp.text
    assert resp.headers["x-kvxfer-serving-mode"] == "disaggregated"
    assert_ids(resp, got, chat)
    if stream:
        # Sampled text may differ within a bf16 step of the logits: the shape must not.
        assert got[-1] == "[DONE]" and ref[-1] == "[DONE]"
        chunks = [e for e in got[:-1] if e["choices"]]
        assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}
        assert [e for e in got[:-1] if not e["choices"]][-1]["usage"] == \
            [e for e in ref[:-1] if not e["choices"]][-1]["usage"]
        ends = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert ends == ["length"] * 4
    else:
        assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
        assert [c["finish_reason"] for c in got["choices"]] == ["length"] * 4
        assert got["usage"] == ref["usage"] and got["usage"]["completion_tokens"] == 20
        assert set(got["choices"][0]) == set(ref["choices"][0])


# ---- errors: vLLM's status and body --------------------------------------------------------

VLLM_REFUSALS = {
    "n 2 with greedy sampling": {"prompt": PROMPT, "n": 2, "temperature": 0},
    "min_tokens over max_tokens": {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 5},
    "max_tokens over the context": {"prompt": PROMPT, "max_tokens": 100_000},
    "prompt over the context": {"prompt": [7] * (MAX_MODEL_LEN + 10), "max_tokens": 2},
    "no prompt": {"max_tokens": 2},
    "prompt_logprobs with streaming": {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True},
    "streamed, min_tokens over max_tokens": {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 5, "stream": True},
    "auto tool choice without a parser": {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
                                          "tools": [{"type": "function", "function": {"name": "f"}}]},
}


@pytest.mark.parametrize("name", list(VLLM_REFUSALS))
def test_a_request_vllm_refuses_gets_vllms_status_and_error_body(fleet: VllmFleet, router: str, name: str) -> None:
    # Before: the router's own 400s (no list prompts, max_tokens <= 2048) or vLLM's JSON
    # wrapped in a string, without its param.
    (ref_resp, ref), (resp, got) = both(fleet, router, VLLM_REFUSALS[name])
    assert ref_resp.status_code >= 400, ref_resp.text
    assert resp.status_code == ref_resp.status_code, resp.text
    assert got == ref


def test_temperature_nan_gets_vllms_400(fleet: VllmFleet, router: str) -> None:
    raw = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": NaN}'
    headers = {"content-type": "application/json"}
    ref = httpx.post(fleet.instances[REFERENCE].url + "/v1/completions", content=raw,
                     headers={**fleet.headers, **headers}, timeout=REQUEST_TIMEOUT_S)
    got = httpx.post(router + "/v1/completions", content=raw, headers=headers, timeout=REQUEST_TIMEOUT_S)
    assert ref.status_code == got.status_code == 400
    assert got.json() == ref.json() and got.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize(("name", "raw", "headers"), [
    ("text/plain body", b'{"model": "tiny", "prompt": "hi"}', {"content-type": "text/plain"}),
    ("unknown model", b'{"model": "nope", "prompt": "hi"}', {"content-type": "application/json"}),
    ("not JSON", b'{"model": ', {"content-type": "application/json"}),
])
def test_the_routers_own_refusals_have_vllms_status_and_error_shape(fleet: VllmFleet, router: str, name: str,
                                                                     raw: bytes, headers: dict[str, str]) -> None:
    ref = httpx.post(fleet.instances[REFERENCE].url + "/v1/completions", content=raw,
                     headers={**fleet.headers, **headers}, timeout=REQUEST_TIMEOUT_S)
    got = httpx.post(router + "/v1/completions", content=raw, headers=headers, timeout=REQUEST_TIMEOUT_S)
    assert got.status_code == ref.status_code, (got.text, ref.text)
    error = got.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert error["param"] == ref.json()["error"]["param"] or name != "unknown model"


# ---- the openai client -----------------------------------------------------------------------

def test_the_openai_client_gets_the_same_answers_through_the_router(fleet: VllmFleet, router: str) -> None:
    openai = pytest.importorskip("openai")
    plain = openai.OpenAI(base_url=fleet.instances[REFERENCE].url + "/v1", api_key=fleet.api_key,
                          timeout=REQUEST_TIMEOUT_S, max_retries=0)
    routed = openai.OpenAI(base_url=router + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def salt(who: str) -> dict[str, Any]:
        return {"cache_salt": f"{who}-{uuid.uuid4().hex}", "return_token_ids": True}

    for call in ("completion", "chat"):
        for stream in (False, True):
            answers = []
            for client, who in ((plain, "ref"), (routed, "rt")):
                if call == "completion":
                    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                                    logprobs=2, stream=stream, extra_body=salt(who))
                else:
                    out = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5, temperature=0,
                        logprobs=True, top_logprobs=2, stream=stream, extra_body=salt(who))
                answers.append([c.model_dump() for c in out] if stream else out.model_dump())
            ref, got = answers
            assert_conforms(ref, got, f"{call} stream={stream}")
    with pytest.raises(openai.BadRequestError) as refused:
        routed.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    assert refused.value.status_code == 400 and "max_tokens" in str(refused.value)
