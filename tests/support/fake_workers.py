"""In-process fake prefill and decode workers for router tests.

They follow the worker HTTP API of docs/architecture.md exactly (request bodies are checked
with ``extra="forbid"`` models, so a router sending a field the contract does not name gets
a 422) and can be told to fail at a chosen step. A fake prefill worker "pushes KV" by
looking up the decode fake that owns the ``engine_address`` in a shared :class:`Fabric`
and checking the descriptor, pages and kv_layout against the reservation, so a wrong
reservation hand-off fails like it would on a real fabric.

All fakes (and the router under test) run as uvicorn servers on real loopback ports in one
background event loop (:class:`ServerHost`), so streams, disconnects and timeouts are real.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from kvxfer.kv.protocol import KVReservation, ReservationError, encode_imm

# Strings as kvxfer.kv.cache.format_kv_layout writes them (the registry also allows objects).
LAYOUT_A = "L2-H2-D8-float32-bs16"
LAYOUT_B = "L2-H2-D8-float32-bs32"
MODEL = "kvxfer-tiny"


class ServerHost:
    """One background thread with an event loop serving any number of ASGI apps."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-workers", daemon=True)
        self._thread.start()
        self._servers: dict[str, tuple[uvicorn.Server, Any]] = {}

    def serve(self, app: Any) -> str:
        """Serve ``app`` on a free loopback port; its base URL once it accepts connections."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="critical", lifespan="on", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        fut = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self._servers[url] = (server, fut)
        deadline = time.monotonic() + 10
        while not server.started:
            if fut.done():
                fut.result()
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.005)
        return url

    def stop(self, url: str) -> None:
        """Shut the server at ``url`` down (lifespan shutdown included) and wait for it."""
        server, fut = self._servers.pop(url)
        server.should_exit = True
        fut.result(15)

    def close(self) -> None:
        """Stop every server, then the loop."""
        for url in list(self._servers):
            try:
                self.stop(url)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class WorkerMux:
    """One ASGI app that serves many fake workers, each under its own path prefix
    (``/<key>/reserve``), so a test adds workers without starting a server per worker.
    Each worker still sees plain contract paths (``/reserve``) and real HTTP connections."""

    def __init__(self) -> None:
        self._apps: dict[str, Any] = {}
        self._keys = itertools.count(1)
        #: The client's port of every HTTP request served, by path prefix: one port per
        #: connection, so a test sees whether the router reuses its connections.
        self.client_ports: dict[str, list[int]] = {}

    def add(self, app: Any) -> str:
        """Mount ``app``; returns its path prefix (``/w<n>``)."""
        key = f"w{next(self._keys)}"
        self._apps[key] = app
        return "/" + key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        key, _, rest = scope["path"].lstrip("/").partition("/")
        app = self._apps.get(key)
        if app is None:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        path = "/" + rest
        if scope.get("client"):
            self.client_ports.setdefault("/" + key, []).append(scope["client"][1])
        await app({**scope, "path": path, "raw_path": path.encode()}, receive, send)



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReserveBody(_Strict):
    request_id: str
    prompt_tokens: list[StrictInt]
    max_tokens: StrictInt
    prefill_engine_address: str = ""  # hex; the router names the prefiller whose immediates count


class GenerateBody(_Strict):
    request_id: str
    stream: StrictBool
    timeout_s: float


class GenerateLocalBody(_Strict):
    request_id: str
    prompt_tokens: list[StrictInt]
    max_tokens: StrictInt
    stream: StrictBool


class CancelBody(_Strict):
    request_id: str
    prefill_stopped: StrictBool = False  # decode only: the router relays the prefiller's in_flight false


class PrefillBody(_Strict):
    """``decode`` is the decoder's /reserve reply as the router forwarded it plus the
    decoder's ``engine_address``; the fake parses it with the workers' own
    ``kvxfer.kv.protocol.KVReservation.from_json``, so the fakes and the real workers
    agree on the contract by construction."""

    request_id: str
    prompt_tokens: list[StrictInt]
    decode: dict[str, Any]


@dataclass
class Reservation:
    request_id: str
    descriptor: str
    pages: list[int]
    imm: int
    max_tokens: int
    prompt_tokens: list[int]
    kv_ready: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class Fabric:
    """Maps engine addresses to decode fakes, standing in for WriteImm."""

    def __init__(self) -> None:
        self.decoders: dict[str, "FakeDecodeWorker"] = {}


_ids = itertools.count(1)


class _FakeWorker:
    role: str

    def __init__(self, worker_id: str, *, model: str = MODEL, kv_layout: str = LAYOUT_A) -> None:
        self.worker_id = worker_id
        self.model = model
        self.kv_layout = kv_layout
        self.engine_address = f"{next(_ids):04x}" + worker_id.encode().hex()
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.url = ""
        self.app = FastAPI()
        self.app.post("/cancel")(self._cancel)

    def record(self, **overrides: Any) -> dict[str, Any]:
        """This worker's registry ``WorkerRecord`` as a dict."""
        rec = {
            "worker_id": self.worker_id, "role": self.role, "http_url": self.url,
            "engine_address": self.engine_address, "model": self.model, "kv_layout": self.kv_layout,
            "total_pages": 64, "free_pages": 64, "queue_depth": 0, "running": 0, "draining": False,
            "updated_at": time.time(),
        }
        rec.update(overrides)
        return rec

    def paths(self) -> list[str]:
        """Paths called so far, in order."""
        return [p for p, _ in self.calls]

    def bodies(self, path: str) -> list[dict[str, Any]]:
        """Bodies of the calls to ``path``."""
        return [b for p, b in self.calls if p == path]

    def cancelled_ids(self) -> list[str]:
        """request_ids this worker was asked to cancel (not counting `released_ids`)."""
        return [b["request_id"] for b in self.bodies("/cancel") if not b.get("prefill_stopped")]

    def released_ids(self) -> list[str]:
        """request_ids for which the router relayed the prefiller's ``in_flight: false``."""
        return [b["request_id"] for b in self.bodies("/cancel") if b.get("prefill_stopped")]

    async def _cancel(self, body: CancelBody) -> dict[str, Any]:
        self.calls.append(("/cancel", body.model_dump(exclude_defaults=True)))
        self.on_cancel(body.request_id)
        return {"request_id": body.request_id, "in_flight": False}

    def on_cancel(self, request_id: str) -> None:
        pass


class FakeDecodeWorker(_FakeWorker):
    """Decode worker fake. Failure knobs (set between requests):

    ``reserve_status``: answer /reserve with that HTTP error. ``generate_status``: answer
    /generate and /generate_local with that error. ``break_after_tokens``: drop the stream
    connection after that many tokens (0: before the first). ``fail_generation``: end the
    stream with ``{"done": true, "finish_reason": "error", ...}`` as the real decode worker
    does when a generation fails. ``token_delay_s``: pause
    before each token. ``output``: the text generated, one byte token at a time.
    """

    role = "decode"

    def __init__(self, worker_id: str, fabric: Fabric, **kw: Any) -> None:
        super().__init__(worker_id, **kw)
        fabric.decoders[self.engine_address] = self
        self.reservations: dict[str, Reservation] = {}
        self.reserved: list[dict[str, Any]] = []  # every /reserve reply, in order
        self.reserve_status: int | None = None
        self.generate_status: int | None = None
        self.break_after_tokens: int | None = None
        self.token_delay_s = 0.0
        self.fail_generation = False  # end the stream with an error done line
        self.output = "hello world"
        self._next_page = 0
        self.app.post("/reserve")(self._reserve)
        self.app.post("/generate")(self._generate)
        self.app.post("/generate_local")(self._generate_local)
        self.app.get("/info")(self._info)

    def active_reservations(self) -> list[str]:
        """Reservations neither finished nor cancelled (pages still held)."""
        return sorted(self.reservations)

    def on_cancel(self, request_id: str) -> None:
        res = self.reservations.pop(request_id, None)
        if res is not None:
            res.cancelled.set()

    async def _info(self) -> dict[str, Any]:
        rec = self.record()
        return {k: rec[k] for k in ("worker_id", "role", "model", "kv_layout", "engine_address", "http_url",
                                    "total_pages", "free_pages", "running", "queue_depth")} | {"waiting": 0}

    async def _reserve(self, body: ReserveBody) -> dict[str, Any]:
        self.calls.append(("/reserve", body.model_dump()))
        if self.reserve_status is not None:
            raise HTTPException(self.reserve_status, f"reserve refused for {body.request_id}")
        if body.request_id in self.reservations:
            raise HTTPException(409, f"request {body.request_id} already reserved")
        n_pages = -(-(len(body.prompt_tokens) + body.max_tokens) // 16)
        pages = list(range(self._next_page, self._next_page + n_pages))
        self._next_page += n_pages
        res = Reservation(body.request_id, f"dd{len(self.reservations):04x}" + self.engine_address, pages,
                          imm=encode_imm(len(self.calls) % 1000, 1), max_tokens=body.max_tokens,
                          prompt_tokens=body.prompt_tokens)
        self.reservations[body.request_id] = res
        # Built (and so validated) by the real protocol type: the fake cannot drift from it.
        prompt_pages = -(-len(body.prompt_tokens) // 16)
        reply = KVReservation(
            request_id=body.request_id, descriptor=bytes.fromhex(res.descriptor), pages=pages,
            num_pages=max(64, self._next_page), imm=res.imm, expected_count=2 * prompt_pages + 1,
            kv_layout=self.kv_layout, meta_descriptor=bytes.fromhex("ee" + self.engine_address),
            meta_offset=64 * len(self.reservations), nonce=7000 + len(self.calls), fence_timeout_s=15.0,
        ).to_json()
        self.reserved.append(reply)
        return reply

    def _token_stream(self, request_id: str, max_tokens: int, prompt_len: int) -> StreamingResponse:
        data = self.output.encode()[:max_tokens]
        finish = "length" if len(self.output.encode()) >= max_tokens else "stop"

        async def lines():
            try:
                for i, b in enumerate(data):
                    if self.break_after_tokens is not None and i >= self.break_after_tokens:
                        raise ConnectionAbortedError("fake decode worker dropped the stream")
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    yield json.dumps({"token": b, "text": chr(b)}) + "\n"
                if self.break_after_tokens is not None and len(data) >= self.break_after_tokens:
                    raise ConnectionAbortedError("fake decode worker dropped the stream")
                if self.fail_generation:
                    yield json.dumps({"done": True, "finish_reason": "error", "error": "fake generation failure",
                                      "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(data)}}) + "\n"
                    return
                usage = {"prompt_tokens": prompt_len, "completion_tokens": len(data),
                         "total_tokens": prompt_len + len(data)}
                yield json.dumps({"done": True, "finish_reason": finish, "usage": usage}) + "\n"
            finally:
                self.reservations.pop(request_id, None)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def _generate(self, body: GenerateBody) -> Any:
        self.calls.append(("/generate", body.model_dump()))
        if self.generate_status is not None:
            raise HTTPException(self.generate_status, f"generate refused for {body.request_id}")
        res = self.reservations.get(body.request_id)
        if res is None:
            raise HTTPException(404, f"no reservation for {body.request_id}")
        ready = asyncio.ensure_future(res.kv_ready.wait())
        cancelled = asyncio.ensure_future(res.cancelled.wait())
        await asyncio.wait({ready, cancelled}, timeout=body.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        cancelled.cancel()
        if res.cancelled.is_set():
            raise HTTPException(409, f"request {body.request_id} was cancelled")
        if not res.kv_ready.is_set():
            self.reservations.pop(body.request_id, None)
            raise HTTPException(504, f"KV for {body.request_id} did not arrive within {body.timeout_s}s")
        return self._token_stream(body.request_id, res.max_tokens, len(res.prompt_tokens))

    async def _generate_local(self, body: GenerateLocalBody) -> Any:
        self.calls.append(("/generate_local", body.model_dump()))
        if self.generate_status is not None:
            raise HTTPException(self.generate_status, f"generate_local refused for {body.request_id}")
        self.reservations[body.request_id] = Reservation(body.request_id, "", [], 0, body.max_tokens, body.prompt_tokens)
        return self._token_stream(body.request_id, body.max_tokens, len(body.prompt_tokens))


class FakePrefillWorker(_FakeWorker):
    """Prefill worker fake. Knobs: ``status`` (answer /prefill with that error, before
    pushing KV), ``delay_s`` (compute time before the push; cut short by /cancel)."""

    role = "prefill"

    def __init__(self, worker_id: str, fabric: Fabric, **kw: Any) -> None:
        super().__init__(worker_id, **kw)
        self.fabric = fabric
        self.status: int | None = None
        self.delay_s = 0.0
        self._cancel_events: dict[str, asyncio.Event] = {}
        self.app.post("/prefill")(self._prefill)

    def on_cancel(self, request_id: str) -> None:
        ev = self._cancel_events.get(request_id)
        if ev is not None:
            ev.set()

    async def _prefill(self, body: PrefillBody) -> dict[str, Any]:
        self.calls.append(("/prefill", body.model_dump()))
        cancel = self._cancel_events.setdefault(body.request_id, asyncio.Event())
        if self.delay_s:
            try:
                await asyncio.wait_for(cancel.wait(), self.delay_s)
            except asyncio.TimeoutError:
                pass
        if cancel.is_set():
            raise HTTPException(409, f"prefill {body.request_id} cancelled")
        if self.status is not None:
            raise HTTPException(self.status, f"prefill failed for {body.request_id}")
        try:
            target = KVReservation.from_json(body.decode, request_id=body.request_id)
        except ReservationError as exc:
            raise HTTPException(422, str(exc)) from None
        engine_address = body.decode.get("engine_address")
        decoder = self.fabric.decoders.get(engine_address) if isinstance(engine_address, str) else None
        if decoder is None:
            raise HTTPException(502, f"unknown engine address {engine_address}")
        res = decoder.reservations.get(body.request_id)
        if res is None or (res.descriptor, res.pages, res.imm) != (target.descriptor.hex(), target.pages, target.imm):
            raise HTTPException(502, f"no matching reservation for {body.request_id} at {decoder.worker_id}")
        if target.kv_layout != self.kv_layout:
            raise HTTPException(400, "kv_layout mismatch")
        res.kv_ready.set()
        return {"request_id": body.request_id, "first_token": decoder.output.encode()[0] if decoder.output else 257,
                "prefill_ms": 1.0,
                "transfer_tail_ms": 0.1, "kv_bytes": 4096 * len(res.pages)}
