"""How fast is the KV page checksum, per core, next to this machine's memcpy?

CRC-32C of whole KV pages with `kvxfer._native.page_crc32c` (SSE4.2, three interleaved
streams), and the portable table version for reference, over a buffer far larger than the
caches (so pages come from memory, as in a real push), at the page sizes of the tiny model
(4 KiB), and of the 8B-shaped config (128 KiB float32; 64 KiB bf16), and 1 MiB. One thread:
the number is GB/s per core. memcpy (one thread, machine_limits.memcpy_gbps) is measured
in the same run as the limit. Issue 12 asks for 5 GB/s or more per core.

    .venv/bin/python benchmarks/bench_checksum.py [--size-mib 512] [--repeats 5] [--json PATH]

Writes the table, JSON and a PNG (benchmarks/results/bench_checksum.*).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvxfer.transfer.native_library import native as _native

sys.path.insert(0, str(Path(__file__).parent))
from machine_limits import memcpy_gbps

PAGE_SIZES = (4 << 10, 64 << 10, 128 << 10, 1 << 20)


def checksum_gbps(buf: np.ndarray, page_bytes: int, repeats: int, portable: bool) -> float:
    """Best of `repeats` passes over every page of `buf`, GB/s (1e9 B/s)."""
    pages = np.arange(buf.size // page_bytes, dtype=np.int64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if portable:
            for p in pages:
                _native.crc32c(buf[p * page_bytes : (p + 1) * page_bytes], portable=True)
        else:
            _native.page_crc32c(buf.ctypes.data, buf.size, 0, page_bytes, pages)
        best = min(best, time.perf_counter() - t0)
    return len(pages) * page_bytes / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "bench_checksum.json")
    args = parser.parse_args()
    size = args.size_mib << 20
    buf = np.random.default_rng(12).integers(0, 256, size, dtype=np.uint8)
    memcpy = memcpy_gbps(size, args.repeats)["median"]
    rows = []
    for page_bytes in PAGE_SIZES:
        hw = checksum_gbps(buf, page_bytes, args.repeats, portable=False)
        sw = checksum_gbps(buf, page_bytes, 1, portable=True)
        rows.append({"page_bytes": page_bytes, "crc32c_gbps": hw, "portable_gbps": sw, "memcpy_gbps": memcpy,
                     "crc32c_vs_memcpy": hw / memcpy})
    print(f"CRC-32C per core (SSE4.2 in use: {_native.crc32c_hardware()}), {args.size_mib} MiB of pages, "
          f"memcpy {memcpy:.1f} GB/s (one thread, same run)")
    print(f"{'page':>9} {'crc32c GB/s':>12} {'portable GB/s':>14} {'x memcpy':>9}")
    for r in rows:
        print(f"{r['page_bytes'] >> 10:>6} KiB {r['crc32c_gbps']:>12.2f} {r['portable_gbps']:>14.2f} "
              f"{r['crc32c_vs_memcpy']:>9.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    args.json.write_text(json.dumps({"size_bytes": size, "loadavg": load, "hardware": _native.crc32c_hardware(),
                                     "rows": rows}, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = [r["page_bytes"] >> 10 for r in rows]
        ax.plot(x, [r["crc32c_gbps"] for r in rows], "o-", label="CRC-32C (SSE4.2, 3 streams)")
        ax.plot(x, [r["portable_gbps"] for r in rows], "s-", label="CRC-32C (tables)")
        ax.axhline(memcpy, color="gray", linestyle="--", label="memcpy (1 thread)")
        ax.axhline(5.0, color="red", linestyle=":", label="issue 12 target 5 GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page KiB")
        ax.set_ylabel("GB/s per core")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.json.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no PNG")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
