"""What an engine costs between transfers: idle with a live connection, and 4 KiB writes spaced apart.

Two processes per provider (net, tcp, shm over 127.0.0.1, the same-host path off): a
writer and a target. First --writes single 4 KiB writes at each of --gaps-ms (0: back to
back; 1 and 5 ms: a prefiller pushing a layer at a time with compute in between), one at a
time, each timed from submit until the writer saw it complete (delivery-complete: the
target holds the bytes). Then both sit idle: after --settle-s, their CPU and their progress
workers' wake-ups (engine_stats()["worker_wakeups"]) over --idle-s.

CPU per write and idle CPU are both processes' (all threads, /proc/PID/stat). With
--before DIR (a tree made by `benchmarks/kvxfer_at_commit.sh COMMIT DIR`) every
measurement also runs with that build, the two taking turns per provider, so the machine's
phases fall on both alike. Builds without the wake-up counter show `-` there.

Prints a table, writes JSON and a PNG.

    .venv/bin/python benchmarks/bench_idle.py [--providers net,tcp,shm] [--gaps-ms 0,1,2,5,20] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from report import parser_from_doc, pyplot, save_figure  # noqa: E402

WRITE_BYTES = 4096
WAIT_S = 10.0  # one write between healthy local processes
CHILD_TIMEOUT_S = 300.0  # one provider's measurement, every gap and the idle spell
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
THIS = Path(__file__).resolve()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of process `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def wakeups(stats: dict[str, int]) -> int | None:
    return stats.get("worker_wakeups")


def python_for(before: Path | None) -> list[str]:
    """The command that runs this script with this checkout's kvxfer, or with the one in
    `before` (this venv's finder for the editable install taken out, as the launcher of
    kvxfer_at_commit.sh does)."""
    if before is None:
        return [sys.executable, str(THIS)]
    code = ("import sys, runpy; "
            "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != 'ScikitBuildRedirectingFinder']; "
            f"sys.path.insert(0, {str(before)!r}); "
            "import kvxfer, kvxfer._native; "
            f"assert kvxfer._native.__file__.startswith({str(before)!r}), kvxfer._native.__file__; "
            f"sys.argv = [{str(THIS)!r}] + sys.argv[1:]; "
            f"runpy.run_path({str(THIS)!r}, run_name='__main__')")
    return [sys.executable, "-c", code]


def run_target(provider: str) -> None:
    """The target: registers a region, prints its descriptor, answers `stats` lines with its
    engine counters, and ends at `quit`."""
    import numpy as np

    from kvxfer.transfer.engine import TransferEngine

    with TransferEngine(provider, bind_host="127.0.0.1", same_host=False) as engine:
        region = engine.register(np.zeros(1 << 20, dtype=np.uint8))
        print(json.dumps({"descriptor": region.descriptor.hex()}), flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            print(json.dumps(engine.engine_stats()), flush=True)


def run_writer(provider: str, gaps_ms: list[float], writes: int, settle_s: float, idle_s: float,
               python: list[str]) -> dict[str, Any]:
    """The writer, with its target as a child: every gap's writes, then the idle spell."""
    import numpy as np

    from kvxfer.transfer.engine import TransferEngine

    target = subprocess.Popen(python + ["--one-target", provider], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert target.stdin is not None and target.stdout is not None
        descriptor = bytes.fromhex(json.loads(target.stdout.readline())["descriptor"])

        def target_stats() -> dict[str, int]:
            assert target.stdin is not None and target.stdout is not None
            target.stdin.write("stats\n")
            target.stdin.flush()
            return dict(json.loads(target.stdout.readline()))

        out: dict[str, Any] = {"provider": provider, "gaps": []}
        with TransferEngine(provider, bind_host="127.0.0.1", same_host=False) as engine:
            out["sleeps_on"] = engine.capabilities.get("sleeps_on", "-")
            source = engine.register(np.ones(1 << 20, dtype=np.uint8))
            for _ in range(50):  # the connection and the caches warm
                engine.write(source, 0, descriptor, 0, WRITE_BYTES).wait(WAIT_S)
            for gap_ms in gaps_ms:
                samples = []
                cpu = process_cpu_s(os.getpid()) + process_cpu_s(target.pid)
                for _ in range(writes):
                    t = time.perf_counter()
                    engine.write(source, 0, descriptor, 0, WRITE_BYTES).wait(WAIT_S)
                    samples.append((time.perf_counter() - t) * 1e6)
                    if gap_ms:
                        time.sleep(gap_ms / 1000)
                cpu = process_cpu_s(os.getpid()) + process_cpu_s(target.pid) - cpu
                samples.sort()
                out["gaps"].append({"gap_ms": gap_ms, "writes": writes, "median_us": statistics.median(samples),
                                    "p90_us": samples[int(0.9 * (len(samples) - 1))],
                                    "cpu_us_per_write": cpu / writes * 1e6})
            time.sleep(settle_s)
            w0, t0 = wakeups(engine.engine_stats()), wakeups(target_stats())
            cpu = process_cpu_s(os.getpid()) + process_cpu_s(target.pid)
            start = time.monotonic()
            time.sleep(idle_s)
            elapsed = time.monotonic() - start
            cpu = process_cpu_s(os.getpid()) + process_cpu_s(target.pid) - cpu
            w1, t1 = wakeups(engine.engine_stats()), wakeups(target_stats())
            out["idle_cpu_pct"] = 100 * cpu / elapsed  # both processes, % of one core
            out["idle_wakeups_per_s"] = (None if None in (w0, w1, t0, t1)
                                         else ((w1 - w0) + (t1 - t0)) / elapsed)  # type: ignore[operator]
        assert target.stdin is not None
        target.stdin.write("quit\n")
        target.stdin.flush()
        target.wait(WAIT_S)
        return out
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


def measure(providers: list[str], gaps_ms: list[float], writes: int, settle_s: float, idle_s: float,
            before: Path | None) -> list[dict[str, Any]]:
    builds: list[tuple[str, Path | None]] = [("this", None)] + ([("before", before)] if before else [])
    rows = []
    for provider in providers:
        for build, tree in builds:
            python = python_for(tree)
            child = subprocess.run(python + ["--one-writer", provider, "--gaps-ms", ",".join(map(str, gaps_ms)),
                                             "--writes", str(writes), "--settle-s", str(settle_s),
                                             "--idle-s", str(idle_s)] + (["--before", str(tree)] if tree else []),
                                   check=True, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            row = json.loads(child.stdout.strip().splitlines()[-1])
            row["build"] = build
            rows.append(row)
            print(f"  {provider} ({build} build) done", flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    gaps = [g["gap_ms"] for g in rows[0]["gaps"]]
    head = f"{'provider':<9}{'build':<8}" + "".join(("%g ms: p50/p90 us, cpu us" % g).rjust(30) for g in gaps)
    print(head + f"{'idle cpu %':>12}{'idle wakeups/s':>16}  sleeps on")
    for r in rows:
        cells = "".join(("%.1f / %.1f, %.0f" % (g["median_us"], g["p90_us"], g["cpu_us_per_write"])).rjust(30)
                        for g in r["gaps"])
        wake = "-" if r["idle_wakeups_per_s"] is None else f"{r['idle_wakeups_per_s']:.0f}"
        print(f"{r['provider']:<9}{r['build']:<8}{cells}{r['idle_cpu_pct']:>12.2f}{wake:>16}  {r['sleeps_on']}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (lat_ax, idle_ax) = plt.subplots(1, 2, figsize=(10, 4))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    color = {p: f"C{i}" for i, p in enumerate(providers)}
    for r in rows:
        gaps = [g["gap_ms"] for g in r["gaps"]]
        lat_ax.plot(gaps, [g["median_us"] for g in r["gaps"]], marker="o", color=color[r["provider"]],
                    ls="-" if r["build"] == "this" else "--", label=f"{r['provider']} ({r['build']} build)")
    lat_ax.set_xlabel("gap between writes (ms)")
    lat_ax.set_ylabel("4 KiB write, p50 us")
    lat_ax.grid(alpha=0.3)
    lat_ax.legend(fontsize=7)
    # A log axis for 0.3% against 99%; a process that used no measurable CPU shows at the floor.
    floor = 0.05
    labels = [f"{r['provider']}\n{r['build']}" for r in rows]
    bars = idle_ax.bar(labels, [max(r["idle_cpu_pct"], floor) for r in rows],
                       color=[color[r["provider"]] for r in rows])
    for bar, r in zip(bars, rows):
        bar.set_alpha(1.0 if r["build"] == "this" else 0.5)
    idle_ax.set_ylabel("idle pair, % of one core (both processes)")
    idle_ax.set_yscale("log")
    idle_ax.set_ylim(bottom=floor / 2)
    idle_ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def main() -> None:
    parser = parser_from_doc(__doc__)
    parser.add_argument("--providers", default="net,tcp,shm", help="libfabric providers, comma-separated")
    parser.add_argument("--gaps-ms", default="0,1,2,5,20",
                        help="pauses between writes, ms, comma-separated (0: back to back)")
    parser.add_argument("--writes", type=int, default=400, help="timed 4 KiB writes per gap")
    parser.add_argument("--settle-s", type=float, default=1.2,
                        help="seconds after the last write before the idle spell is measured (the worker's "
                             "quiet spell and its first second of short pauses)")
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds of the measured idle spell")
    parser.add_argument("--before", type=Path, default=None,
                        help="a tree made by benchmarks/kvxfer_at_commit.sh: measure that build too, taking turns")
    parser.add_argument("--json", type=Path, default=THIS.parent / "results" / "idle.json",
                        help="where the rows go (the PNG beside it)")
    parser.add_argument("--one-writer", help=argparse.SUPPRESS)  # a measurement's child process
    parser.add_argument("--one-target", help=argparse.SUPPRESS)  # the writer's target process
    args = parser.parse_args()
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    if args.one_target:
        run_target(args.one_target)
        return
    if args.one_writer:
        python = python_for(args.before)  # the target runs the writer's build
        print(json.dumps(run_writer(args.one_writer, gaps, args.writes, args.settle_s, args.idle_s, python)))
        return
    providers = args.providers.split(",")
    rows = measure(providers, gaps, args.writes, args.settle_s, args.idle_s, args.before)
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    load = subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()
    args.json.write_text(json.dumps({"gaps_ms": gaps, "writes": args.writes, "uptime": load,
                                     "before": str(args.before) if args.before else None, "rows": rows}, indent=2))
    png = args.json.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {args.json} and {png}")


if __name__ == "__main__":
    main()
