"""How much slower is the first transfer into freshly registered memory, and does
populate_on_register fix it?

Two engines in this process (net provider over 127.0.0.1): a source with a filled buffer,
and a target that registers a fresh anonymous mapping (no page touched yet), with
populate_on_register off and on. For each path (same_host: process_vm_writev, fabric: the
provider) it times the first write into the region (cold) and the next ones (warm), prints
a table and writes JSON. On a shared 2-core machine, compare rows of one run only.

    .venv/bin/python benchmarks/bench_first_touch.py [--size-mib 256] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from kvxfer.transfer.engine import TransferEngine

WAIT_S = 120.0  # one write of --size-mib on the slowest path, with margin


def one_case(size: int, path: str, populate: bool, repeats: int) -> dict[str, float]:
    same_host = path == "same_host"
    opts = {"provider": "net", "bind_host": "127.0.0.1", "same_host": same_host}
    with TransferEngine(**opts) as source, TransferEngine(**opts, populate_on_register=populate) as target:
        src = np.full(size, 7, dtype=np.uint8)
        src_mr = source.register(src)
        fresh = mmap.mmap(-1, size)  # anonymous, untouched: every page faults on first write
        t0 = time.perf_counter()
        dst_mr = target.register(np.frombuffer(fresh, dtype=np.uint8))
        register_s = time.perf_counter() - t0
        assert source.path_to(dst_mr.descriptor) == ("same_host" if same_host else "fabric")
        times = []
        for _ in range(1 + repeats):
            t0 = time.perf_counter()
            source.write(src_mr, 0, dst_mr.descriptor, 0, size, imm=1).wait(WAIT_S)
            target.wait_imm(1, len(times) + 1, WAIT_S)
            times.append(time.perf_counter() - t0)
        target.deregister(dst_mr)
        del dst_mr
        cold, warm = size / times[0] / 1e9, size / min(times[1:]) / 1e9
        return {"register_s": register_s, "cold_gbps": cold, "warm_gbps": warm, "cold_over_warm": cold / warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="warm writes after the cold one")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "first_touch.json")
    args = parser.parse_args()
    size = args.size_mib << 20
    rows = []
    for path in ("same_host", "fabric"):
        for populate in (False, True):
            rows.append({"path": path, "populate_on_register": populate, **one_case(size, path, populate, args.repeats)})
    print(f"{'path':<10} {'populate':<9} {'register s':>10} {'cold GB/s':>10} {'warm GB/s':>10} {'cold/warm':>9}")
    for r in rows:
        print(f"{r['path']:<10} {str(r['populate_on_register']):<9} {r['register_s']:>10.3f} "
              f"{r['cold_gbps']:>10.2f} {r['warm_gbps']:>10.2f} {r['cold_over_warm']:>9.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    args.json.write_text(json.dumps({"size_bytes": size, "uptime": load, "pid": os.getpid(), "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
