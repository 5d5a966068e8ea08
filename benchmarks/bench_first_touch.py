"""How much slower is the first transfer into freshly registered memory, and how close is
the same-host path to memcpy, cold and warm?

Two engines in this process (net provider over 127.0.0.1): a source with a filled buffer,
and a target that registers fresh memory (no page touched yet), with populate_on_register
off and on (huge_pages_on_register follows it). Paths: `same_host` (process_vm_writev into
private anonymous memory),
`same_host_mapped` (memcpy into the target's SharedBuffer, a memfd the source maps) and
`fabric` (the net provider). After one write that brings the connection up, for each path
and size it times the first write into fresh regions (cold: median over --regions) and
the next ones (warm: median over --repeats x --regions; the best is printed beside it),
against memcpy between two warm buffers of the same size measured in the same run (a
write is timed until the target counted its immediate). Verdicts (issue 14):

  first-touch  cold at >= 1/1.25 of warm (the first transfer within 1.25x of a warm one),
               every path, with populate_on_register on (the default)
  same-host    same-host paths at >= 0.7x memcpy for 1 MiB and larger, cold and warm

Beside memcpy, the `same_host` rows show the kernel's own rate for their copy
(machine_limits.process_vm_writev_gbps: process_vm_writev into another process's warm
memory, 4 MiB per call): what that path could reach with no kvxfer overhead at all.
Beside `register s`, `fill s` is what writing that many bytes of memory never touched
before takes on this machine (machine_limits.first_fill_gbps): registration populates the
pages, so it cannot cost less than the kernel (and a hypervisor) charge for fresh memory.

With --evict-cache, every timed write follows an eviction of the cache (about 10 ms of
writing here), so it also meets engine threads that went to sleep meanwhile. memcpy is then
measured a second way, each copy after the same eviction (`memcpy ev`): what a copy of
those bytes costs in the same state. The same-host verdict stays on warm memcpy; a third
line says how the same-host paths stand against the evicted one.

Prints a table, writes JSON and a PNG. On a shared 2-core machine, compare rows of one run.

    .venv/bin/python benchmarks/bench_first_touch.py [--sizes 1M,16M,256M] [--repeats 3]
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer import SharedBuffer
from kvxfer.transfer.engine import TransferEngine

sys.path.insert(0, str(Path(__file__).parent))
from machine_limits import first_fill_gbps, memcpy_gbps, parse_size, process_vm_writev_gbps
from report import parser_from_doc, pyplot, save_figure

WAIT_S = 120.0  # one write of the largest size on the slowest path, with margin
PATHS = ("same_host", "same_host_mapped", "fabric")
FIRST_TOUCH_MAX_SLOWDOWN = 1.25  # cold may take at most this many times a warm write
SAME_HOST_MIN_X_MEMCPY = 0.7
SAME_HOST_MIN_BYTES = 1 << 20
WARMUP_IMM = 999_999  # the connection warm-up's immediate, apart from the timed ones


def fresh_region(path: str, size: int) -> tuple[np.ndarray, Any]:
    """Untouched memory of `size` bytes for the target, and what keeps it alive."""
    if path == "same_host_mapped":
        buf = SharedBuffer(size)  # a memfd: the source maps it and copies with memcpy
        return buf.array, buf
    # Private anonymous memory, untouched: what numpy and torch allocate (mmap's default,
    # MAP_SHARED, is shmem, which cannot have huge pages here and is not what users hand in).
    fresh = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(fresh, dtype=np.uint8), fresh


def aligned_source(size: int) -> np.ndarray:
    """The writer's buffer, filled with 7s: private memory at a page boundary, as the targets
    are. Source and target at the same offset within a cache line is what KV caches give
    (torch aligns tensors to 64 bytes; pages are multiples of 64 bytes). numpy's arrays sit
    16 bytes past a page boundary, and process_vm_writev from there into a page-aligned
    target ran at 5.3-7.7 GB/s against 10.6-12.4 GB/s aligned: the kernel's copy is slow
    across misaligned cache lines (glibc's memcpy is not)."""
    src, _ = fresh_region("same_host", size)  # src.base keeps the mapping alive
    src[:] = 7
    return src


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache (sysfs), or 32 MiB where sysfs does not say."""
    for index in (3, 2):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        return parse_size(text)  # "32768K"
    return 32 << 20


class CacheEvictor:
    """Writes every cache line of three times the last-level cache, so that afterwards no
    byte of a write's source or destination is in it: a warm write then is what a KV page
    meets in a running decoder (written before, long out of cache), not the same 1 MiB
    written a moment ago and still in L3."""

    def __init__(self) -> None:
        self.buf = np.ones(3 * last_level_cache_bytes(), dtype=np.uint8)

    def __call__(self) -> None:
        self.buf[::64] += 1


def evicted_memcpy_gbps(size: int, evict: CacheEvictor, repeats: int) -> float:
    """Median GB/s of a memcpy of `size` bytes between two warm, page-aligned buffers, each
    copy right after `evict()`: the yardstick for writes timed after the same eviction."""
    src, dst = aligned_source(size), aligned_source(size)
    np.copyto(dst, src)  # both faulted in
    samples = []
    for _ in range(repeats):
        evict()
        t = time.perf_counter()
        np.copyto(dst, src)
        samples.append(size / (time.perf_counter() - t) / 1e9)
    return float(np.median(samples))


def one_path(path: str, populate: bool, sizes: list[int], repeats: int, regions: int,
             huge_pages: bool = True, evict: CacheEvictor | None = None) -> list[dict[str, Any]]:
    """Cold and warm write rates into fresh regions of every size, one engine pair.

    Before any timing the source writes once into a small warm region of the target, so the
    connection (address exchange, socket handshake) is up and the descriptor parsed: cold
    measures the fresh memory, not the first contact. Each size gets `regions` fresh regions:
    cold is the median of their first writes, warm the best of `repeats` later ones each.
    """
    same_host = path != "fabric"
    opts = {"provider": "net", "bind_host": "127.0.0.1", "same_host": same_host}
    rows = []
    with TransferEngine(**opts) as source, \
            TransferEngine(**opts, populate_on_register=populate, huge_pages_on_register=huge_pages) as target:
        src = aligned_source(max(sizes))
        src_mr = source.register(src)
        warm_view, warm_keep = fresh_region(path, 1 << 20)
        warm_view[:] = 1
        warm_mr = target.register(warm_view)
        source.write(src_mr, 0, warm_mr.descriptor, 0, 4096, imm=WARMUP_IMM).wait(WAIT_S)
        target.wait_imm(WARMUP_IMM, 1, WAIT_S)
        imm = 1
        for size in sizes:
            colds, warms, register_s = [], [], []
            for _ in range(regions):
                view, keep = fresh_region(path, size)
                t0 = time.perf_counter()
                dst_mr = target.register(view)
                register_s.append(time.perf_counter() - t0)
                assert source.path_to(dst_mr.descriptor) == path, source.path_to(dst_mr.descriptor)
                for k in range(1 + repeats):
                    if evict:
                        evict()
                    t0 = time.perf_counter()
                    source.write(src_mr, 0, dst_mr.descriptor, 0, size, imm=imm).wait(WAIT_S)
                    target.wait_imm(imm, k + 1, WAIT_S)
                    (warms if k else colds).append(time.perf_counter() - t0)
                assert int(view[size - 1]) == 7, "the last byte did not land"
                target.deregister(dst_mr)
                del dst_mr, view
                if isinstance(keep, SharedBuffer):
                    keep.close()
                imm += 1
            # Like against like: the median cold write against the median warm one. (Until
            # 2026-11-24 warm was the best of all warm writes, which set the median cold
            # write against a lucky one; both are kept.)
            cold, warm = size / float(np.median(colds)) / 1e9, size / float(np.median(warms)) / 1e9
            rows.append({"path": path, "populate_on_register": populate, "size": size,
                         "register_s": float(np.median(register_s)), "cold_gbps": cold, "warm_gbps": warm,
                         "warm_best_gbps": size / min(warms) / 1e9, "cold_over_warm": cold / warm,
                         "cold_samples_s": colds, "warm_samples_s": warms})
        target.deregister(warm_mr)
        if isinstance(warm_keep, SharedBuffer):
            warm_keep.close()
    return rows


def annotate(rows: list[dict[str, Any]], memcpy: dict[int, float], pvw: dict[int, float],
             fill: dict[int, float], memcpy_evicted: dict[int, float] | None = None) -> None:
    """Adds the ratios to memcpy (and, on the process_vm_writev path, to the kernel's own
    process_vm_writev rate; with `memcpy_evicted`, to memcpy after a cache eviction), the
    time a first fill of that many fresh bytes takes, and the verdict columns to every row."""
    for r in rows:
        if memcpy_evicted:
            r["memcpy_evicted_gbps"] = memcpy_evicted[r["size"]]
            r["cold_x_memcpy_evicted"] = r["cold_gbps"] / memcpy_evicted[r["size"]]
            r["warm_x_memcpy_evicted"] = r["warm_gbps"] / memcpy_evicted[r["size"]]
        r["first_fill_gbps"] = fill[r["size"]]
        r["first_fill_s"] = r["size"] / fill[r["size"]] / 1e9
        if r["path"] == "same_host":
            r["process_vm_writev_gbps"] = pvw[r["size"]]
            r["warm_x_process_vm_writev"] = r["warm_gbps"] / pvw[r["size"]]
        r["memcpy_gbps"] = memcpy[r["size"]]
        r["cold_x_memcpy"] = r["cold_gbps"] / memcpy[r["size"]]
        r["warm_x_memcpy"] = r["warm_gbps"] / memcpy[r["size"]]
        r["first_touch_ok"] = r["cold_over_warm"] >= 1 / FIRST_TOUCH_MAX_SLOWDOWN
        if r["path"] != "fabric" and r["size"] >= SAME_HOST_MIN_BYTES:
            r["same_host_ok"] = min(r["cold_x_memcpy"], r["warm_x_memcpy"]) >= SAME_HOST_MIN_X_MEMCPY
            if memcpy_evicted:
                r["same_host_evicted_ok"] = min(r["cold_x_memcpy_evicted"],
                                                r["warm_x_memcpy_evicted"]) >= SAME_HOST_MIN_X_MEMCPY
        else:
            r["same_host_ok"] = None  # not a same-host row the target speaks of


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per target: met when its worst row meets it (populate on, the default)."""
    on = [r for r in rows if r["populate_on_register"]]
    sh = [r for r in on if r["same_host_ok"] is not None]
    targets = [
        ("first-touch", f"cold within {FIRST_TOUCH_MAX_SLOWDOWN:g}x of warm, every path", on, "first_touch_ok"),
        ("same-host", f"same-host >= {SAME_HOST_MIN_X_MEMCPY:g}x memcpy, >= 1 MiB, cold and warm", sh,
         "same_host_ok"),
    ]
    if any("same_host_evicted_ok" in r for r in sh):
        targets.append(("same-host-ev", f"same-host >= {SAME_HOST_MIN_X_MEMCPY:g}x memcpy after the same "
                        "eviction, >= 1 MiB, cold and warm", sh, "same_host_evicted_ok"))
    out = []
    for name, text, group, key in targets:
        failing = [f"{r['path']} {r['size'] >> 20} MiB" for r in group if not r[key]]
        out.append({"target": name, "text": text, "met": bool(group) and not failing, "failing": failing})
    return out


def plot(rows: list[dict[str, Any]], memcpy: dict[int, float], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PATHS), figsize=(5 * len(PATHS), 4), sharey=True)
    sizes = sorted(memcpy)
    for ax, p in zip(axes, PATHS):
        for populate, style in ((False, ":"), (True, "-")):
            sel = sorted((r for r in rows if r["path"] == p and r["populate_on_register"] == populate),
                         key=lambda r: r["size"])
            if not sel:
                continue
            x = [r["size"] >> 20 for r in sel]
            tag = "populate on" if populate else "populate off"
            ax.plot(x, [r["cold_gbps"] for r in sel], style, marker="o", label=f"cold, {tag}")
            ax.plot(x, [r["warm_gbps"] for r in sel], style, marker="s", label=f"warm, {tag}")
        ax.plot([s >> 20 for s in sizes], [memcpy[s] for s in sizes], "k--", label="memcpy")
        if p != "fabric":
            ax.plot([s >> 20 for s in sizes], [SAME_HOST_MIN_X_MEMCPY * memcpy[s] for s in sizes], "k:",
                    label=f"{SAME_HOST_MIN_X_MEMCPY:g}x memcpy")
        ax.set_xscale("log", base=2)
        ax.set_title(p)
        ax.set_xlabel("write size (MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[-1].legend(fontsize=7)
    fig.suptitle("first write into freshly registered memory (cold) vs later ones (warm)")
    save_figure(fig, path)


def main() -> None:
    parser = parser_from_doc(__doc__)
    parser.add_argument("--sizes", default="1M,16M,256M",
                        help="write sizes, comma-separated with K/M/G suffixes (each into its own fresh region)")
    parser.add_argument("--repeats", type=int, default=3, help="warm writes after each cold one")
    parser.add_argument("--regions", type=int, default=3, help="fresh regions (cold writes) per size")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="comma-separated: same_host (process_vm_writev into private memory), "
                             "same_host_mapped (memcpy into a SharedBuffer), fabric (net provider)")
    parser.add_argument("--evict-cache", action="store_true",
                        help="write 3x the last-level cache before every timed write (cold and warm), so "
                             "warm writes do not find their bytes in cache; memcpy is then also timed "
                             "after the same eviction ('memcpy ev' and a third verdict line)")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="the target's huge_pages_on_register (on is the engine's default)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "first_touch.json",
                        help="where the rows, memcpy rates and verdicts go (the PNG beside it)")
    args = parser.parse_args()
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    paths = args.paths.split(",")
    memcpy: dict[int, float] = {}  # GB/s by size
    pvw: dict[int, float] = {}
    fill: dict[int, float] = {}  # GB/s of writing fresh memory, by size
    memcpy_evicted: dict[int, float] = {}  # GB/s of memcpy right after a cache eviction
    evictor = CacheEvictor() if args.evict_cache else None

    def measure_limits() -> None:
        # Before and after the runs: the machine's speed moves with the load, so each size
        # keeps the better measurement.
        # The process_vm_writev limit is read only by same_host rows.
        limits = [(memcpy, memcpy_gbps), (fill, first_fill_gbps)]
        limits += [(pvw, process_vm_writev_gbps)] if "same_host" in paths else []
        for best, measure in limits:
            for s in sizes:
                best[s] = max(best.get(s, 0.0), measure(s, repeats=max(3, args.repeats))["median"])
        if evictor:
            for s in sizes:
                memcpy_evicted[s] = max(memcpy_evicted.get(s, 0.0),
                                        evicted_memcpy_gbps(s, evictor, max(3, args.repeats)))

    measure_limits()
    rows = []
    for path in paths:
        for populate in (False, True):
            rows += one_path(path, populate, sizes, args.repeats, args.regions, args.huge_pages == "on", evictor)
    measure_limits()
    annotate(rows, memcpy, pvw, fill, memcpy_evicted or None)
    mark = {True: "ok", False: "LOW", None: "-"}
    print(f"{'path':<17}{'populate':<9}{'size':>8}{'register s':>11}{'fill s':>8}{'cold GB/s':>10}{'warm GB/s':>10}"
          f"{'(best)':>8}{'memcpy':>8}{'cold/warm':>10}{'cold x mc':>10}{'warm x mc':>10}{'warm x pvw':>11}"
          f"{'first':>6}{'same':>6}" + (f"{'memcpy ev':>10}{'cold x ev':>10}{'warm x ev':>10}" if evictor else ""))
    for r in rows:
        print(f"{r['path']:<17}{r['populate_on_register']!s:<9}{r['size'] >> 20:>6}Mi{r['register_s']:>11.3f}"
              f"{r['first_fill_s']:>8.3f}{r['cold_gbps']:>10.2f}{r['warm_gbps']:>10.2f}"
              f"{r['warm_best_gbps']:>8.2f}{r['memcpy_gbps']:>8.2f}"
              f"{r['cold_over_warm']:>10.2f}"
              f"{r['cold_x_memcpy']:>10.2f}{r['warm_x_memcpy']:>10.2f}"
              f"{r.get('warm_x_process_vm_writev', float('nan')):>11.2f}{mark[r['first_touch_ok']]:>6}"
              f"{mark[r['same_host_ok']]:>6}"
              + (f"{r['memcpy_evicted_gbps']:>10.2f}{r['cold_x_memcpy_evicted']:>10.2f}"
                 f"{r['warm_x_memcpy_evicted']:>10.2f}" if evictor else ""))
    results = verdicts(rows)
    for v in results:
        print(f"{v['target']:<12} {v['text']}: {'met' if v['met'] else 'NOT met: ' + ', '.join(v['failing'])}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    load = subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()
    args.json.write_text(json.dumps({"sizes": sizes, "memcpy_gbps": memcpy, "process_vm_writev_gbps": pvw,
                                     "memcpy_evicted_gbps": memcpy_evicted,
                                     "first_fill_gbps": fill,
                                     "uptime": load, "pid": os.getpid(),
                                     "huge_pages": args.huge_pages, "evict_cache": args.evict_cache,
                                     "rows": rows, "verdicts": results}, indent=2))
    png = args.json.with_suffix(".png")
    plot(rows, memcpy, png)
    print(f"wrote {args.json} and {png}")


if __name__ == "__main__":
    main()
