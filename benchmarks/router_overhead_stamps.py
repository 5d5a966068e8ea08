"""Per-step timestamps of the router's requests, for `bench_router_overhead.py --stub-instances`.

Imported into the router's process before the app is built (the benchmark's bootstrap):
it wraps, from outside, the steps of one relayed vLLM request (ASGI entry, body parsed,
legs started, each leg's POST, the decode leg's answer headers, the first stream line, the hand-over
to the HTTP side, the response's start and first body bytes) and writes one record of
`time.perf_counter()` stamps per request to the file named by KVXFER_ROUTER_STAMPS at exit.
perf_counter is CLOCK_MONOTONIC on Linux: the benchmark's client stamps compare with them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from kvxfer_router import app as app_module
from kvxfer_router import dispatch, vllm_legs

_records: list[dict[str, float]] = []
_current: dict[str, dict[str, float]] = {}


def _stamp(step: str) -> None:
    record = _current.get("record")
    if record is not None and step not in record:
        record[step] = time.perf_counter()


def _wrap_create_app() -> None:
    original = app_module.create_app

    def create_app(*args: Any, **kwargs: Any) -> Any:
        inner = original(*args, **kwargs)

        async def stamped(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                return await inner(scope, receive, send)
            record = {"asgi_in": time.perf_counter()}
            _current["record"] = record  # one request at a time: the benchmark sends them in turn
            _records.append(record)

            async def send_stamped(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    record.setdefault("response_start", time.perf_counter())
                elif message["type"] == "http.response.body" and message.get("body"):
                    record.setdefault("first_body", time.perf_counter())
                await send(message)

            await inner(scope, receive, send_stamped)

        stamped.state = inner.state  # type: ignore[attr-defined]
        return stamped

    app_module.create_app = create_app


def _wrap_steps() -> None:
    parse = app_module.RouterService.parse_completion

    async def parse_completion(self: Any, request: Any) -> Any:
        _stamp("parse_start")
        parsed = await parse(self, request)
        _stamp("parsed")
        return parsed

    app_module.RouterService.parse_completion = parse_completion  # type: ignore[method-assign]
    run_legs = vllm_legs.VllmLegs.run

    async def stamped_legs(*args: Any, **kwargs: Any) -> None:
        _stamp("legs_start")
        await run_legs(*args, **kwargs)

    vllm_legs.VllmLegs.run = stamped_legs  # type: ignore[method-assign]
    post = vllm_legs._post

    @contextlib.asynccontextmanager
    async def stamped_post(lc: Any, worker: Any, path: str, body: Any, stage: str, *args: Any,
                           **kwargs: Any) -> AsyncIterator[Any]:
        _stamp(f"{stage}_post")
        async with post(lc, worker, path, body, stage, *args, **kwargs) as resp:
            if stage == "generate":  # the prefill leg's answer is off the way to the first token
                _stamp("generate_headers")
            yield resp

    vllm_legs._post = stamped_post  # type: ignore[assignment]
    event_lines = vllm_legs._event_lines

    async def stamped_lines(*args: Any, **kwargs: Any) -> AsyncIterator[bytes]:
        async for line in event_lines(*args, **kwargs):
            if line.startswith(b"data: {"):
                _stamp("first_line")
            yield line

    vllm_legs._event_lines = stamped_lines  # type: ignore[assignment]
    relay = dispatch.RequestLifecycle.relay

    def stamped_relay(self: Any, event: Any, *, last: bool) -> None:
        _stamp("relayed")
        relay(self, event, last=last)

    dispatch.RequestLifecycle.relay = stamped_relay  # type: ignore[method-assign]


def _dump() -> None:
    with open(os.environ["KVXFER_ROUTER_STAMPS"], "w") as f:
        json.dump(_records, f)


_wrap_create_app()
_wrap_steps()
atexit.register(_dump)
