"""What a writer pays for each descriptor it has not seen yet, as its cache fills.

A decoder hands out a new windows descriptor per reservation, so a prefill engine meets a
new descriptor on every request for as long as it runs. This measures the cost of the
first use of each one (`TransferEngine.path_to`, which parses and caches it, as a write
does), in groups of --group, while the cache grows to --descriptors entries, against the
native parse alone (`parse_remote`, no cache): the floor. Both engines are in this
process (net over 127.0.0.1); `same_host` on, the descriptors name a SharedBuffer of the
target (the mapped path), off, they go over the fabric.

Prints a table, writes JSON and a PNG.

    .venv/bin/python benchmarks/bench_new_descriptors.py [--descriptors 4000] [--group 500]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvxfer import SharedBuffer
from kvxfer.transfer.engine import TransferEngine

sys.path.insert(0, str(Path(__file__).parent))
from report import parser_from_doc, pyplot, save_figure  # noqa: E402

REGION_BYTES = 64 << 20
WINDOW_BYTES = 4096


def one_mode(same_host: bool, descriptors: int, group: int) -> list[dict[str, Any]]:
    """Rows of (cached so far, us per new descriptor through the cache, us per bare parse)."""
    with TransferEngine(provider="net", same_host=same_host) as source, \
            TransferEngine(provider="net", same_host=same_host) as target:
        buf = SharedBuffer(REGION_BYTES)
        region = target.register(buf.array)
        slots = REGION_BYTES // WINDOW_BYTES
        # One window each, as a reservation's; kept open so their descriptors stay valid.
        windows = [target.register_windows(region, [((i % slots) * WINDOW_BYTES, WINDOW_BYTES)])
                   for i in range(descriptors)]
        keys = [w.descriptor for w in windows]
        source.path_to(keys[0])  # the peer's first descriptor: connection and mapping set up
        rows = []
        for start in range(1, descriptors, group):
            batch = keys[start:start + group]
            t = time.perf_counter()
            for key in batch:
                source.path_to(key)
            cached_us = (time.perf_counter() - t) / len(batch) * 1e6
            t = time.perf_counter()
            for key in batch:
                source._native.parse_remote(key)
            parse_us = (time.perf_counter() - t) / len(batch) * 1e6
            rows.append({"same_host": same_host, "cached_before": start, "new_descriptor_us": cached_us,
                         "bare_parse_us": parse_us, "x_bare_parse": cached_us / parse_us})
        for w in windows:
            w.close()
        target.deregister(region)
        buf.close()
        return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for same_host, style in ((True, "-"), (False, "--")):
        sel = [r for r in rows if r["same_host"] == same_host]
        tag = "same host (mapped)" if same_host else "fabric"
        ax.plot([r["cached_before"] for r in sel], [r["new_descriptor_us"] for r in sel], style, marker="o",
                label=f"new descriptor, {tag}")
        ax.plot([r["cached_before"] for r in sel], [r["bare_parse_us"] for r in sel], style, marker="x",
                label=f"bare parse, {tag}")
    ax.set_xlabel("descriptors cached before")
    ax.set_ylabel("us per new descriptor")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = parser_from_doc(__doc__)
    parser.add_argument("--descriptors", type=int, default=4000,
                        help="new descriptors per mode (the cache keeps 4096; beyond, the oldest go)")
    parser.add_argument("--group", type=int, default=500, help="descriptors timed together (one row each)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "new_descriptors.json",
                        help="where the rows go (the PNG beside it)")
    args = parser.parse_args()
    rows = one_mode(True, args.descriptors, args.group) + one_mode(False, args.descriptors, args.group)
    print(f"{'path':<20}{'cached':>8}{'new descriptor us':>19}{'bare parse us':>15}{'x parse':>9}")
    for r in rows:
        print(f"{'same host (mapped)' if r['same_host'] else 'fabric':<20}{r['cached_before']:>8}"
              f"{r['new_descriptor_us']:>19.1f}{r['bare_parse_us']:>15.1f}{r['x_bare_parse']:>9.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows}, indent=2))
    png = args.json.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {args.json} and {png}")


if __name__ == "__main__":
    main()
