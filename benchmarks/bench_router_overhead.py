"""What kvxfer's router costs a vLLM user: time to first token through the router against
the same requests sent to the instances directly (the two legs by hand, as the router
sends them), in one run on the same vLLM prefill + decode pair. Table printed, JSON and
PNG written. The goal (issue 33): TTFT p50 through the router at most 2 ms above direct.

Requests alternate (direct, router, direct, ...) so drift on a busy machine hits both
alike; every request has its own cache salt, so no prefix cache is shared. TTFT is
measured at the client from sending the request(s) to the first streamed token. Direct:
the prefill leg (max_tokens 1, not streamed) and the decode leg (streamed) leave at once
from two threads, each with `kv_transfer_params` naming the other instance's engine.

    .venv/bin/python benchmarks/bench_router_overhead.py                # 64..1024 tokens, 20 each
    .venv/bin/python benchmarks/bench_router_overhead.py --quick        # 64 and 256 tokens, 8 each
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvxfer.integrations.vllm.checkpoint import make_checkpoint  # noqa: E402
from support.vllm_instances import VllmFleet, router_process  # noqa: E402

REQUEST_TIMEOUT_S = 300.0
MODEL = "bench"


def prompt_of(n: int, seed: int) -> list[int]:
    """`n` token ids (above the specials), different per seed."""
    return [3 + (seed * 7919 + i * 104729) % 1900 for i in range(n)]


def first_token_s(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str],
                  start: float) -> float:
    """Seconds from `start` to the first streamed chunk that carries a token."""
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                       timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            # A token whose bytes do not end a character streams no text: its id counts.
            if line.startswith("data: {") and any(c.get("text") or c.get("token_ids")
                                                  for c in json.loads(line[6:]).get("choices", ())):
                ttft = time.perf_counter() - start
                for _ in lines:  # the rest, so the answer is whole before the next request
                    pass
                return ttft
    raise RuntimeError("no token streamed")


class DirectLegs:
    """Both legs by hand, as the router sends them, on kept-alive connections (as the
    router's own client keeps them)."""

    def __init__(self, fleet: VllmFleet) -> None:
        self.fleet = fleet
        self.prefill_engine = fleet.record("prefill").engine_address
        self.decode_engine = fleet.record("decode").engine_address
        self.prefill = httpx.Client(headers=fleet.headers, timeout=REQUEST_TIMEOUT_S)
        self.decode = httpx.Client(timeout=REQUEST_TIMEOUT_S)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def ttft(self, body: dict[str, Any]) -> float:
        tid = f"bench-{uuid.uuid4().hex}"
        start = time.perf_counter()
        leg_p = self.pool.submit(self.prefill.post, self.fleet.instances["prefill"].url + "/v1/completions", json={
            **body, "max_tokens": 1, "kv_transfer_params": {"kvxfer": {
                "role": "prefill", "transfer_id": tid, "peer_engine": self.decode_engine}}})
        ttft = first_token_s(self.decode, self.fleet.instances["decode"].url, {**body, "kv_transfer_params": {
            "kvxfer": {"role": "decode", "transfer_id": tid, "peer_engine": self.prefill_engine}}},
            self.fleet.headers, start)
        leg_p.result().raise_for_status()
        return ttft

    def close(self) -> None:
        self.pool.shutdown()
        self.prefill.close()
        self.decode.close()


def run(fleet: VllmFleet, router: str, lengths: list[int], repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    direct_legs = DirectLegs(fleet)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for n in lengths:
            for rep in range(repeats):
                body = {"model": MODEL, "prompt": prompt_of(n, rep), "max_tokens": max_tokens, "temperature": 0,
                        "return_token_ids": True}
                direct = direct_legs.ttft({**body, "cache_salt": uuid.uuid4().hex})
                routed = first_token_s(client, router, {**body, "cache_salt": uuid.uuid4().hex}, {},
                                       time.perf_counter())
                rows.append({"path": "direct", "tokens": n, "ttft_s": direct})
                rows.append({"path": "router", "tokens": n, "ttft_s": routed})
            print(f"  {n:5d} tokens done", flush=True)
    direct_legs.close()
    return rows


def summary(rows: list[dict[str, Any]], lengths: list[int]) -> list[dict[str, Any]]:
    out = []
    for n in lengths:
        direct = [r["ttft_s"] for r in rows if r["tokens"] == n and r["path"] == "direct"]
        routed = [r["ttft_s"] for r in rows if r["tokens"] == n and r["path"] == "router"]
        d50, r50 = statistics.median(direct), statistics.median(routed)
        out.append({"tokens": n, "direct_p50_ms": d50 * 1e3, "router_p50_ms": r50 * 1e3,
                    "router_minus_direct_ms": (r50 - d50) * 1e3, "samples": len(direct)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,256,1024", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=20, help="requests per length and path (default 20)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    parser.add_argument("--quick", action="store_true", help="64 and 256 tokens, 8 requests each")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a seeded checkpoint to use (made with kvxfer make-llama); default: a fresh tiny one")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "router_overhead",
                        help="output stem: writes OUT.json and OUT.png (default benchmarks/results/router_overhead)")
    args = parser.parse_args()
    lengths = [64, 256] if args.quick else [int(x) for x in args.lengths.split(",")]
    repeats = 8 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="kvxfer-router-overhead-") as tmp:
        work = Path(tmp)
        model = make_checkpoint(args.model_dir or work / "model")
        with VllmFleet(model, work, served_model_name=MODEL,
                       common_extra={"same_host": False, "bind_host": "127.0.0.1"}) as fleet:
            fleet.start("prefill", "kv_producer", "0")
            fleet.start("decode", "kv_consumer", "1")
            fleet.wait_ready("prefill", "decode")
            with router_process(fleet, work / "router.log") as router:
                # One of each first: the first requests pay for warm-up, not the router.
                run(fleet, router, [lengths[0]], 2, args.max_tokens)
                rows = run(fleet, router, lengths, repeats, args.max_tokens)
    table = summary(rows, lengths)
    print(f"\n{'tokens':>7} {'direct p50 ms':>14} {'router p50 ms':>14} {'router - direct':>16}")
    for t in table:
        print(f"{t['tokens']:>7} {t['direct_p50_ms']:>14.1f} {t['router_p50_ms']:>14.1f} "
              f"{t['router_minus_direct_ms']:>+15.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"summary": table, "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(lengths))
        ax.bar([x - 0.2 for x in xs], [t["direct_p50_ms"] for t in table], 0.4, label="direct (two legs by hand)")
        ax.bar([x + 0.2 for x in xs], [t["router_p50_ms"] for t in table], 0.4, label="through the router")
        ax.set_xticks(list(xs), [str(n) for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_title("vLLM + kvxfer: TTFT through the router vs direct")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
