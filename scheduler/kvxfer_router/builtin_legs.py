"""A request's legs on kvxfer's own workers (registry engine "kvxfer").

Disaggregated (the pair has a prefill worker)::

    decode POST /reserve  ->  concurrently: prefill POST /prefill (with the reservation)
                                            decode  POST /generate (stream, NDJSON lines)

Without a prefill worker (a short prompt, a colocated fallback, or a decoder that holds the
prompt's KV): decode ``POST /generate_local`` alone. Either leg failing cancels the other
and sends ``POST /cancel`` to every worker contacted (which also frees the decode
reservation); so does the attempt being cancelled (the client went away).

The reservation is typed from end to end: the decoder's answer is validated once into a
``KVReservation`` (``kvxfer.kv.protocol``: version, every field's type and range), which the
prefill leg sends on in its own JSON form; the prefiller's parsing is the one validation
on its side.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvxfer.kv.protocol import KVReservation, ReservationError

from .directory import WorkerView, layout_key
from .leg_failure import LegFailure, short_detail
from .legs import LegRequest, LegServices, RequestLegs, RequestState, wait_for_legs
from .policies import WorkerPair
from .worker_calls import REQUEST_REJECTED_STATUSES, is_done_line, stream_object


def prefill_body(attempt_id: str, prompt_tokens: list[int], decode: WorkerView,
                 reservation: KVReservation) -> dict[str, Any]:
    """The body of ``POST /prefill``: the reservation whole, in its own JSON form (the mailbox
    slot, nonce and fence only the two workers interpret), plus the decode engine address
    from the registry, the one thing the router adds."""
    return {"request_id": attempt_id, "prompt_tokens": prompt_tokens,
            "decode": {"engine_address": decode.engine_address, **reservation.to_json()}}


class BuiltinLegs(RequestLegs):
    """The legs of a request on kvxfer's prefill and decode workers (module docs)."""

    reports_prefix_index = True

    async def run(self, request: LegRequest, services: LegServices, pair: WorkerPair, attempt_id: str) -> None:
        """One attempt on ``pair``: disaggregated, or on the decode worker alone."""
        if pair.prefill is None:
            await _local(request, services, pair.decode, attempt_id)
        else:
            await _disaggregated(request, services, pair.decode, pair.prefill, attempt_id)


async def _disaggregated(request: LegRequest, services: LegServices, decode: WorkerView, prefill: WorkerView,
                         wrid: str) -> None:
    """Reserve on the decoder, then the prefill and generate legs concurrently."""
    contacted = [decode]
    completed = False
    # Until /prefill is sent, the reservation never left the router: whatever ends the
    # attempt (a /reserve that timed out and completes late included), the decoder
    # may free its pages at once instead of fencing them.
    prefill_never_sent = True
    try:
        request.state = RequestState.RESERVING
        try:
            reservation = await _reserve(request, services, decode, prefill, wrid)
        except LegFailure as failure:
            if failure.status is not None:
                # The decoder answered with a refusal: it holds nothing for this id
                # (a /reserve either returns a reservation or takes nothing). Under
                # overload most attempts end here; a cancel each doubled its load.
                contacted.clear()
            raise
        request.state = RequestState.TRANSFERRING
        prefill_never_sent = False
        contacted.append(prefill)
        prefill_leg = asyncio.ensure_future(services.worker_calls.post_json(
            prefill, "/prefill", prefill_body(wrid, request.job.prompt_tokens, decode, reservation),
            stage="prefill", request_id=wrid, total_timeout_s=services.settings.prefill_timeout_s))
        generate_leg = asyncio.ensure_future(_stream(
            request, services, decode, "/generate",
            {"request_id": wrid, "stream": True, "timeout_s": services.settings.kv_wait_timeout_s}, wrid))
        try:
            await wait_for_legs(request, prefill_leg, generate_leg)
            if generate_leg.done() and generate_leg.exception() is None:
                # The client has its answer; a late prefill error (logged) cannot change it.
                if prefill_leg.exception() is None:
                    services.telemetry.prefill_reply(prefill_leg.result())
                completed = True
                return
            # Blame the leg that failed first; the other's error is usually a consequence. A
            # prefill failure once the decoder's output began did not end the attempt.
            prefill_failed = prefill_leg.done() and prefill_leg.exception() is not None
            failed = prefill_leg if prefill_failed and request.state is not RequestState.STREAMING else generate_leg
            raise failed.exception()  # type: ignore[misc]
        finally:
            for leg in (prefill_leg, generate_leg):
                leg.cancel()
            outcome = (await asyncio.gather(prefill_leg, generate_leg, return_exceptions=True))[0]
            prefill_never_sent = isinstance(outcome, LegFailure) and outcome.never_sent
    finally:
        if not completed:
            await services.worker_calls.cancel_shielded(wrid, contacted, prefill_never_sent=prefill_never_sent)


async def _local(request: LegRequest, services: LegServices, decode: WorkerView, wrid: str) -> None:
    """The decode worker alone computes the prompt and generates."""
    completed = False
    try:
        request.state = RequestState.GENERATING
        await _stream(request, services, decode, "/generate_local", {
            "request_id": wrid, "prompt_tokens": request.job.prompt_tokens,
            "max_tokens": request.job.max_tokens, "stream": True,
        }, wrid)
        completed = True
    finally:
        if not completed:
            await services.worker_calls.cancel_shielded(wrid, [decode])


async def _reserve(request: LegRequest, services: LegServices, decode: WorkerView, prefill: WorkerView,
                   wrid: str) -> KVReservation:
    """The decoder's reservation for this attempt, validated once, or LegFailure."""
    reply = await services.worker_calls.post_json(
        decode, "/reserve",
        # prefill_engine_address: the decoder credits this request's immediates only
        # from that engine (where its provider can tell who sent them).
        {"request_id": wrid, "prompt_tokens": request.job.prompt_tokens, "max_tokens": request.job.max_tokens,
         "prefill_engine_address": prefill.engine_address},
        stage="reserve", request_id=wrid, total_timeout_s=services.settings.control_timeout_s,
    )
    try:
        # The one contract check (kvxfer.kv.protocol): version, every field's type and range.
        reservation = KVReservation.from_json(reply, request_id=wrid)
    except ReservationError as exc:
        raise LegFailure(wrid, decode, "reserve", str(exc)) from None
    if layout_key(reservation.kv_layout) != prefill.layout_key:
        # The registry said compatible, the live reservation disagrees: never push KV
        # in a layout the decoder would misread.
        raise LegFailure(wrid, decode, "reserve", f"reserved kv_layout {reservation.kv_layout!r} "
                         f"does not match prefill worker {prefill.worker_id}'s {prefill.kv_layout!r}")
    return reservation


async def _stream(request: LegRequest, services: LegServices, decode: WorkerView, path: str, body: dict[str, Any],
                  wrid: str) -> None:
    """Read a decode NDJSON stream, handing the request its tokens and its finish."""
    stage = "generate"
    rejected = REQUEST_REJECTED_STATUSES if path == "/generate_local" else ()
    stream = services.worker_calls.stream_lines(decode, path, body, stage=stage, request_id=wrid,
                                                rejected_statuses=rejected, end_marker="its done line",
                                                is_last=is_done_line)
    async with contextlib.aclosing(stream) as lines:
        async for line in lines:
            if not line.strip():
                continue
            msg = stream_object(line, wrid, decode, stage, "stream line")
            if msg.get("done"):
                if msg.get("finish_reason") == "error" or msg.get("error"):
                    # Decode ends a failed generation with an error done line, not
                    # a broken stream; it is a leg failure like any other.
                    raise LegFailure(wrid, decode, stage, f"generation failed: {short_detail(str(msg.get('error')))}")
                rest = msg.get("text")  # the end of an unfinished UTF-8 character, usually empty
                request.finish(str(msg.get("finish_reason") or "stop"), msg.get("usage"),
                               rest if isinstance(rest, str) else "")
                return
            if "token" not in msg:
                raise LegFailure(wrid, decode, stage, f"unexpected stream line {short_detail(line)!r}")
            request.token(int(msg["token"]), str(msg.get("text", "")))


__all__ = ["BuiltinLegs", "prefill_body"]
