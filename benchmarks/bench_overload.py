"""Does sustained overload end only in 200s and 429s, and leave no decoder page reserved?

Issue 28's overload check at full length (tests/e2e/test_overload.py runs it for 8 s):
starts a local cluster (`LocalCluster`: etcd, router, 1 prefill + --decode decode workers
of --num-pages pages each, tiny model, net on loopback, cluster key on), runs --streams
client loops that each send completions back to back (half streamed, half not) for
--seconds, then waits --settle-s seconds and reads every decoder's
`kvxfer_decode_kv_pages_reserved`. Prints the answers by status, the router's retries and
rejections, and the reserved pages; writes JSON. Exit status 1 when an answer was neither
200 nor 429, or a page is still reserved.

    .venv/bin/python benchmarks/bench_overload.py [--streams 256] [--seconds 30] [--settle-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from kvxfer.cluster.local_cluster import LocalCluster

PROMPTS = ["hi", "ok", "Hello", "The quick brown fox jumps", "Disaggregated prefill and decode",
           "KV cache pages move", "one two three four five six", "continuous batching on decode"]


async def client_loop(client: httpx.AsyncClient, url: str, index: int, until: float, out: Counter[str]) -> None:
    """Sends completions back to back until `until` (monotonic); counts each outcome."""
    n = index
    while time.monotonic() < until:
        n += 1
        body = {"model": "tiny", "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": 4, "stream": n % 2 == 0}
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body,
                                     timeout=httpx.Timeout(60.0, connect=5.0)) as resp:
                text = (await resp.aread()).decode(errors="replace")
            if resp.status_code == 429 and not resp.headers.get("retry-after", "").isdigit():
                out["429 without Retry-After"] += 1
            elif resp.status_code == 200 and body["stream"] and "[DONE]" not in text:
                out["200 with an error event"] += 1
            else:
                out[str(resp.status_code)] += 1
        except httpx.HTTPError as exc:
            out[type(exc).__name__] += 1


async def load(url: str, streams: int, seconds: float) -> Counter[str]:
    """`streams` client loops for `seconds`; the outcomes."""
    out: Counter[str] = Counter()
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, url, i, until, out) for i in range(streams)))
    return out


def metric(text: str, name: str) -> dict[str, float]:
    """Samples named `name` in Prometheus text, by their label part."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            found[head[len(name):] or "-"] = float(value)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256, help="client loops sending back to back")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the load")
    parser.add_argument("--settle-s", type=float, default=10.0, help="wait after the load before reading pages")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--num-pages", type=int, default=48, help="KV pages per worker (small: overload)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder of the JSON")
    args = parser.parse_args()

    cluster = LocalCluster(prefill=1, decode=args.decode, num_pages=args.num_pages,
                           router_env={"KVXFER_ROUTER_DISAGGREGATION_MIN_PROMPT_TOKENS": "12"})
    try:
        cluster.start()
        t0 = time.monotonic()
        outcomes = asyncio.run(load(cluster.router_url, args.streams, args.seconds))
        wall_s = time.monotonic() - t0
        time.sleep(args.settle_s)
        router = httpx.get(f"{cluster.router_url}/metrics", timeout=10, trust_env=False).text
        workers = httpx.get(f"{cluster.admin_url}/workers", timeout=10, trust_env=False).json()["workers"]
        reserved = {w["worker_id"]: metric(httpx.get(f"{w['http_url']}/metrics", timeout=10, trust_env=False).text,
                                           "kvxfer_decode_kv_pages_reserved").get("-", -1.0)
                    for w in workers if w["role"] == "decode"}
    finally:
        cluster.stop()
    result: dict[str, Any] = {
        "streams": args.streams, "seconds": args.seconds, "wall_s": round(wall_s, 1), "outcomes": dict(outcomes),
        "router_requests": metric(router, "kvxfer_router_requests_total"),
        "router_retries": metric(router, "kvxfer_router_retries_total"),
        f"reserved_pages_after_{args.settle_s:g}s": reserved,
    }
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_overload.json").write_text(json.dumps(result, indent=2))
    clean = set(outcomes) <= {"200", "429"} and all(v == 0 for v in reserved.values())
    print("clean: only 200 and 429, no page reserved" if clean else "NOT CLEAN")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
