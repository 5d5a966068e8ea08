"""What the immediate of a lone same-host write costs: through the receiver's ring, or over the fabric.

A same-host write copies its bytes without the fabric; its immediate then tells the
receiver they are there. `same_host_imm_ring` on, the writer appends it to a ring in the
receiver's shared memory; off, it goes over the provider (net, 127.0.0.1). Each route
runs in a process of its own (writer and target engines in it), so neither route's
progress threads run beside the other's; the target's regions are a SharedBuffer
(`same_host_mapped`: the writer memcpys into its mapping) and private memory
(`same_host`: process_vm_writev). One write at a time, timed from submit until the
target counted its immediate, --gap-ms apart (a prefiller pushes a layer at a time, with
compute in between; 0: back to back). Ring and fabric processes take turns, --rounds
times, so the machine's phases fall on both alike; a process's CPU time (both engines'
progress threads and the timing thread) per write is the route's cost. Beside
memcpy of the same size between two warm buffers (before and after; the better counts),
back to back and, with --gap-ms, each copy after the same pause as the writes (a lone write
meets a cooled cache and CPU that back-to-back copies do not).

Prints a table, then where a ring write's time goes (in `write`, until the writer's handle
is done, until the target counted), and writes JSON and a PNG.

    .venv/bin/python benchmarks/bench_same_host_imm.py [--sizes 4K,64K,1M,4M,16M] [--writes 300] [--gap-ms 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_first_touch import aligned_source, fresh_region  # noqa: E402
from machine_limits import memcpy_gbps, parse_size  # noqa: E402
from report import parser_from_doc, pyplot, save_figure  # noqa: E402

from kvxfer.transfer.engine import TransferEngine  # noqa: E402

PATHS = ("same_host_mapped", "same_host")
ROUTES = ("ring", "fabric")
# A write's stages: in `write` (the submit), then until the writer's handle is done (the
# copy, and the worker's hand-offs), then until the target counted its immediate.
STAGES = ("submit", "done", "counted")
WAIT_S = 10.0
CHILD_TIMEOUT_S = 600.0  # one route's process, every path and size
SAME_HOST_MIN_BYTES = 1 << 20  # the 0.7x-memcpy target starts here


def measure_route(route: str, sizes: list[int], writes: int, gap_s: float) -> list[dict[str, Any]]:
    """In this process: `writes` timed writes of each path and size through one route, as
    raw samples (us until the target counted) and CPU seconds."""
    largest = max(sizes)
    out = []
    with TransferEngine(provider="net", bind_host="127.0.0.1") as target, \
            TransferEngine(provider="net", bind_host="127.0.0.1", same_host_imm_ring=route == "ring") as writer:
        mr = writer.register(aligned_source(largest))
        imm = 1

        def timed_write(descriptor: bytes, size: int) -> tuple[float, float, float]:
            """us spent in `write` (the submit), then until the writer's handle was done,
            then until the target counted the immediate."""
            nonlocal imm
            imm += 1
            t0 = time.perf_counter()
            handle = writer.write(mr, 0, descriptor, 0, size, imm=imm)
            t1 = time.perf_counter()
            handle.wait(WAIT_S)
            t2 = time.perf_counter()
            target.wait_imm(imm, 1, WAIT_S)
            t3 = time.perf_counter()
            return (t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6

        for path in PATHS:
            buf, keep = fresh_region(path, largest)
            region = target.register(buf)
            assert writer.path_to(region.descriptor) == path, writer.path_to(region.descriptor)
            for _ in range(20):  # connection, mapping and caches warm
                timed_write(region.descriptor, min(largest, 1 << 20))
            for size in sizes:
                cpu = time.process_time()
                stages = []
                for _ in range(writes):
                    stages.append(timed_write(region.descriptor, size))
                    if gap_s:
                        time.sleep(gap_s)
                out.append({"path": path, "size": size, "route": route, "samples_us": [sum(t) for t in stages],
                            "stages_us": stages, "cpu_s": time.process_time() - cpu})
            target.deregister(region)
            del buf, keep
    return out


def measure(sizes: list[int], writes: int, rounds: int, gap_s: float) -> list[dict[str, Any]]:
    """A row per (path, size, route): microseconds until the target counted (median, p90)
    and CPU microseconds per write, over `rounds` processes per route, taking turns."""
    per_round = -(-writes // rounds)
    raw: dict[tuple[str, int, str], dict[str, Any]] = {}
    for turn in range(2 * rounds):
        route = ROUTES[turn % 2]
        child = subprocess.run([sys.executable, __file__, "--one-route", route, "--sizes", ",".join(map(str, sizes)),
                                "--writes", str(per_round), "--gap-ms", str(gap_s * 1000)],
                               check=True, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        for r in json.loads(child.stdout):
            acc = raw.setdefault((r["path"], r["size"], r["route"]), {"samples_us": [], "stages_us": [], "cpu_s": 0.0})
            acc["samples_us"] += r["samples_us"]
            acc["stages_us"] += r["stages_us"]
            acc["cpu_s"] += r["cpu_s"]
        print(f"  round {turn // 2 + 1}/{rounds}: {route} done", flush=True)
    rows = []
    for (path, size, route), acc in raw.items():
        s = sorted(acc["samples_us"])
        rows.append({"path": path, "size": size, "route": route, "writes": len(s),
                     "median_us": statistics.median(s), "p90_us": s[int(0.9 * (len(s) - 1))],
                     "cpu_us_per_write": acc["cpu_s"] / len(s) * 1e6,
                     # Where a write's time goes, median of each stage (they need not add up
                     # to the median total).
                     **{f"{stage}_median_us": statistics.median(t[i] for t in acc["stages_us"])
                        for i, stage in enumerate(STAGES)}})
    rows.sort(key=lambda r: (PATHS.index(r["path"]), r["size"], ROUTES.index(r["route"])))
    return rows


def annotate(rows: list[dict[str, Any]], memcpy: dict[int, float], spaced_memcpy: dict[int, float]) -> None:
    for r in rows:
        r["gbps"] = r["size"] / (r["median_us"] * 1e-6) / 1e9
        r["memcpy_gbps"] = memcpy[r["size"]]
        r["x_memcpy"] = r["gbps"] / r["memcpy_gbps"]
        if spaced_memcpy:
            r["spaced_memcpy_gbps"] = spaced_memcpy[r["size"]]
            r["x_spaced_memcpy"] = r["gbps"] / r["spaced_memcpy_gbps"]
    by_key = {(r["path"], r["size"], r["route"]): r for r in rows}
    for r in rows:
        if r["route"] == "ring":
            fabric_row = by_key[(r["path"], r["size"], "fabric")]
            r["fabric_over_ring"] = fabric_row["median_us"] / r["median_us"]
            r["fabric_over_ring_cpu"] = fabric_row["cpu_us_per_write"] / r["cpu_us_per_write"]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for p, style in zip(PATHS, ("-", "--")):
        for route, marker in zip(ROUTES, ("o", "x")):
            sel = [r for r in rows if r["path"] == p and r["route"] == route]
            ax.plot([r["size"] for r in sel], [r["x_memcpy"] for r in sel], style, marker=marker,
                    label=f"{p}, immediate via {route}")
            if route == "ring" and sel and "x_spaced_memcpy" in sel[0]:
                ax.plot([r["size"] for r in sel], [r["x_spaced_memcpy"] for r in sel], ":", marker=marker,
                        label=f"{p}, via ring, x memcpy as spaced")
    ax.axhline(0.7, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("write size (bytes)")
    ax.set_ylabel("lone write x memcpy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = parser_from_doc(__doc__)
    parser.add_argument("--sizes", default="4K,64K,1M,4M,16M",
                        help="write sizes, comma-separated with K/M/G suffixes")
    parser.add_argument("--writes", type=int, default=300,
                        help="timed writes per path, size and route (rounded up to whole rounds)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per route, ring and fabric taking turns")
    parser.add_argument("--one-route", choices=ROUTES, help=argparse.SUPPRESS)  # a round's child process
    parser.add_argument("--gap-ms", type=float, default=1.0,
                        help="pause after each write, ms (a layer's compute between pushes; 0: back to back)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "same_host_imm.json",
                        help="where the rows and memcpy rates go (the PNG beside it)")
    args = parser.parse_args()
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    if args.one_route:
        print(json.dumps(measure_route(args.one_route, sizes, args.writes, args.gap_ms / 1000.0)))
        return
    memcpy: dict[int, float] = {}
    # memcpy with the writes' own pause before each copy: a lone write meets a cooled cache
    # and CPU that back-to-back copies never do (1 MiB: 31 GB/s back to back, 18-20 1 ms apart).
    spaced_memcpy: dict[int, float] = {}
    gap_s = args.gap_ms / 1000.0

    def measure_memcpy() -> None:
        for s in sizes:
            memcpy[s] = max(memcpy.get(s, 0.0), memcpy_gbps(s, repeats=20)["median"])
            if gap_s:
                spaced = memcpy_gbps(s, repeats=20, gap_s=gap_s)["median"]
                spaced_memcpy[s] = max(spaced_memcpy.get(s, 0.0), spaced)

    measure_memcpy()
    rows = measure(sizes, args.writes, args.rounds, gap_s)
    measure_memcpy()
    annotate(rows, memcpy, spaced_memcpy)
    print(f"{'path':<17}{'size':>9}{'route':>8}{'median us':>11}{'p90 us':>9}{'cpu us':>8}{'GB/s':>7}"
          f"{'memcpy':>8}{'x memcpy':>10}{'x spaced':>10}{'fabric/ring':>13}{'cpu f/r':>9}")
    for r in rows:
        ratios = (f"{r['fabric_over_ring']:>13.2f}{r['fabric_over_ring_cpu']:>9.2f}" if "fabric_over_ring" in r
                  else f"{'':>22}")
        spaced = f"{r['x_spaced_memcpy']:>10.2f}" if "x_spaced_memcpy" in r else f"{'-':>10}"
        print(f"{r['path']:<17}{r['size'] >> 10:>6}KiB{r['route']:>8}{r['median_us']:>11.1f}{r['p90_us']:>9.1f}"
              f"{r['cpu_us_per_write']:>8.1f}{r['gbps']:>7.2f}{r['memcpy_gbps']:>8.2f}{r['x_memcpy']:>10.2f}{spaced}"
              f"{ratios}")
    print(f"\nwhere a lone write's time goes (immediate through the ring), median us per stage:\n"
          f"{'path':<17}{'size':>9}{'submit':>9}{'done':>9}{'counted':>9}{'memcpy':>9}")
    for r in rows:
        if r["route"] == "ring":
            copy_us = r["size"] / (r.get("spaced_memcpy_gbps") or r["memcpy_gbps"]) / 1e3
            print(f"{r['path']:<17}{r['size'] >> 10:>6}KiB" + "".join(f"{r[f'{st}_median_us']:>9.1f}" for st in STAGES)
                  + f"{copy_us:>9.1f}")
    print("(submit: in write(); done: until the writer's handle completed; counted: until the target's "
          "wait_imm returned; memcpy: one copy of that size, as spaced as the writes)\n")
    for key, what in (("x_memcpy", "memcpy back to back"), ("x_spaced_memcpy", f"memcpy {args.gap_ms:g} ms apart")):
        if key not in rows[0]:
            continue
        low = [f"{r['path']} {r['size'] >> 10} KiB ({r[key]:.2f})" for r in rows
               if r["route"] == "ring" and r["size"] >= SAME_HOST_MIN_BYTES and r[key] < 0.7]
        verdict = "met" if not low else "NOT met: " + ", ".join(low)
        print(f"same-host lone writes >= 1 MiB at 0.7x {what} (ring): {verdict}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    load = subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()
    args.json.write_text(json.dumps({"sizes": sizes, "memcpy_gbps": memcpy, "spaced_memcpy_gbps": spaced_memcpy,
                                     "gap_ms": args.gap_ms, "uptime": load, "rows": rows}, indent=2))
    png = args.json.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {args.json} and {png}")


if __name__ == "__main__":
    main()
