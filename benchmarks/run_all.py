"""Runs every kvxfer benchmark in turn (what `scripts/run bench` calls).

    scripts/run bench            # quick mode of each: a few minutes in all
    scripts/run bench --full     # full runs (tens of minutes on a 2-core machine)

Each benchmark prints its own table and writes JSON and PNG under benchmarks/results/.
A benchmark that fails is reported and the others still run; the exit code is non-zero
if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: (script, quick arguments, full arguments)
BENCHMARKS: list[tuple[str, list[str], list[str]]] = [
    ("machine_limits.py", [], []),
    ("bench_engine.py", ["--quick"], []),
    ("bench_disagg_prefill.py", ["--quick"], []),
    ("compare_peers.py", ["--quick"], []),
]


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks; returns the number of failures (0 when all passed)."""
    parser = argparse.ArgumentParser(prog="scripts/run bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="full runs instead of quick ones")
    parser.add_argument("--only", help="comma-separated script names to run (e.g. bench_engine)")
    args = parser.parse_args(argv)
    only = {name.removesuffix(".py") for name in args.only.split(",")} if args.only else None
    failures = 0
    for script, quick, full in BENCHMARKS:
        if only and script.removesuffix(".py") not in only:
            continue
        cmd = [sys.executable, str(HERE / script), *(full if args.full else quick)]
        print(f"\n=== {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            print(f"=== {script} FAILED", flush=True)
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
