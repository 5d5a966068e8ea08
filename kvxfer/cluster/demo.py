"""The main demo: a local etcd, the router, one prefill and two decode workers on this
machine; a batch of streaming requests through the router; a table of TTFT, inter-token
latency, KV bytes moved and transfer GB/s; then a clean shutdown.

    python -m kvxfer.cluster.demo [--requests 24] [--concurrency 8] [--max-tokens 24] [--provider auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from kvxfer.cluster.local_cluster import LocalCluster

_WORDS = ("kv cache pages move layer by layer from prefill to decode over one sided writes "
          "while the next layer computes and the decoder counts immediates").split()


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 140)))


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
    }) as resp:
        if resp.status_code != 200:
            return {"ok": False, "status": resp.status_code, "error": (await resp.aread()).decode()[:200]}
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
    if not stamps:
        return {"ok": False, "status": 200, "error": "no tokens"}
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ok": True, "ttft": stamps[0] - start, "itl": itl, "tokens": len(stamps), "e2e": stamps[-1] - start}


def _scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _drive(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []
    bar = tqdm(total=len(prompts), desc="requests", unit="req")
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        async def run(p: str) -> None:
            async with sem:
                results.append(await _one(client, url, p, max_tokens))
                bar.update(1)
        await asyncio.gather(*(run(p) for p in prompts))
    bar.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns 0 when every request succeeded."""
    parser = argparse.ArgumentParser(prog="python -m kvxfer.cluster.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24, help="requests to send (default 24)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per request (default 24)")
    parser.add_argument("--provider", default="auto", help="libfabric provider of the workers")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    print("starting a local etcd, the router, 1 prefill and 2 decode workers ...", flush=True)
    with LocalCluster(prefill=1, decode=2, provider=args.provider,
                      router_env={"KVXFER_ROUTER_DISAGGREGATION_MIN_PROMPT_TOKENS": "0"}) as cluster:
        print(f"router {cluster.router_url}, logs in {cluster.log_dir}", flush=True)
        rng = random.Random(args.seed)
        prompts = [_prompt(rng) for _ in range(args.requests)]
        t0 = time.perf_counter()
        results = asyncio.run(_drive(cluster.router_url, prompts, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t0
        prefill_urls = [w["http_url"] for w in httpx.get(f"{cluster.admin_url}/workers", timeout=5).json().get("workers", [])
                        if w.get("role") == "prefill"]
        kv_bytes = 0.0
        transfer_s = 0.0
        for url in prefill_urls:
            m = _scrape(url)
            kv_bytes += m.get("kvxfer_prefill_kv_pushed_bytes_total", 0.0)
            transfer_s += m.get("kvxfer_prefill_kv_wire_seconds_total", 0.0)
        print("draining and stopping ...", flush=True)

    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in ok]
    itl = [x * 1e3 for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    rows = [
        ("requests ok / sent", f"{len(ok)} / {len(results)}"),
        ("TTFT p50 / p99 (ms)", f"{_pct(ttft, .5):.1f} / {_pct(ttft, .99):.1f}"),
        ("inter-token p50 / p99 (ms)", f"{_pct(itl, .5):.1f} / {_pct(itl, .99):.1f}"),
        ("tokens generated", f"{tokens} ({tokens / wall:.1f} tok/s)"),
        ("KV bytes moved", f"{kv_bytes / 1e6:.2f} MB"),
        ("transfer GB/s (bytes / time writes were in flight)", f"{(kv_bytes / transfer_s / 1e9) if transfer_s else float('nan'):.2f}"),
        ("wall time (s)", f"{wall:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    print("kvxfer demo: 1 prefill + 2 decode workers, streaming through the router")
    print("-" * (width + 24))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 24))
    failed = [r for r in results if not r["ok"]]
    for r in failed[:5]:
        print(f"failed: status {r['status']}: {r['error']}")
    if ttft:
        print(f"mean TTFT {statistics.mean(ttft):.1f} ms")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
