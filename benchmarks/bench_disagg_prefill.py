"""Disaggregated prefill in the shape of the paper's Table 3: does the KV push hide behind compute?

For each prompt length, on the Llama-3-8B-shaped KV config (ModelConfig preset
'llama3-8b-kv': 32 layers, 8 KV heads x 128, float32, block 16 -> 128 KiB pages), this
measures against one real prefill worker process and one real decode worker process
(`kvxfer prefill|decode --provider net --bind-host 127.0.0.1`, loopback):

  TTFT colocated      client time of decode POST /generate_local (max_tokens=1, stream) from
                      the request to its first NDJSON token line: prefill on the decoder itself.
  TTFT disaggregated  client time from decode POST /reserve to the first NDJSON token line
                      of decode POST /generate, with prefill POST /prefill (carrying the
                      reservation) and /generate run concurrently, as the router does.
  per-layer compute   prefill compute time / (layers x chunks): the push is one paged write
                      per layer per 256-token chunk, so this is the time a write has to hide in.
  per-layer transfer  engine duration (submit -> completion) of those writes: mean (and max
                      in the JSON), from the prefill worker's /prefill reply.
  tail                end of prefill compute -> completion of the last write (the mailbox
                      record that carries the first token): the part of the push NOT hidden.
  transfer GB/s       KV bytes / sum of the per-write engine durations: the rate of the
                      link while a layer is in flight (writes do not overlap here: each one
                      finishes long before the next layer's compute ends).
  hidden?             yes when per-layer transfer < per-layer compute and tail < 10% of TTFT.

Goal (issue 3): tail under 10% of the disaggregated TTFT at 4K tokens and above. The run
ends with a verdict line for it and checks correctness: the disaggregated first token
must equal the colocated one at every length (same weights, same 256-token chunking: the
prefill is bit-reproducible).

Method. Both workers are started once, each with its own process group, with
OMP_NUM_THREADS = MKL_NUM_THREADS = --threads (default 1: two workers plus two engine
progress threads already share this 2-core machine, and other jobs may load it too). The
colocated compute runs in the decode worker, the disaggregated compute in the prefill
worker: same model, same thread count, run one after the other, never at the same time.
Per length and repeat: one colocated request, then one disaggregated request (order
alternates between repeats); a 512-token warm-up of both paths is not recorded. Besides
wall times, each measurement records the CPU seconds the computing worker used
(/proc/PID/stat) and the 1-minute load average: on a shared machine the wall-clock TTFT of
the two modes can differ by the load of other jobs, the CPU time does not.

Memory and time. Each worker allocates its whole KV cache up front: 32 layers x N pages x
128 KiB, with N = pages of the longest prompt + 1 (16K tokens -> 1025 pages -> 4.3 GB
per worker, 8.6 GB for both; 8K -> 2.2 GB each). Prefill is O(T^2) attention on a CPU:
on this machine (2 cores, 1 thread per worker) 4K tokens take about 40-60 CPU-seconds, 8K
about 2.5-3 times that, each measured twice (colocated + disaggregated). The default
lengths 512..8192 run in about 10 minutes on an idle machine (longer under load); 16K
tokens is opt-in (--with-16k) and adds roughly 15-20 minutes; --quick (512, 1024, one
repeat) stays under 2 minutes.

  .venv/bin/python benchmarks/bench_disagg_prefill.py             # 512..8192
  .venv/bin/python benchmarks/bench_disagg_prefill.py --quick     # 512, 1024
  .venv/bin/python benchmarks/bench_disagg_prefill.py --with-16k  # + 16384 (needs ~9 GB free)
  .venv/bin/python benchmarks/bench_disagg_prefill.py --lengths 4096 --repeats 3
  .venv/bin/python benchmarks/bench_disagg_prefill.py --lengths 4096 --repeats 3 --kv-integrity full,sampled,off

Integrity cost. `--kv-integrity` takes one mode or several (full, sampled, off: the
decoder's kv_integrity). With several, one decode worker per mode runs beside the one
prefill worker, and each repeat sends the same prompt disaggregated to every one of them
(order rotating), so the modes are compared under the same load in one run. The
integrity table shows, per mode, the disaggregated TTFT, its ratio to `off`, and the
decoder's own check time (`verify_ms` and pages checked, from the transfer receipt). Four
workers at 4K tokens hold 4 x 1.1 GB of KV cache.

Writes <out>/<name>.json and <out>/<name>.png (default benchmarks/results/
bench_disagg_prefill.*) and the workers' logs under <out>/<name>_logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from machine_limits import process_cpu_s  # noqa: E402  (shared helpers of the benchmarks)

KVXFER = str(Path(sys.executable).with_name("kvxfer"))
_SERVING = re.compile(r"serving on (http://[0-9.]+:\d+)")

MODEL = "llama3-8b-kv"
DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192]
QUICK_LENGTHS = [512, 1024]
GOAL_MIN_TOKENS = 4096
GOAL_TAIL_FRACTION = 0.10
CHUNK_TOKENS = 256  # the workers' default prefill_chunk_tokens (WorkerSettings)


# ---- worker processes ---------------------------------------------------------------------

class Worker:
    """One `kvxfer prefill|decode` process in its own process group, logging to a file."""

    def __init__(self, role: str, num_pages: int, provider: str, threads: int, log_dir: Path,
                 same_host: bool, env_extra: dict[str, str] | None = None, name: str | None = None,
                 kvxfer_command: str = KVXFER) -> None:
        self.role = role
        self.name = name or role
        self.log_path = log_dir / f"{self.name}.log"
        self._log = open(self.log_path, "wb")
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            **(env_extra or {}),
        }
        args = [
            kvxfer_command, role, "--port", "0", "--model", MODEL, "--provider", provider,
            "--bind-host", "127.0.0.1", "--num-pages", str(num_pages),
            "--worker-id", f"bench-{self.name}-{os.getpid()}",
            "--same-host" if same_host else "--no-same-host",
        ]
        if role == "decode":
            # A long prompt may take minutes of compute: the decoder must not give up on its KV.
            args += ["--kv-wait-timeout-s", "3600"]
            env["KVXFER_RESERVATION_TTL_S"] = "3600"  # /reserve to admission spans the whole compute
        else:
            # A 32 MiB layer write to a healthy decoder on a loaded 2-core machine can go 0.6 s
            # without a completion: no decoder is stuck here, so no push is failed for that.
            env["KVXFER_DESTINATION_STALL_TIMEOUT_S"] = "10"
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # own process group: killpg reaches everything it spawned
        )
        self.url = ""

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError as exc:
            return f"<log unreadable: {exc}>"

    def wait_ready(self, timeout_s: float) -> None:
        """Waits for the 'serving on' line and GET /ready == 200."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} worker not ready after {timeout_s} s:\n{self.log_tail()}")
            if not self.url:
                m = _SERVING.search(self.log_tail(100_000))
                if m:
                    self.url = m.group(1)
            if self.url:
                try:
                    if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)

    def cpu_s(self) -> float:
        """User + system CPU seconds of the worker process so far (all its threads)."""
        return process_cpu_s(self.proc.pid)

    def rss_bytes(self) -> int:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 10 s; reaps it."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        # The group may hold children even after the leader exited.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


# ---- the two request paths ----------------------------------------------------------------

BOS_ID, EOS_ID = 256, 257  # kvxfer.model.tokenizer (bytes are 0..255)


def prompt_tokens(n: int, seed: int) -> list[int]:
    """A deterministic prompt of n tokens: BOS, then printable ASCII bytes (no EOS)."""
    x = seed * 2654435761 % (1 << 32) or 1
    out = [BOS_ID]
    while len(out) < n:
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(32 + (x >> 16) % 95)
    return out[:n]


async def _first_token(resp: httpx.Response, t0: float) -> tuple[int, float, dict[str, Any]]:
    """Reads an NDJSON token stream; returns (first token, seconds to its line, final record).

    A first token that is EOS is not streamed (the stream is just the done line, with
    finish_reason "stop"): then the done line's time is the TTFT and the token is EOS_ID.
    """
    if resp.status_code != 200:
        body = (await resp.aread()).decode(errors="replace")
        raise RuntimeError(f"HTTP {resp.status_code} from {resp.request.url.path}: {body[:500]}")
    first: int | None = None
    ttft = float("nan")
    last: dict[str, Any] = {}
    async for line in resp.aiter_lines():
        if not line.strip():
            continue
        item = json.loads(line)
        if "token" in item and first is None:
            ttft = time.monotonic() - t0
            first = int(item["token"])
        last = item
    if last.get("finish_reason") == "error" or not last.get("done"):
        raise RuntimeError(f"generation failed: {last}")
    if first is None:
        if last.get("finish_reason") != "stop":
            raise RuntimeError(f"stream ended without a token: {last}")
        first, ttft = EOS_ID, time.monotonic() - t0
    return first, ttft, last


async def run_colocated(client: httpx.AsyncClient, decode: Worker, tokens: list[int], timeout: httpx.Timeout) -> dict[str, Any]:
    rid = f"bench-col-{uuid.uuid4().hex[:10]}"
    body = {"request_id": rid, "prompt_tokens": tokens, "max_tokens": 1, "stream": True}
    cpu0 = decode.cpu_s()
    t0 = time.monotonic()
    async with client.stream("POST", f"{decode.url}/generate_local", json=body, timeout=timeout) as resp:
        first, ttft, _ = await _first_token(resp, t0)
    return {"first_token": first, "ttft_ms": ttft * 1e3, "cpu_s": decode.cpu_s() - cpu0}


async def run_disaggregated(
    client: httpx.AsyncClient, prefill: Worker, decode: Worker, decode_engine: str, tokens: list[int],
    timeout: httpx.Timeout, control_timeout_s: float,
) -> dict[str, Any]:
    rid = f"bench-dis-{uuid.uuid4().hex[:10]}"
    cpu0 = prefill.cpu_s()
    t0 = time.monotonic()
    resp = await client.post(f"{decode.url}/reserve", json={"request_id": rid, "prompt_tokens": tokens, "max_tokens": 1},
                             timeout=control_timeout_s)
    if resp.status_code != 200:
        raise RuntimeError(f"/reserve: HTTP {resp.status_code}: {resp.text[:500]}")
    reservation = resp.json()
    reserve_ms = (time.monotonic() - t0) * 1e3

    async def prefill_leg() -> dict[str, Any]:
        r = await client.post(f"{prefill.url}/prefill", json={
            "request_id": rid, "prompt_tokens": tokens,
            "decode": {"engine_address": decode_engine, **reservation},
        }, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"/prefill: HTTP {r.status_code}: {r.text[:500]}")
        return {**r.json(), "replied_at": time.monotonic()}

    async def generate_leg() -> tuple[int, float, dict[str, Any]]:
        body = {"request_id": rid, "stream": True, "timeout_s": timeout.read or 3600.0}
        async with client.stream("POST", f"{decode.url}/generate", json=body, timeout=timeout) as r:
            receipt["header"] = r.headers.get("X-Kvxfer-Transfer-Receipt", "")
            return await _first_token(r, t0)

    receipt: dict[str, str] = {}

    p_task = asyncio.ensure_future(prefill_leg())
    g_task = asyncio.ensure_future(generate_leg())
    try:
        (first, ttft, _), pre = await asyncio.gather(g_task, p_task)
    except BaseException:
        for task in (p_task, g_task):
            task.cancel()
        await asyncio.gather(p_task, g_task, return_exceptions=True)
        for url in (prefill.url, decode.url):  # best effort: free pages on both sides
            try:
                await client.post(f"{url}/cancel", json={"request_id": rid}, timeout=control_timeout_s)
            except httpx.HTTPError:
                pass
        raise
    return {
        "first_token": first,
        "prefill_first_token": pre["first_token"],
        "ttft_ms": ttft * 1e3,
        "reserve_ms": reserve_ms,
        "prefill_reply_ms": (pre["replied_at"] - t0) * 1e3,
        "cpu_s": prefill.cpu_s() - cpu0,
        "prefill": {k: v for k, v in pre.items() if k not in ("replied_at", "request_id")},
        # The decoder's transfer receipt: verdict and verify_ms (its check's share of TTFT).
        "receipt": receipt.get("header", ""),
    }


# ---- orchestration ------------------------------------------------------------------------

def cost_units(tokens: int) -> float:
    """Relative compute cost of a prefill, for the progress bar's ETA: linear layers plus
    O(T^2) attention, fitted on this machine (1024 tokens: ~6 CPU-s, 4096: ~48 CPU-s);
    1 unit = a 512-token prefill."""
    def cost(t: int) -> float:
        return t * (1 + t / 1760)
    return cost(tokens) / cost(512)


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def cache_bytes(num_pages: int) -> int:
    # 32 layers x pages x (2 x 16 tokens x 8 heads x 128 dims x 4 bytes) = 128 KiB per page.
    return 32 * num_pages * (2 * 16 * 8 * 128 * 4)


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def summarize(length: int, col: list[dict[str, Any]], dis: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row: medians over repeats."""
    def pre(key: str) -> list[float]:
        return [d["prefill"][key] for d in dis]

    ttft_col = median([c["ttft_ms"] for c in col])
    ttft_dis = median([d["ttft_ms"] for d in dis])
    tail = median(pre("transfer_tail_ms"))
    kv_bytes = dis[0]["prefill"]["kv_bytes"]
    writes = dis[0]["prefill"]["writes"]
    layer_compute = median(pre("layer_compute_ms_mean"))
    layer_transfer = median(pre("layer_transfer_ms_mean"))
    # Bytes-weighted link rate while a write is in flight: kv_bytes / sum of write durations.
    write_gbps = median([d["prefill"]["kv_bytes"] / (d["prefill"]["layer_transfer_ms_mean"] * d["prefill"]["writes"] / 1e3) / 1e9
                         for d in dis if d["prefill"]["layer_transfer_ms_mean"] > 0])
    tail_frac = tail / ttft_dis if ttft_dis > 0 else float("nan")
    return {
        "prompt_tokens": length,
        "repeats": len(dis),
        "ttft_colocated_ms": ttft_col,
        "ttft_disaggregated_ms": ttft_dis,
        "overhead_pct": (ttft_dis - ttft_col) / ttft_col * 100 if ttft_col > 0 else float("nan"),
        "cpu_colocated_s": median([c["cpu_s"] for c in col]),
        "cpu_disaggregated_s": median([d["cpu_s"] for d in dis]),
        "prefill_compute_ms": median(pre("prefill_ms")),
        # Everything in the disaggregated TTFT that is not /reserve or compute: /prefill
        # request handling, the transfer tail, decode admission and the first token line.
        "not_compute_ms": median([d["ttft_ms"] - d["reserve_ms"] - d["prefill"]["prefill_ms"] for d in dis]),
        "reserve_ms": median([d["reserve_ms"] for d in dis]),
        "chunks": dis[0]["prefill"]["chunks"],
        "writes": writes,
        "layer_compute_ms": layer_compute,
        "layer_transfer_ms": layer_transfer,
        "layer_transfer_max_ms": median(pre("layer_transfer_ms_max")),
        "layer_submit_ms": median(pre("layer_submit_ms_mean")),
        "mailbox_write_ms": median(pre("mailbox_write_ms")),
        "tail_ms": tail,
        "tail_engine_ms": median(pre("transfer_tail_engine_ms")),
        "tail_pct_of_ttft": tail_frac * 100,
        "kv_bytes": kv_bytes,
        "kv_mb": kv_bytes / 1e6,
        "transfer_gbps": write_gbps,
        "transfer_span_ms": median(pre("transfer_ms")),
        "hidden": bool(layer_transfer < layer_compute and tail_frac < GOAL_TAIL_FRACTION),
        "first_token_colocated": col[0]["first_token"],
        "first_token_disaggregated": dis[0]["first_token"],
        "first_token_match": all(c["first_token"] == col[0]["first_token"] for c in col)
        and all(d["first_token"] == col[0]["first_token"] and d["prefill_first_token"] == col[0]["first_token"] for d in dis),
        "load_1m": median([m["load_1m"] for m in col + dis]),
    }


COLUMNS = [
    ("tokens", "prompt_tokens", "{:d}"),
    ("TTFT col ms", "ttft_colocated_ms", "{:.0f}"),
    ("TTFT dis ms", "ttft_disaggregated_ms", "{:.0f}"),
    ("overhead %", "overhead_pct", "{:+.1f}"),
    ("layer compute ms", "layer_compute_ms", "{:.2f}"),
    ("layer xfer ms", "layer_transfer_ms", "{:.2f}"),
    ("tail ms", "tail_ms", "{:.2f}"),
    ("tail % TTFT", "tail_pct_of_ttft", "{:.3f}"),
    ("KV MB", "kv_mb", "{:.0f}"),
    ("xfer GB/s", "transfer_gbps", "{:.2f}"),
    ("hidden?", "hidden", None),
]


DETAIL_COLUMNS = [
    ("tokens", "prompt_tokens", "{:d}"),
    ("CPU col s", "cpu_colocated_s", "{:.1f}"),
    ("CPU dis s", "cpu_disaggregated_s", "{:.1f}"),
    ("prefill compute ms", "prefill_compute_ms", "{:.0f}"),
    ("reserve ms", "reserve_ms", "{:.1f}"),
    ("TTFT-reserve-compute ms", "not_compute_ms", "{:.1f}"),
    ("tail (engine) ms", "tail_engine_ms", "{:.2f}"),
    ("mailbox ms", "mailbox_write_ms", "{:.2f}"),
    ("xfer max ms", "layer_transfer_max_ms", "{:.1f}"),
    ("writes", "writes", "{:d}"),
    ("load 1m", "load_1m", "{:.1f}"),
]


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str | None]] = COLUMNS) -> str:
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        line = []
        for _, key, fmt in columns:
            v = r[key]
            line.append(("yes" if v else "no") if fmt is None else fmt.format(v))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for n, c in enumerate(cells):
        out.append("  ".join(s.rjust(w) for s, w in zip(c, widths)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def verdict(rows: list[dict[str, Any]]) -> tuple[str, bool | None]:
    big = [r for r in rows if r["prompt_tokens"] >= GOAL_MIN_TOKENS]
    if not big:
        return (f"GOAL not evaluated: no prompt length >= {GOAL_MIN_TOKENS} tokens in this run", None)
    ok = all(r["tail_pct_of_ttft"] < GOAL_TAIL_FRACTION * 100 for r in big)
    worst = max(big, key=lambda r: r["tail_pct_of_ttft"])
    return (
        f"GOAL {'MET' if ok else 'NOT MET'}: transfer tail < {GOAL_TAIL_FRACTION:.0%} of TTFT at >= {GOAL_MIN_TOKENS} tokens "
        f"(worst {worst['tail_pct_of_ttft']:.3f}% at {worst['prompt_tokens']} tokens: tail {worst['tail_ms']:.2f} ms "
        f"of {worst['ttft_disaggregated_ms']:.0f} ms)",
        ok,
    )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompt_tokens"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    ax1.plot(x, [r["ttft_colocated_ms"] for r in rows], "o-", label="TTFT colocated")
    ax1.plot(x, [r["ttft_disaggregated_ms"] for r in rows], "s-", label="TTFT disaggregated")
    ax1.plot(x, [max(r["tail_ms"], 1e-3) for r in rows], "^:", label="transfer tail (not hidden)")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(x, [str(v) for v in x])
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("ms")
    ax1.set_title("TTFT: colocated vs disaggregated")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()

    ax2.plot(x, [r["layer_compute_ms"] for r in rows], "o-", label="per-layer compute (256-token chunk)")
    ax2.plot(x, [r["layer_transfer_ms"] for r in rows], "s-", label="per-layer transfer (mean)")
    ax2.plot(x, [r["layer_transfer_max_ms"] for r in rows], "s--", alpha=0.6, label="per-layer transfer (max)")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xticks(x, [str(v) for v in x])
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("ms per layer per chunk")
    ax2.set_title("per-layer compute vs transfer")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def measure(args: argparse.Namespace, prefill: Worker, decoders: dict[str, Worker], lengths: list[int],
                  pbar: Any) -> dict[int, dict[str, Any]]:
    """Per length: colocated runs (on the first mode's decoder) and, per integrity mode,
    disaggregated runs; each repeat visits every mode, in an order that rotates."""
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    engines = {mode: httpx.get(f"{d.url}/info", timeout=10.0).json()["engine_address"] for mode, d in decoders.items()}
    modes = list(decoders)
    colocated_on = decoders[modes[0]]
    results: dict[int, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        # Warm-up of every path (connections, engine peer setup, allocator): not recorded.
        warm = prompt_tokens(min(512, min(lengths)), seed=99)
        pbar.set_postfix_str("warm-up")
        await run_colocated(client, colocated_on, warm, timeout)
        for mode, decode in decoders.items():
            await run_disaggregated(client, prefill, decode, engines[mode], warm, timeout, args.control_timeout_s)
        pbar.update(1)
        for length in lengths:
            tokens = prompt_tokens(length, seed=length)
            col: list[dict[str, Any]] = []
            dis: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            steps = ["col", *modes]
            for rep in range(args.repeats):
                shift = rep % len(steps)
                for step in steps[shift:] + steps[:shift]:
                    what = "colocated" if step == "col" else f"disaggregated, kv_integrity={step}"
                    pbar.set_postfix_str(f"{length} tokens, {what} #{rep + 1}")
                    load = os.getloadavg()[0]
                    if step == "col":
                        m = await run_colocated(client, colocated_on, tokens, timeout)
                        col.append(m)
                    else:
                        m = await run_disaggregated(client, prefill, decoders[step], engines[step], tokens, timeout,
                                                    args.control_timeout_s)
                        dis[step].append(m)
                    m["load_1m"] = load
                    m["mode"] = "col" if step == "col" else "dis"
                    m["kv_integrity"] = None if step == "col" else step
                    m["repeat"] = rep
                    pbar.update(cost_units(length))
            results[length] = {"colocated": col, "disaggregated": dis}
    return results


def parse_receipt(header: str) -> dict[str, str]:
    """The decoder's X-Kvxfer-Transfer-Receipt as a dict ({} when there was none)."""
    return dict(part.split("=", 1) for part in header.split(";") if "=" in part)


def integrity_rows(rows: list[dict[str, Any]], raw: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (length, mode): disaggregated TTFT, its ratio to `off` of the same length and run,
    and the decoder's check (verify_ms, pages checked) from the receipts."""
    out = []
    for row in rows:
        length, mode = row["prompt_tokens"], row["kv_integrity"]
        receipts = [parse_receipt(d["receipt"]) for d in raw[length]["disaggregated"][mode]]
        off = next((r for r in rows if r["prompt_tokens"] == length and r["kv_integrity"] == "off"), None)
        out.append({
            "prompt_tokens": length,
            "kv_integrity": mode,
            "ttft_disaggregated_ms": row["ttft_disaggregated_ms"],
            "ttft_vs_off": row["ttft_disaggregated_ms"] / off["ttft_disaggregated_ms"] if off else float("nan"),
            "verify_ms": median([float(r.get("verify_ms", "nan")) for r in receipts]),
            "pages_checked": int(median([float(r.get("pages_checked", 0)) for r in receipts])),
            "verify_pct_of_ttft": median([float(r.get("verify_ms", "nan")) for r in receipts])
            / row["ttft_disaggregated_ms"] * 100,
            "verdict": receipts[0].get("verdict", "?") if receipts else "?",
            "cpu_disaggregated_s": row["cpu_disaggregated_s"],
            "load_1m": row["load_1m"],
        })
    return out


INTEGRITY_COLUMNS = [
    ("tokens", "prompt_tokens", "{:d}"),
    ("kv_integrity", "kv_integrity", "{}"),
    ("TTFT dis ms", "ttft_disaggregated_ms", "{:.0f}"),
    ("TTFT / off", "ttft_vs_off", "{:.3f}"),
    ("verify ms", "verify_ms", "{:.2f}"),
    ("verify % TTFT", "verify_pct_of_ttft", "{:.3f}"),
    ("pages checked", "pages_checked", "{:d}"),
    ("receipt verdict", "verdict", "{}"),
    ("CPU dis s", "cpu_disaggregated_s", "{:.1f}"),
    ("load 1m", "load_1m", "{:.1f}"),
]


def plot_integrity(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per length: disaggregated TTFT and the decoder's verify time, one bar per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in rows})
    modes = list(dict.fromkeys(r["kv_integrity"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(lengths))]
        by_len = {r["prompt_tokens"]: r for r in rows if r["kv_integrity"] == mode}
        ax1.bar(xs, [by_len[n]["ttft_disaggregated_ms"] for n in lengths], width, label=mode)
        ax2.bar(xs, [by_len[n]["verify_ms"] for n in lengths], width, label=mode)
    for ax, ylabel, what in ((ax1, "ms", "disaggregated TTFT"), (ax2, "ms", "decoder verify time (receipt)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{what} by kv_integrity")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not modes or any(m not in ("off", "sampled", "full") for m in modes):
        raise argparse.ArgumentTypeError(f"kv_integrity modes are off, sampled, full (comma-separated): {text!r}")
    return modes


def parse_lengths(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or values[0] < 1 or values[-1] > 32767:
        raise argparse.ArgumentTypeError("prompt lengths must lie in 1..32767")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lengths", "--max-tokens-list", dest="lengths", type=parse_lengths,
                        help="comma-separated prompt lengths in tokens (default 512,1024,2048,4096,8192)")
    parser.add_argument("--with-16k", action="store_true",
                        help="add 16384 tokens: 2 x 4.3 GB KV caches and roughly 15-20 more minutes")
    parser.add_argument("--quick", action="store_true", help="512 and 1024 tokens, 1 repeat: under 2 minutes")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measurements per length and mode; the table shows medians (default 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP/MKL threads of each worker, the same for both modes (default 1)")
    parser.add_argument("--provider", default="net", help="libfabric provider of both workers (default net)")
    parser.add_argument("--same-host", action="store_true",
                        help="let the workers use the engine's same-host path (memcpy into the "
                             "decoder's mapped KV cache) instead of the provider, as co-located "
                             "workers do by default; off here so the push crosses the provider "
                             "as it would between machines")
    parser.add_argument("--request-timeout-s", type=float, default=1800.0,
                        help="read timeout of /prefill, /generate and /generate_local (default 1800)")
    parser.add_argument("--control-timeout-s", type=float, default=30.0,
                        help="timeout of /reserve, /cancel and /info (default 30)")
    parser.add_argument("--startup-timeout-s", type=float, default=180.0, help="worker start deadline (default 180)")
    parser.add_argument("--kv-registration", choices=("per_reservation", "whole_cache"), default="per_reservation",
                        help="the decode workers' kv_registration (default per_reservation); compare runs with --name")
    parser.add_argument("--kv-integrity", type=parse_modes, default=["full"],
                        help="the decode worker's kv_integrity: off, sampled, full, or several comma-separated "
                             "(one decode worker each, compared in one run; default full)")
    parser.add_argument("--kvxfer-command", default=KVXFER,
                        help="the `kvxfer` command that starts both workers (default: this environment's); "
                             "benchmarks/kvxfer_at_commit.sh COMMIT DIR makes DIR/kvxfer-before, an earlier "
                             "commit's build, for old-against-new runs taking turns with --name")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output directory (default benchmarks/results)")
    parser.add_argument("--name", default="bench_disagg_prefill", help="output file stem (default bench_disagg_prefill)")
    args = parser.parse_args(argv)

    if args.quick:
        lengths = args.lengths or QUICK_LENGTHS
        args.repeats = 1
    else:
        lengths = args.lengths or list(DEFAULT_LENGTHS)
    if args.with_16k and 16384 not in lengths:
        lengths = sorted(lengths + [16384])
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")

    # Pages per layer-row: the longest prompt + its one generated token, plus one spare.
    num_pages = math.ceil((max(lengths) + 1) / 16) + 1
    per_worker = cache_bytes(num_pages)
    n_workers = 1 + len(args.kv_integrity)
    need = n_workers * (per_worker + 600 * 2**20) + 1 * 2**30  # caches + ~600 MiB per process + 1 GiB margin
    avail = mem_available_bytes()
    if avail and need > avail:
        print(f"not enough memory for {max(lengths)} tokens: {n_workers} KV caches of {per_worker / 1e9:.1f} GB "
              f"(+ workers) need ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available; drop the longest length",
              file=sys.stderr)
        return 2

    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / f"{args.name}_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    print(f"{MODEL}: lengths {lengths}, repeats {args.repeats}, {args.threads} thread(s) per worker, "
          f"{num_pages} pages/layer ({per_worker / 1e9:.2f} GB KV cache per worker), provider {args.provider}")
    print(f"uptime: {uptime_start}")
    workers: list[Worker] = []
    started = time.monotonic()
    # SIGTERM (e.g. `timeout`) must still reach the finally below that kills the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        prefill = Worker("prefill", num_pages, args.provider, args.threads, log_dir, args.same_host,
                         kvxfer_command=args.kvxfer_command)
        workers.append(prefill)
        decoders: dict[str, Worker] = {}
        for mode in args.kv_integrity:
            name = "decode" if len(args.kv_integrity) == 1 else f"decode-{mode}"
            decoders[mode] = Worker("decode", num_pages, args.provider, args.threads, log_dir, args.same_host,
                                    env_extra={"KVXFER_KV_INTEGRITY": mode,
                                                "KVXFER_KV_REGISTRATION": args.kv_registration}, name=name,
                                    kvxfer_command=args.kvxfer_command)
            workers.append(decoders[mode])
        for w in workers:
            w.wait_ready(args.startup_timeout_s)
        rss = {w.name: w.rss_bytes() for w in workers}
        total = 1 + args.repeats * (1 + len(decoders)) * sum(cost_units(n) for n in lengths)
        with tqdm(total=total, unit="req512", bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}",
                  file=sys.stderr) as pbar:
            raw = asyncio.run(measure(args, prefill, decoders, lengths, pbar))
    finally:
        for w in reversed(workers):
            w.stop()
    elapsed = time.monotonic() - started
    uptime_end = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()

    all_rows = [{**summarize(n, raw[n]["colocated"], raw[n]["disaggregated"][mode]), "kv_integrity": mode}
                for n in lengths for mode in args.kv_integrity]
    # The main table is the first mode's (as a one-mode run shows it); every mode has an
    # integrity row.
    rows = [r for r in all_rows if r["kv_integrity"] == args.kv_integrity[0]]
    checks = integrity_rows(all_rows, raw)
    table = format_table(rows)
    line, goal = verdict(rows)
    all_match = all(r["first_token_match"] for r in all_rows)
    print()
    print(f"kv_integrity {args.kv_integrity[0]}:")
    print(table)
    print()
    print("integrity cost (disaggregated TTFT per decoder kv_integrity, same run; verify = the decoder's check):")
    print(format_table(checks, INTEGRITY_COLUMNS))
    print()
    print("detail (CPU s = CPU seconds of the computing worker; load-independent, unlike wall times):")
    print(format_table(rows, DETAIL_COLUMNS))
    print()
    print(f"correctness: disaggregated first token {'==' if all_match else '!='} colocated first token "
          f"at {'every' if all_match else 'NOT every'} length "
          f"({', '.join(str(r['first_token_disaggregated']) for r in rows)})")
    print(line)
    print(f"uptime at end: {uptime_end}  (run took {elapsed:.0f} s)")

    result = {
        "benchmark": "bench_disagg_prefill",
        "model": MODEL,
        "kv": {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "float32", "block_size": 16,
               "page_bytes": 128 * 1024, "chunk_tokens": CHUNK_TOKENS},
        "provider": args.provider,
        "kv_integrity": args.kv_integrity,
        "kv_registration": args.kv_registration,
        "integrity": checks,
        "same_host": args.same_host,
        "threads_per_worker": args.threads,
        "num_pages_per_layer": num_pages,
        "kv_cache_bytes_per_worker": per_worker,
        "worker_rss_bytes_at_start": rss,
        "lengths": lengths,
        "repeats": args.repeats,
        "uptime_start": uptime_start,
        "uptime_end": uptime_end,
        "loadavg_end": list(os.getloadavg()),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "elapsed_s": elapsed,
        "goal": {"rule": f"tail < {GOAL_TAIL_FRACTION:.0%} of disaggregated TTFT at >= {GOAL_MIN_TOKENS} tokens",
                 "met": goal, "verdict": line},
        "first_tokens_match": all_match,
        "rows": all_rows,
        "raw": {str(n): raw[n] for n in lengths},
        "definitions": {
            "ttft_colocated_ms": "client: decode POST /generate_local (max_tokens=1, stream) -> first NDJSON token line",
            "ttft_disaggregated_ms": "client: decode POST /reserve -> first NDJSON token line of decode /generate "
                                     "(prefill /prefill and /generate concurrent)",
            "layer_compute_ms": "prefill compute / (layers x 256-token chunks)",
            "layer_transfer_ms": "mean engine duration (submit -> completion) of the per-(layer, chunk) paged writes",
            "tail_ms": "prefill worker: end of compute -> all writes (incl. the mailbox record) complete",
            "tail_engine_ms": "same, by the engine's completion timestamp (no waiter wake-up)",
            "transfer_gbps": "kv_bytes / sum of per-write engine durations (1 GB = 1e9 bytes)",
            "cpu_*_s": "CPU seconds of the computing worker process during the request (/proc/PID/stat)",
            "hidden": "layer_transfer_ms < layer_compute_ms and tail < 10% of disaggregated TTFT",
        },
    }
    json_path = args.out / f"{args.name}.json"
    png_path = args.out / f"{args.name}.png"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    title = (f"kvxfer disaggregated prefill, {MODEL} (128 KiB pages, 256-token chunks), "
             f"{args.provider} loopback, {args.threads} thread/worker; {uptime_start}")
    if len(args.kv_integrity) > 1:
        plot_integrity(checks, png_path, title)
    else:
        plot(rows, png_path, title)
    print(f"wrote {json_path} and {png_path}")
    if not all_match:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
