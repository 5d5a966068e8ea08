"""Does one stuck decoder slow the prefill worker's pushes to a healthy one?

One prefill worker, a healthy decode worker B and a victim decode worker A (real
`kvxfer prefill|decode` processes, net provider on loopback, same-host path off so the KV
crosses the fabric). Client loops send long prompts disaggregated to B back to back:

  baseline      completions/s to B for --window-s, nothing else going on;
  stuck         the same, while A is frozen (SIGSTOP) or killed and --stuck pushes to it
                were queued at the prefiller just before the window.

The ratio stuck/baseline (1.0: no effect) is the figure; both windows are measured in the
same run on the same processes, so the machine's load affects both. Per build (`--builds
name=/path/to/kvxfer,...`, e.g. main's venv against this branch's) the run also records
how long the stuck pushes took to fail. Writes <out>/<name>.json and .png.

  .venv/bin/python benchmarks/bench_peer_isolation.py
  .venv/bin/python benchmarks/bench_peer_isolation.py --builds before=/work/main/.venv/bin/kvxfer,after=.venv/bin/kvxfer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_limits import process_cpu_s  # noqa: E402  (shared helpers of the benchmarks)

_SERVING = re.compile(r"serving on (http://[0-9.]+:\d+)")
BOS = 256


class Worker:
    """One worker process in its own process group, logging to a file."""

    def __init__(self, kvxfer: str, role: str, name: str, log_dir: Path, env: dict[str, str]) -> None:
        self.role, self.name = role, name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVXFER_")},
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "KVXFER_SAME_HOST": "false", **env}
        self.proc = subprocess.Popen(
            [kvxfer, role, "--port", "0", "--provider", "net", "--host", "127.0.0.1", "--bind-host", "127.0.0.1",
             "--num-pages", "1024"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True,
        )
        self.url = ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s} s")
            if not self.url:
                m = _SERVING.search(self.log_path.read_text(errors="replace"))
                self.url = m.group(1) if m else ""
            if self.url:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)
        self._log.close()


def prompt(n: int, seed: int) -> list[int]:
    x = seed * 2654435761 % (1 << 32) or 1
    out = [BOS]
    while len(out) < n:
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(32 + (x >> 16) % 95)
    return out


async def reserve(client: httpx.AsyncClient, decode: Worker, rid: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    r = await client.post(f"{decode.url}/reserve", json={"request_id": rid, "prompt_tokens": tokens,
                                                          "max_tokens": max_tokens})
    r.raise_for_status()
    return {k: v for k, v in r.json().items() if k != "request_id"}


async def one_request(client: httpx.AsyncClient, prefill: Worker, decode: Worker, tokens: list[int],
                      max_tokens: int) -> bool:
    rid = f"b-{uuid.uuid4().hex[:10]}"
    res = await reserve(client, decode, rid, tokens, max_tokens)
    pre, gen = await asyncio.gather(
        client.post(f"{prefill.url}/prefill", json={"request_id": rid, "prompt_tokens": tokens, "decode": res}),
        client.post(f"{decode.url}/generate", json={"request_id": rid, "stream": False}),
    )
    return pre.status_code == 200 and gen.status_code == 200


TIMELINE_STEP_S = 0.5  # width of one bucket of a window's completion timeline


async def window(client: httpx.AsyncClient, prefill: Worker, decode: Worker, args: argparse.Namespace) -> dict[str, Any]:
    """Closed loops to `decode` for args.window_s: completions that finished inside it, how
    they spread over the window (per TIMELINE_STEP_S), and the prefiller's CPU seconds."""
    cpu_before = process_cpu_s(prefill.proc.pid)
    start = time.monotonic()
    until = start + args.window_s
    done: list[float] = []
    failed = 0

    async def loop(i: int) -> None:
        nonlocal failed
        n = 0
        while time.monotonic() < until:
            ok = await one_request(client, prefill, decode, prompt(args.prompt_tokens, 1000 * i + n), args.max_tokens)
            n += 1
            if ok:
                done.append(time.monotonic())
            else:
                failed += 1

    await asyncio.gather(*(loop(i) for i in range(args.loops)))
    inside = [t for t in done if t <= until]
    timeline = [0] * max(1, round(args.window_s / TIMELINE_STEP_S))
    for t in inside:
        timeline[min(len(timeline) - 1, int((t - start) / TIMELINE_STEP_S))] += 1
    return {"completed": len(inside), "per_s": len(inside) / args.window_s, "failed": failed,
            "timeline": timeline, "prefill_cpu_s": process_cpu_s(prefill.proc.pid) - cpu_before}


async def measure_build(name: str, kvxfer: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    env_p = {"KVXFER_TRANSFER_TIMEOUT_S": str(args.transfer_timeout_s)}
    env_d = {"KVXFER_FENCE_TIMEOUT_S": str(args.transfer_timeout_s + 2)}
    workers = [Worker(kvxfer, "decode", f"{name}-victim", log_dir, env_d),
               Worker(kvxfer, "decode", f"{name}-healthy", log_dir, env_d),
               Worker(kvxfer, "prefill", f"{name}-prefill", log_dir, env_p)]
    victim, healthy, prefill = workers
    try:
        for w in workers:
            w.wait_ready(120)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
            await one_request(client, prefill, healthy, prompt(args.prompt_tokens, 7), args.max_tokens)  # warm-up
            baseline = await window(client, prefill, healthy, args)
            reservations = [await reserve(client, victim, f"stuck-{i}", prompt(args.prompt_tokens, 90 + i),
                                          args.max_tokens) for i in range(args.stuck)]
            victim.signal(signal.SIGSTOP if args.fault == "frozen" else signal.SIGKILL)

            async def stuck_push(i: int) -> tuple[int, float]:
                t0 = time.monotonic()
                r = await client.post(f"{prefill.url}/prefill", json={
                    "request_id": f"stuck-{i}", "prompt_tokens": prompt(args.prompt_tokens, 90 + i),
                    "decode": reservations[i]})
                return r.status_code, time.monotonic() - t0

            tasks = [asyncio.create_task(stuck_push(i)) for i in range(args.stuck)]
            await asyncio.sleep(0.05)
            stuck = await window(client, prefill, healthy, args)
            pushes = await asyncio.gather(*tasks)
    finally:
        for w in workers:
            w.stop()
    return {
        "build": name, "kvxfer": kvxfer, "baseline": baseline, "stuck": stuck,
        "ratio": stuck["per_s"] / baseline["per_s"] if baseline["per_s"] else float("nan"),
        "stuck_push_status": [s for s, _ in pushes],
        "stuck_push_fail_s_max": max(t for _, t in pushes),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ["build", "baseline req/s", f"with A {ROWS_FAULT[0]} req/s", "ratio", "stuck pushes", "slowest fail s",
            "prefill CPU s (base/stuck)"]
    cells = [head] + [[r["build"], f"{r['baseline']['per_s']:.2f}", f"{r['stuck']['per_s']:.2f}", f"{r['ratio']:.2f}",
                       ",".join(str(s) for s in r["stuck_push_status"]), f"{r['stuck_push_fail_s_max']:.2f}",
                       f"{r['baseline']['prefill_cpu_s']:.1f}/{r['stuck']['prefill_cpu_s']:.1f}"]
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(s.rjust(w) for s, w in zip(c, widths)) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


ROWS_FAULT = ["frozen"]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["baseline"]["per_s"] for r in rows], 0.4, label="baseline")
    ax.bar([x + 0.2 for x in xs], [r["stuck"]["per_s"] for r in rows], 0.4, label=f"other decoder {ROWS_FAULT[0]}")
    ax.set_xticks(list(xs), [r["build"] for r in rows])
    ax.set_ylabel("completions/s to the healthy decoder")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", default=f"branch={Path(sys.executable).with_name('kvxfer')}",
                        help="comma-separated name=/path/to/kvxfer (default: this venv's)")
    parser.add_argument("--fault", choices=("frozen", "killed"), default="frozen")
    parser.add_argument("--window-s", type=float, default=6.0)
    parser.add_argument("--stuck", type=int, default=3, help="pushes queued to the stuck decoder")
    parser.add_argument("--loops", type=int, default=2, help="concurrent client loops to the healthy decoder")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--transfer-timeout-s", type=float, default=6.0, help="the prefiller's per-write deadline")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--name", default="bench_peer_isolation")
    args = parser.parse_args(argv)
    ROWS_FAULT[0] = args.fault
    builds = [b.split("=", 1) for b in args.builds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / f"{args.name}_logs"
    log_dir.mkdir(exist_ok=True)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    rows = [asyncio.run(measure_build(name, path, args, log_dir)) for name, path in builds]
    print(table(rows))
    for r in rows:
        for which in ("baseline", "stuck"):
            print(f"{r['build']} {which:8s} completions per {TIMELINE_STEP_S} s: {r[which]['timeline']}")
    print(f"uptime at start: {uptime}")
    result = {"benchmark": "bench_peer_isolation", "args": {k: str(v) for k, v in vars(args).items()},
              "host": {"platform": platform.platform(), "cpus": os.cpu_count()}, "uptime_start": uptime,
              "loadavg_end": list(os.getloadavg()), "rows": rows}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out / f"{args.name}.png", f"healthy-decoder throughput beside a {args.fault} one; {uptime}")
    print(f"wrote {args.out / (args.name + '.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
