"""What does the authenticated control plane cost a request's time to first token?

Two local clusters side by side (`LocalCluster`: etcd, router, 1 prefill + 1 decode on
loopback): one with a cluster key (every router-to-worker call signed and verified: a
/reserve, /prefill and /generate per request), one with `insecure=True`. Requests
alternate between them (secure, insecure, secure, ...) so both see the same machine load;
TTFT is measured at the client as the time to the first SSE chunk. The machine's limit for
the same work is measured in the same run: one token minted and verified in this process
(`TokenSigner` + `TokenVerifier`), times the three calls per request. Prints a table and
writes JSON and a PNG. On a shared 2-core machine compare the ratio of one run only.

    .venv/bin/python benchmarks/bench_control_auth.py [--requests 40] [--prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from kvxfer.cluster.local_cluster import LocalCluster
from kvxfer.registry.control_token import TokenSigner, TokenVerifier, WorkerIdentity

HERE = Path(__file__).resolve().parent
CALLS_PER_REQUEST = 3  # /reserve, /prefill, /generate


def ttft_s(client: httpx.Client, router_url: str, prompt: str, max_tokens: int) -> float:
    """Seconds from sending a streaming completion to its first SSE data line."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", f"{router_url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        first = None
        for line in resp.iter_lines():  # read to the end: the request must finish before the next
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("stream ended without data")
    return first


def token_cost_s(n: int = 5000) -> float:
    """Seconds to mint and verify one token for a typical /prefill body (this process)."""
    key = os.urandom(48)
    signer = TokenSigner(key, "router", 10.0)
    target = WorkerIdentity("prefill", "prefill-0")
    verifier = TokenVerifier(key, target, max_lifetime_s=30.0, clock_skew_s=5.0, max_replay_entries=n + 1)
    body = json.dumps({"request_id": "kx-0", "prompt_tokens": list(range(256)), "decode": {"pages": [1] * 20}}).encode()
    t0 = time.perf_counter()
    for _ in range(n):
        header = signer.header(target, "POST", "/prefill", body)["Authorization"]
        verifier.verify(header, "POST", "/prefill", body)
    return (time.perf_counter() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per cluster (default 40)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (disaggregated path)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--provider", default="net")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()

    prompt = ("kv cache page prefill decode " * 64)[: args.prompt_tokens - 1]
    router_env = {"KVXFER_ROUTER_DISAGGREGATION_MIN_PROMPT_TOKENS": "0"}
    secure = LocalCluster(prefill=1, decode=1, provider=args.provider, router_env=dict(router_env))
    insecure = LocalCluster(prefill=1, decode=1, provider=args.provider, router_env=dict(router_env), insecure=True)
    times: dict[str, list[float]] = {"secure": [], "insecure": []}
    try:
        secure.start()
        insecure.start()
        with httpx.Client(timeout=120, trust_env=False) as client:
            for cluster in (secure, insecure):  # warm-up: first compile, first connections
                for _ in range(3):
                    ttft_s(client, cluster.router_url, prompt, args.max_tokens)
            for _ in range(args.requests):
                times["secure"].append(ttft_s(client, secure.router_url, prompt, args.max_tokens))
                times["insecure"].append(ttft_s(client, insecure.router_url, prompt, args.max_tokens))
    finally:
        secure.stop()
        insecure.stop()
    per_token_s = token_cost_s()

    rows = {mode: {"p50_ms": statistics.median(v) * 1e3, "mean_ms": statistics.fmean(v) * 1e3,
                   "p90_ms": sorted(v)[int(0.9 * (len(v) - 1))] * 1e3} for mode, v in times.items()}
    ratio = rows["secure"]["p50_ms"] / rows["insecure"]["p50_ms"]
    limit_ms = per_token_s * CALLS_PER_REQUEST * 1e3
    print(f"TTFT over {args.requests} alternating requests per mode, {args.prompt_tokens}-token prompt, "
          f"provider {args.provider}")
    print(f"{'mode':<10}{'p50 ms':>10}{'mean ms':>10}{'p90 ms':>10}")
    for mode, row in rows.items():
        print(f"{mode:<10}{row['p50_ms']:>10.2f}{row['mean_ms']:>10.2f}{row['p90_ms']:>10.2f}")
    print(f"secure/insecure p50 ratio: {ratio:.3f}")
    print(f"machine limit: mint+verify one token {per_token_s * 1e6:.1f} us; x{CALLS_PER_REQUEST} calls = "
          f"{limit_ms:.3f} ms per request ({limit_ms / rows['insecure']['p50_ms'] * 100:.2f}% of insecure p50)")

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "provider": args.provider,
              "rows": rows, "p50_ratio_secure_over_insecure": ratio, "token_mint_verify_s": per_token_s,
              "calls_per_request": CALLS_PER_REQUEST, "samples_s": times, "loadavg": os.getloadavg()}
    (args.out / "bench_control_auth.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.boxplot([[t * 1e3 for t in times["insecure"]], [t * 1e3 for t in times["secure"]]])
        ax.set_xticks([1, 2], ["insecure", "secure (signed calls)"])
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"Control-plane auth cost: p50 ratio {ratio:.3f}")
        fig.tight_layout()
        fig.savefig(args.out / "bench_control_auth.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
