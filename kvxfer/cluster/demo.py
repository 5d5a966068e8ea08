"""The main demo: a local etcd, the router, one prefill and two decode workers on this
machine; a few users in multi-turn conversations through the router (every turn re-sends
the conversation on one shared system prompt, plus a new message; the answer is appended);
a table of TTFT (first turns and later ones), inter-token latency, prefix-cache hits on the
prefill and decode side, KV pages pushed and not pushed, and the KV push per request; then
a clean shutdown.

    python -m kvxfer.cluster.demo [--users 4] [--turns 6] [--max-tokens 16] [--policy kv_aware] [--provider auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from kvxfer.cluster.local_cluster import LocalCluster
from kvxfer.model.config import ModelConfig

MODEL = "tiny"
#: One request, admission to last token; a request that takes longer counts as failed.
REQUEST_TIMEOUT_S = 120.0
METRICS_TIMEOUT_S = 5.0
_WORDS = ("kv cache pages move layer by layer from prefill to decode over one sided writes "
          "while the next layer computes and the decoder counts immediates").split()
# Sized for the tiny model's 1,024-token context (one token per byte): the last turn of a
# conversation stays under it even when every answer byte comes back as a 3-byte U+FFFD.
SYSTEM_PROMPT_BYTES = 280
MESSAGE_BYTES = (24, 48)


def _words(rng: random.Random, n_bytes: int) -> str:
    out = ""
    while len(out) < n_bytes:
        out += rng.choice(_WORDS) + " "
    return out[:n_bytes]


@dataclass
class Turn:
    """What the client saw of one request."""

    user: int
    turn: int
    ok: bool = False
    ttft_s: float = float("nan")
    #: Arrival times of the streamed tokens, from the request's start.
    stamps: list[float] = field(default_factory=list)
    serving_mode: str = ""
    error: str = ""

    @property
    def inter_token_s(self) -> float | None:
        """Mean gap between tokens: (last - first) / (tokens - 1). Per-gap figures read 0.0:
        a decode step of the tiny model takes well under a millisecond, so the tokens made
        while the first one travelled back through the router arrive right behind it, tens
        of microseconds apart, and most gaps of a short answer are such. The mean over the
        stream is the rate a user sees."""
        if len(self.stamps) < 2:
            return None
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1)


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, turn: Turn) -> str:
    """Streams one completion into `turn`; returns the answer's text."""
    answer = ""
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        }) as resp:
            turn.serving_mode = resp.headers.get("x-kvxfer-serving-mode", "")
            if resp.status_code != 200:
                turn.error = f"status {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return answer
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                    answer += choice.get("text") or ""
                    if choice.get("text") is not None and choice.get("finish_reason") is None:
                        # One event per token; the finish event carries no token of its own.
                        turn.stamps.append(time.perf_counter() - start)
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
        return answer
    turn.ok = bool(turn.stamps)
    turn.ttft_s = turn.stamps[0] if turn.stamps else float("nan")
    turn.error = "" if turn.ok else "no tokens"
    return answer


async def _converse(url: str, users: int, turns: int, max_tokens: int, seed: int) -> list[Turn]:
    """Every user's conversation, the users at once, each user's turns in order."""
    rng = random.Random(seed)
    system = "system: " + _words(rng, SYSTEM_PROMPT_BYTES - 8) + "\n"
    messages = [[_words(rng, rng.randint(*MESSAGE_BYTES)) for _ in range(turns)] for _ in range(users)]
    results: list[Turn] = []
    bar = tqdm(total=users * turns, desc="requests", unit="req")
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        async def user(u: int) -> None:
            conversation = system
            for t, message in enumerate(messages[u]):
                prompt = f"{conversation}user {u}: {message}\nassistant: "
                turn = Turn(u, t)
                answer = await _one(client, url, prompt, max_tokens, turn)
                results.append(turn)
                bar.update(1)
                conversation = prompt + answer + "\n"
        await asyncio.gather(*(user(u) for u in range(users)))
    bar.close()
    return results


def _scrape(url: str) -> dict[str, float]:
    """A /metrics page's samples summed by name (and by `le` for histogram buckets)."""
    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=METRICS_TIMEOUT_S).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (f"|{sample.labels['le']}" if "le" in sample.labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _merged(urls: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        for k, v in _scrape(url).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _histogram_quantile(metrics: dict[str, float], name: str, q: float) -> float:
    """The q-quantile of a histogram from its cumulative buckets, interpolated inside the
    bucket as Prometheus' histogram_quantile does; NaN without observations."""
    buckets = sorted((float(k.split("|")[1]), v) for k, v in metrics.items() if k.startswith(name + "_bucket|"))
    count = buckets[-1][1] if buckets else 0.0
    if count <= 0:
        return float("nan")
    rank, lower, below = q * count, 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = upper, cumulative
    return lower


def _share(part: float | None, whole: float | None) -> str:
    """"hits of looked up (rate)"; the workers without a prefix cache report neither."""
    if part is None or whole is None:
        return "not reported by the workers"
    return f"{part:,.0f} of {whole:,.0f} ({100 * part / whole if whole else 0:.0f}%)"


def _report(results: list[Turn], wall: float, prefill: dict[str, float], decode: dict[str, float],
            page_bytes: int) -> list[tuple[str, str]]:
    """The demo's table rows; `page_bytes` is one page of every layer."""
    ok = [r for r in results if r.ok]
    first = [r.ttft_s * 1e3 for r in ok if r.turn == 0]
    later = [r.ttft_s * 1e3 for r in ok if r.turn > 0]
    itl = [r.inter_token_s * 1e3 for r in ok if r.inter_token_s is not None]
    tokens = sum(len(r.stamps) for r in ok)
    pushed = prefill.get("kvxfer_prefill_kv_pushed_bytes_total", 0.0)
    pushes = prefill.get("kvxfer_prefill_kv_transfer_seconds_count", 0.0)
    pages_pushed = pushed / page_bytes
    pages_held = prefill.get("kvxfer_prefill_kv_pages_skipped_total")
    modes: dict[str, int] = {}
    for r in results:
        modes[r.serving_mode or "none"] = modes.get(r.serving_mode or "none", 0) + 1
    span_p50 = _histogram_quantile(prefill, "kvxfer_prefill_kv_transfer_seconds", 0.5) * 1e3
    span_p99 = _histogram_quantile(prefill, "kvxfer_prefill_kv_transfer_seconds", 0.99) * 1e3
    return [
        ("requests ok / sent", f"{len(ok)} / {len(results)}"),
        ("served as", ", ".join(f"{m} {n}" for m, n in sorted(modes.items()))),
        ("TTFT p50 / p99, first turns (ms)", f"{_pct(first, .5):.1f} / {_pct(first, .99):.1f}"),
        ("TTFT p50 / p99, later turns (ms)", f"{_pct(later, .5):.1f} / {_pct(later, .99):.1f}"),
        ("inter-token p50 / p99 (ms, each request's mean gap)", f"{_pct(itl, .5):.2f} / {_pct(itl, .99):.2f}"),
        ("tokens generated", f"{tokens} ({tokens / wall:.1f} tok/s)"),
        ("prompt tokens found in the prefill worker's cache", _share(
            prefill.get("kvxfer_prefill_prefix_hit_tokens_total"),
            prefill.get("kvxfer_prefill_prefix_lookup_tokens_total"))),
        ("prompt tokens the decode workers already held", _share(
            decode.get("kvxfer_decode_prefix_hit_tokens_total"),
            decode.get("kvxfer_decode_prefix_lookup_tokens_total"))),
        ("KV pages pushed / not pushed (decoder held them)",
         f"{pages_pushed:,.0f} / {pages_held:,.0f}" if pages_held is not None
         else f"{pages_pushed:,.0f} / not reported by the workers"),
        ("KV pushed per request (mean)", f"{pushed / pushes / 1024:.1f} KiB in {pushes:.0f} pushes"
         if pushes else "no push"),
        ("KV push p50 / p99 (ms, first write posted to last landed)", f"{span_p50:.1f} / {span_p99:.1f}"),
        ("wall time (s)", f"{wall:.1f}"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns 0 when every request succeeded."""
    parser = argparse.ArgumentParser(prog="python -m kvxfer.cluster.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=4, help="users in conversation at once (default 4)")
    parser.add_argument("--turns", type=int, default=6,
                        help="turns per conversation; each re-sends the conversation so far (default 6; the tiny "
                             "model's 1,024-token context holds about 7)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    parser.add_argument("--policy", default="kv_aware",
                        help="the router's pair policy: kv_aware (default), least_loaded or round_robin")
    parser.add_argument("--provider", default="auto", help="libfabric provider of the workers (default auto)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the conversations' text (default 7)")
    args = parser.parse_args(argv)
    if min(args.users, args.turns, args.max_tokens) < 1:
        parser.error("--users, --turns and --max-tokens must be at least 1")

    print(f"starting a local etcd, the router ({args.policy}), 1 prefill and 2 decode workers ...", flush=True)
    with LocalCluster(prefill=1, decode=2, provider=args.provider, model=MODEL,
                      router_env={"KVXFER_ROUTER_DISAGGREGATION_MIN_PROMPT_TOKENS": "0",
                                  "KVXFER_ROUTER_POLICY": args.policy}) as cluster:
        print(f"router {cluster.router_url}, logs in {cluster.log_dir}", flush=True)
        t0 = time.perf_counter()
        results = asyncio.run(_converse(cluster.router_url, args.users, args.turns, args.max_tokens, args.seed))
        wall = time.perf_counter() - t0
        workers = httpx.get(f"{cluster.admin_url}/workers", timeout=METRICS_TIMEOUT_S).json().get("workers", [])
        prefill = _merged([w["http_url"] for w in workers if w.get("role") == "prefill"])
        decode = _merged([w["http_url"] for w in workers if w.get("role") == "decode"])
        print("draining and stopping ...", flush=True)

    config = ModelConfig.preset(MODEL)
    rows = _report(results, wall, prefill, decode, config.page_bytes * config.num_layers)
    width = max(len(k) for k, _ in rows)
    print()
    print(f"kvxfer demo: {args.users} users x {args.turns} turns on one system prompt, 1 prefill + 2 decode "
          f"workers, router policy {args.policy}")
    print("-" * (width + 30))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 30))
    failed = [r for r in results if not r.ok]
    for r in failed[:5]:
        print(f"failed: user {r.user} turn {r.turn}: {r.error}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
