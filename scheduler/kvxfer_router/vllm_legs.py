"""A request's two legs on vLLM instances that run the kvxfer connector.

The decoder reserves first, inside vLLM: the router sends both legs at once, each with
`kv_transfer_params = {"kvxfer": {role, transfer_id, peer_engine}}`. The decode instance
parks the request, reserves blocks and sends the reservation to the prefill instance over
the kvxfer engine (no HTTP call between the two); the prefill instance computes the
prompt (`max_tokens` 1) and pushes each layer as it goes; the decoder admits on its
ImmCounter and streams. The router only relays the decode instance's event stream, as
token events, so streaming, deadlines, retries before the first token and cancelling both
legs on a disconnect work as for kvxfer's own workers.

`transfer_id` is minted here for every attempt: no client-chosen id reaches the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from typing import TYPE_CHECKING, Any

from .openai_api import usage_from

if TYPE_CHECKING:
    from .directory import WorkerView
    from .dispatch import RequestLifecycle

#: Body fields a client may not set: the router fills them for each leg.
RESERVED_FIELDS = ("kv_transfer_params",)


def _paths(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def leg_bodies(body: dict[str, Any], kind: str, transfer_id: str, decode: WorkerView | None,
               prefill: WorkerView | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(prefill body or None, decode body) for one attempt."""
    decode_body = copy.deepcopy(body)
    decode_body["stream"] = True
    decode_body["stream_options"] = {"include_usage": True}
    if prefill is None or decode is None:
        decode_body.pop("kv_transfer_params", None)
        return None, decode_body
    decode_body["kv_transfer_params"] = {"kvxfer": {
        "role": "decode", "transfer_id": transfer_id, "peer_engine": prefill.engine_address}}
    prefill_body = copy.deepcopy(body)
    prefill_body.update(stream=False, max_tokens=1)
    prefill_body.pop("stream_options", None)
    if kind == "chat":
        prefill_body.pop("max_completion_tokens", None)
    prefill_body["kv_transfer_params"] = {"kvxfer": {
        "role": "prefill", "transfer_id": transfer_id, "peer_engine": decode.engine_address}}
    return prefill_body, decode_body


async def run_vllm_legs(lc: RequestLifecycle, decode: WorkerView, prefill: WorkerView | None,
                        attempt_id: str) -> None:
    """Run one attempt; raises LegFailure like the kvxfer legs do."""
    from .dispatch import LegFailure, RequestState

    job = lc.job
    assert job.body is not None
    transfer_id = attempt_id  # minted by the router for this attempt (worker_auth.mint_worker_request_id)
    prefill_body, decode_body = leg_bodies(job.body, job.kind, transfer_id, decode, prefill)
    path = _paths(job.kind)
    d = lc._d
    s = d.settings
    lc.state = RequestState.TRANSFERRING if prefill_body else RequestState.GENERATING
    prefill_leg: asyncio.Future[Any] | None = None
    if prefill is not None and prefill_body is not None:
        prefill_leg = asyncio.ensure_future(d.post_json(
            prefill, path, prefill_body, stage="prefill", request_id=attempt_id,
            total_timeout_s=s.prefill_timeout_s))
    decode_leg = asyncio.ensure_future(_relay_stream(lc, decode, path, decode_body, attempt_id))
    legs = [leg for leg in (prefill_leg, decode_leg) if leg is not None]
    try:
        await asyncio.wait(legs, return_when=asyncio.FIRST_EXCEPTION)
        if decode_leg.done() and decode_leg.exception() is None:
            return
        failed = prefill_leg if prefill_leg is not None and prefill_leg.done() and prefill_leg.exception() \
            else decode_leg
        exc = failed.exception()
        assert exc is not None
        if not isinstance(exc, LegFailure):
            raise exc
        raise exc
    finally:
        # Closing the decode stream aborts the request in vLLM; the connector then cancels
        # the push and frees the blocks only once no write can land.
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)


def _is_sse_done(line: str) -> bool:
    """Whether a line of vLLM's server-sent events is its last (``data: [DONE]``)."""
    return line.startswith("data:") and line[5:].strip() == "[DONE]"


async def _relay_stream(lc: RequestLifecycle, decode: WorkerView, path: str, body: dict[str, Any],
                        attempt_id: str) -> None:
    """Relay vLLM's server-sent events as the lifecycle's token and finish events."""
    from .dispatch import LegFailure, _detail, stream_object

    stage = "generate"
    chat = lc.job.kind == "chat"
    usage: dict[str, Any] | None = None
    finish: str | None = None
    tokens = 0
    stream = lc._d.stream_lines(decode, path, body, stage=stage, request_id=attempt_id,
                                rejected_statuses=(400, 422), end_marker="[DONE]", is_last=_is_sse_done)
    async with contextlib.aclosing(stream) as lines:
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if finish == "abort" and tokens == 0:
                    # vLLM refuses a request that arrives while it drains (SIGTERM) this way;
                    # nothing reached the client, so the attempt may be retried elsewhere.
                    raise LegFailure(attempt_id, decode, stage, "the instance aborted the request before its "
                                     "first token (draining?)")
                lc._finish({"finish_reason": finish or "stop", "usage": usage})
                return
            chunk = stream_object(data, attempt_id, decode, stage, "event")
            if "error" in chunk:
                raise LegFailure(attempt_id, decode, stage, f"generation failed: {_detail(json.dumps(chunk))}")
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    tokens += 1
                    lc._token(-1, str(text))
                if choice.get("finish_reason"):
                    finish = str(choice["finish_reason"])


__all__ = ["RESERVED_FIELDS", "leg_bodies", "run_vllm_legs", "usage_from"]
