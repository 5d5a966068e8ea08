"""Client-side helpers for the end-to-end cluster tests (tests/test_cluster_e2e.py).

- `Reference`: the colocated generation every router answer is compared with
  (`Transformer(ModelConfig.preset("tiny")).generate(...)`), cached per prompt.
- `complete()` / `fire()`: one or many concurrent `POST /v1/completions` (streaming SSE or
  not), each bounded by a timeout, giving a `Result` (never raising for HTTP errors).
- `LoadGenerator`: N client loops sending requests back to back from a background thread
  until stopped, so a test can scale, kill or restart things "under load".
- Small readers for the router's `/workers`, a worker's `/info` and Prometheus text.

Every network call has a timeout and every loop a deadline; nothing here talks to anything
but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Sequence

import httpx
from support.waiting import wait_until

#: Prompts of a few lengths (+1 token for BOS each). Short ones keep the tiny model fast.
SHORT_PROMPTS = [
    "hi", "ok", "abc", "Hello", "cat", "x y", "Tok", "42", "sun", "a b c",
]
LONG_PROMPTS = [
    "The quick brown fox jumps", "Disaggregated prefill and decode", "KV cache pages move",
    "one two three four five six", "Lorem ipsum dolor sit amet", "etcd leases keep workers",
    "RDMA writes with immediates", "0123456789abcdefghijklmn", "Prometheus scrapes metrics",
    "continuous batching on decode",
]


@lru_cache(maxsize=None)
def _model() -> tuple[Any, Any]:
    from kvxfer.model.config import ModelConfig
    from kvxfer.model.tokenizer import ByteTokenizer
    from kvxfer.model.transformer import Transformer

    return Transformer(ModelConfig.preset("tiny")), ByteTokenizer()


class Reference:
    """Colocated greedy generation of the tiny model, as the router must reproduce it."""

    @staticmethod
    @lru_cache(maxsize=None)
    def tokens(prompt: str, max_tokens: int) -> tuple[int, ...]:
        """The generated token ids (EOS excluded)."""
        model, tok = _model()
        return tuple(model.generate(tok.encode(prompt), max_tokens).tokens)

    @staticmethod
    def text(prompt: str, max_tokens: int) -> str:
        """`ByteTokenizer().decode(tokens)`: what the completion text must equal."""
        _, tok = _model()
        return tok.decode(Reference.tokens(prompt, max_tokens))

    @staticmethod
    def warm(specs: Iterable[tuple[str, int]]) -> None:
        """Computes (and caches) the reference of every (prompt, max_tokens)."""
        for prompt, max_tokens in specs:
            Reference.tokens(prompt, max_tokens)


@dataclass
class Result:
    """One completion as the client saw it."""

    prompt: str
    max_tokens: int
    stream: bool
    status: int = 0  # 0: no HTTP answer (connection error or client timeout)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None  # error message from the body, or the client-side exception
    body: Any = None
    serving_mode: str | None = None  # the router's X-Kvxfer-Serving-Mode header
    retry_after: str | None = None  # the Retry-After header of an error answer
    started: float = 0.0
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason in ("length", "stop")

    @property
    def clean_overload(self) -> bool:
        """A 429 that says when to come back (Retry-After in whole seconds)."""
        return self.status == 429 and self.retry_after is not None and self.retry_after.isdigit()

    @property
    def elapsed(self) -> float:
        return self.ended - self.started

    def correct(self) -> bool:
        """Succeeded and equals the colocated reference (text and token count)."""
        if not self.ok:
            return False
        want = Reference.tokens(self.prompt, self.max_tokens)
        if self.text != Reference.text(self.prompt, self.max_tokens):
            return False
        if self.completion_tokens is not None and self.completion_tokens != len(want):
            return False
        return self.finish_reason == ("length" if len(want) == self.max_tokens else "stop")

    def describe(self) -> str:
        return (f"{self.prompt!r}/{self.max_tokens} stream={self.stream}: status {self.status} "
                f"text {self.text!r} (want {Reference.text(self.prompt, self.max_tokens)!r}) "
                f"finish {self.finish_reason} error {self.error!r} after {self.elapsed:.2f}s")


def new_async_client(connections: int = 256) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        trust_env=False,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or body["error"])
    return json.dumps(body)[:300]


async def complete(
    client: httpx.AsyncClient, router_url: str, prompt: str, max_tokens: int, *,
    stream: bool = False, timeout_s: float = 60.0,
) -> Result:
    """One completion; HTTP errors and timeouts come back in the Result, never raised."""
    res = Result(prompt, max_tokens, stream, started=time.monotonic())
    payload: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    try:
        await asyncio.wait_for(_do_complete(client, router_url, payload, res), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"client timeout after {timeout_s}s"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.ended = time.monotonic()
    return res


async def _do_complete(client: httpx.AsyncClient, router_url: str, payload: dict[str, Any], res: Result) -> None:
    url = f"{router_url}/v1/completions"
    if not payload["stream"]:
        r = await client.post(url, json=payload, timeout=httpx.Timeout(60.0, connect=5.0))
        res.status = r.status_code
        res.serving_mode = r.headers.get("x-kvxfer-serving-mode")
        res.retry_after = r.headers.get("retry-after")
        try:
            res.body = r.json()
        except ValueError:
            res.body = r.text
        if r.status_code != 200:
            res.error = _error_message(res.body)
            return
        choice = res.body["choices"][0]
        res.text = choice["text"]
        res.finish_reason = choice["finish_reason"]
        res.completion_tokens = res.body["usage"]["completion_tokens"]
        return
    async with client.stream("POST", url, json=payload, timeout=httpx.Timeout(60.0, connect=5.0)) as r:
        res.status = r.status_code
        res.serving_mode = r.headers.get("x-kvxfer-serving-mode")
        res.retry_after = r.headers.get("retry-after")
        if r.status_code != 200:
            raw = await r.aread()
            try:
                res.body = json.loads(raw)
            except ValueError:
                res.body = raw.decode(errors="replace")
            res.error = _error_message(res.body)
            return
        pieces: list[str] = []
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                res.error = _error_message(event)
                break
            if event.get("usage"):
                res.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                pieces.append(choice.get("text") or "")
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
        res.text = "".join(pieces)
        if not done and res.error is None:
            res.error = "stream ended without [DONE]"


def fire(router_url: str, specs: Sequence[tuple[str, int, bool]], *, timeout_s: float = 60.0) -> list[Result]:
    """Sends every (prompt, max_tokens, stream) at once; returns the results in order."""

    async def main() -> list[Result]:
        async with new_async_client(max(16, len(specs) + 8)) as client:
            return list(await asyncio.gather(*(
                complete(client, router_url, p, n, stream=s, timeout_s=timeout_s) for p, n, s in specs
            )))

    return asyncio.run(main())


class LoadGenerator:
    """`concurrency` client loops sending completions back to back until `stop()`.

    Requests cycle through `specs` ((prompt, max_tokens, stream) triples). Runs its own
    event loop in a daemon thread; `stop()` lets the requests in flight finish (each has
    its own timeout) and returns every Result.
    """

    def __init__(self, router_url: str, specs: Sequence[tuple[str, int, bool]], *,
                 concurrency: int = 4, timeout_s: float = 60.0, pause_s: float = 0.0) -> None:
        self.router_url = router_url
        self.specs = list(specs)
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._next = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load", daemon=True)

    def start(self) -> "LoadGenerator":
        self._thread.start()
        return self

    async def _main(self) -> None:
        async with new_async_client(self.concurrency + 8) as client:
            await asyncio.gather(*(self._loop(client) for _ in range(self.concurrency)))

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            prompt, max_tokens, stream = self.specs[self._next % len(self.specs)]
            self._next += 1
            self.results.append(await complete(client, self.router_url, prompt, max_tokens,
                                               stream=stream, timeout_s=self.timeout_s))
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    def finished_since(self, t: float) -> list[Result]:
        """Results of requests that started at or after monotonic time `t`."""
        return [r for r in list(self.results) if r.started >= t]

    def wait_for_results(self, n: int, timeout_s: float, since: float = 0.0) -> None:
        """Waits until `n` requests started after `since` have finished."""
        wait_until(lambda: len(self.finished_since(since)) >= n, timeout_s,
                   f"{n} completions under load (have {len(self.finished_since(since))})")

    def stop(self, timeout_s: float | None = None) -> list[Result]:
        self._stop.set()
        self._thread.join(timeout_s if timeout_s is not None else self.timeout_s + 10)
        assert not self._thread.is_alive(), "load generator did not stop"
        return list(self.results)


# --- small readers ------------------------------------------------------------------------



def router_workers(cluster: Any) -> dict[str, dict[str, Any]]:
    """The GET /workers of a `LocalCluster`'s router (its admin port) as {worker_id: record};
    {} if the router does not answer."""
    try:
        body = httpx.get(f"{cluster.admin_url}/workers", timeout=3, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {w["worker_id"]: w for w in body.get("workers", [])}


def worker_info(cluster: Any, http_url: str) -> dict[str, Any]:
    """A worker's GET /info, signed with the `LocalCluster`'s key when it has one."""
    r = httpx.get(f"{http_url}/info", timeout=3, trust_env=False, auth=cluster.control_auth)
    r.raise_for_status()
    return r.json()


def get_metrics(url: str) -> str:
    """The Prometheus text of `url`/metrics."""
    r = httpx.get(f"{url}/metrics", timeout=3, trust_env=False)
    r.raise_for_status()
    return r.text


def metric_value(text: str, sample: str) -> float:
    """Sum of the samples named `sample` (any labels; `name{a="b"}` narrows) in Prometheus text."""
    name, _, labels = sample.partition("{")
    want = {kv.split("=", 1)[0]: kv.split("=", 1)[1].strip('"') for kv in labels.rstrip("}").split(",") if kv}
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, _, value = line.rpartition(" ")
        metric, _, lab = head.partition("{")
        if metric != name:
            continue
        have = {}
        for kv in lab.rstrip("}").split(","):
            if "=" in kv:
                k, v = kv.split("=", 1)
                have[k] = v.strip('"')
        if all(have.get(k) == v for k, v in want.items()):
            total += float(value)
            found = True
    if not found:
        raise AssertionError(f"{sample} not in metrics")
    return total


@dataclass
class PageCheck:
    """free_pages vs total_pages of every decode worker the router lists."""

    pages: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def now(cls, cluster: Any) -> "PageCheck":
        out = {}
        for wid, rec in router_workers(cluster).items():
            if rec["role"] == "decode":
                info = worker_info(cluster, rec["http_url"])
                out[wid] = (info["free_pages"], info["total_pages"])
        return cls(out)

    @property
    def all_free(self) -> bool:
        return bool(self.pages) and all(free == total for free, total in self.pages.values())


def wait_pages_free(cluster: Any, timeout_s: float) -> PageCheck:
    """Waits until every decode worker the router lists has all of its pages free."""
    last: list[PageCheck] = []

    def check() -> bool:
        last[:] = [PageCheck.now(cluster)]
        return last[0].all_free

    try:
        wait_until(check, timeout_s, "decode pages to return")
    except AssertionError:
        raise AssertionError(f"decode pages not all free after {timeout_s}s: {last[0].pages if last else None}") from None
    return last[0]
