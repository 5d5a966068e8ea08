"""What does a per-reservation memory registration cost, per provider, next to the whole-cache one?

kv_registration=per_reservation (the decoder's default) registers each reservation's prompt
pages again with fresh keys (one window per run of pages per layer, plus its mailbox
slot) and closes them when the reservation stops waiting for KV; whole_cache registers
the cache once per worker. This measures, on the KV config of the 8B-shaped model
(ModelConfig preset 'llama3-8b-kv': 32 layers, 128 KiB float32 pages at block 16) and
at 1K, 2K and 4K-token prompts:

  per reservation   TransferEngine.register_windows (32 windows, one per layer, as for a
                    reservation whose pages are one run) + the mailbox window + closing
                    both: median and p90 over --repeats reservations.
  whole cache       register + deregister of the whole cache (one reservation of each
                    size fits), with populate_on_register off: the provider's part only.
  limit             the reservation's KV bytes copied once by memcpy (one thread,
                    machine_limits.memcpy_gbps, measured in the same run): what moving that
                    KV costs on this machine at the very least. The ratio says how much the
                    registration adds to the cheapest possible transfer of the same request.

for each provider present among net and tcp, with 1 and 2 rails (a registration is made
on every rail). The cache is allocated but never touched: the socket providers neither pin
nor touch memory at registration (they keep a key -> range table), so the numbers do not
depend on it being resident.

RDMA providers (verbs, efa) pin every page at registration and write the NIC's translation
table. A second table measures the pinning, the kernel's share, without such a NIC
(kernel_pin.py: io_uring fixed buffers pin with the same kernel call as ibv_reg_mr): pin +
unpin of one reservation's windows in a populated cache, with 4 KiB pages and with
transparent huge pages (huge_pages_on_register, the engine's default), and the whole cache
once. A lower bound of a per-reservation registration on RDMA; see docs/architecture.md,
"Data plane", for the choice it leads to.

    .venv/bin/python benchmarks/bench_registration.py [--repeats 200] [--no-pin] [--json PATH]

Writes the table, JSON and a PNG (benchmarks/results/bench_registration.*).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.kv.write_windows import reservation_windows
from kvxfer.model.config import ModelConfig
from kvxfer.transfer.engine import TransferEngine, available_providers

sys.path.insert(0, str(Path(__file__).parent))
from kernel_pin import PinnableBuffer, PinTimer, PinUnavailable  # noqa: E402
from machine_limits import memcpy_gbps  # noqa: E402

CONFIG = ModelConfig.preset("llama3-8b-kv")
PROMPT_TOKENS = (1024, 2048, 4096)
MAILBOX_SLOT_BYTES = 64 << 10  # the order of a slot with its checksum table at 4K tokens
RAILS = (1, 2)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass(frozen=True)
class Reservation:
    """One prompt's reservation in a cache that holds just it (plus one page per layer)."""

    tokens: int

    @property
    def pages(self) -> int:
        return -(-self.tokens // CONFIG.block_size)

    @property
    def cache_bytes(self) -> int:
        return CONFIG.num_layers * (self.pages + 1) * CONFIG.page_bytes

    @property
    def kv_bytes(self) -> int:
        return CONFIG.num_layers * self.pages * CONFIG.page_bytes

    def windows(self) -> list[tuple[int, int]]:
        """(offset, length) in the cache of what a decoder registers again for it."""
        return reservation_windows(list(range(self.pages)), CONFIG.num_layers, self.pages + 1, CONFIG.page_bytes)


def measure(provider: str, rails: int, tokens: int, repeats: int, memcpy: float) -> dict[str, Any]:
    res = Reservation(tokens)
    cache = np.empty(res.cache_bytes, dtype=np.uint8)  # never touched
    mailbox = np.zeros(MAILBOX_SLOT_BYTES, dtype=np.uint8)
    with TransferEngine(provider, rails=rails, bind_host="127.0.0.1", same_host=False,
                        populate_on_register=False) as engine:
        whole_s = []
        for _ in range(max(3, repeats // 20)):
            t0 = time.perf_counter()
            region = engine.register(cache)
            engine.deregister(region)
            whole_s.append(time.perf_counter() - t0)
        cache_mr = engine.register(cache)
        mailbox_mr = engine.register(mailbox)
        windows = res.windows()
        per_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            kv = engine.register_windows(cache_mr, windows)
            mb = engine.register_windows(mailbox_mr, [(0, MAILBOX_SLOT_BYTES)])
            kv.close()
            mb.close()
            per_s.append(time.perf_counter() - t0)
    limit_s = res.kv_bytes / (memcpy * 1e9)
    per_median = statistics.median(per_s)
    return {
        "provider": provider, "rails": rails, "prompt_tokens": tokens, "windows": len(windows) + 1,
        "kv_bytes": res.kv_bytes, "per_reservation_us_median": per_median * 1e6,
        "per_reservation_us_p90": percentile(per_s, 0.9) * 1e6,
        "whole_cache_us_median": statistics.median(whole_s) * 1e6,
        "memcpy_limit_us": limit_s * 1e6, "per_reservation_over_limit": per_median / limit_s,
    }


def measure_pin(tokens: int, repeats: int, memcpy: float) -> dict[str, Any]:
    """Kernel pin + unpin of one reservation's windows (and of the whole cache), with 4 KiB
    and with huge pages: the kernel's share of registering them on an RDMA NIC."""
    res = Reservation(tokens)
    cache_bytes = res.cache_bytes
    windows = res.windows()
    row: dict[str, Any] = {"prompt_tokens": tokens, "windows": len(windows), "kv_bytes": res.kv_bytes,
                           "cache_bytes": cache_bytes}
    row["memcpy_limit_us"] = row["kv_bytes"] / (memcpy * 1e9) * 1e6
    with PinTimer() as pins:
        for label, huge in (("small", False), ("huge", True)):
            buf = PinnableBuffer(cache_bytes, huge)
            try:
                ranges = [(buf.address + off, length) for off, length in windows]
                timings = [pins.pin_unpin_s(ranges) for _ in range(repeats)]
                whole = [pins.pin_unpin_s([(buf.address, cache_bytes)])[0] for _ in range(max(3, repeats // 4))]
                row[f"{label}_huge_fraction"] = buf.huge_bytes / cache_bytes
            finally:
                buf.close()
            row[f"{label}_pin_us_median"] = statistics.median(t[0] for t in timings) * 1e6
            row[f"{label}_unpin_us_median"] = statistics.median(t[1] for t in timings) * 1e6
            row[f"{label}_whole_pin_us_median"] = statistics.median(whole) * 1e6
    return row


def format_pin_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'tokens':>6} {'KV MiB':>7} {'pages':>6} {'pin+unpin us':>12} {'whole pin us':>12} "
            f"{'pages':>6} {'pin+unpin us':>12} {'whole pin us':>12} {'memcpy us':>9} {'4K/memcpy':>9} "
            f"{'huge/memcpy':>11}")
    lines = ["kernel pin + unpin of one reservation's windows (RDMA's kernel share; 4 KiB pages | huge pages)",
             head, "-" * len(head)]
    for r in rows:
        small = r["small_pin_us_median"] + r["small_unpin_us_median"]
        huge = r["huge_pin_us_median"] + r["huge_unpin_us_median"]
        huge_label = f"{r['huge_huge_fraction']:.0%} 2M"
        lines.append(f"{r['prompt_tokens']:>6} {r['kv_bytes'] / 2**20:>7.0f} "
                     f"{'4K':>6} {small:>12.0f} {r['small_whole_pin_us_median']:>12.0f} "
                     f"{huge_label:>6} {huge:>12.0f} {r['huge_whole_pin_us_median']:>12.0f} "
                     f"{r['memcpy_limit_us']:>9.0f} {small / r['memcpy_limit_us']:>9.3f} "
                     f"{huge / r['memcpy_limit_us']:>11.3f}")
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'provider':>8} {'rails':>5} {'tokens':>6} {'windows':>7} {'KV MiB':>7} {'per-res us':>10} "
            f"{'p90 us':>8} {'whole us':>9} {'memcpy us':>9} {'per-res/memcpy':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['provider']:>8} {r['rails']:>5} {r['prompt_tokens']:>6} {r['windows']:>7} "
                     f"{r['kv_bytes'] / 2**20:>7.0f} {r['per_reservation_us_median']:>10.1f} "
                     f"{r['per_reservation_us_p90']:>8.1f} {r['whole_cache_us_median']:>9.1f} "
                     f"{r['memcpy_limit_us']:>9.0f} {r['per_reservation_over_limit']:>14.4f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], pin_rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for provider in sorted({r["provider"] for r in rows}):
        for rails in RAILS:
            sel = [r for r in rows if r["provider"] == provider and r["rails"] == rails]
            if sel:
                ax.plot([r["prompt_tokens"] for r in sel], [r["per_reservation_us_median"] for r in sel],
                        marker="o", label=f"{provider} r{rails}: per reservation")
    limit = [r for r in rows if r["provider"] == rows[0]["provider"] and r["rails"] == 1]
    ax.plot([r["prompt_tokens"] for r in limit], [r["memcpy_limit_us"] for r in limit], "k--",
            label="memcpy of the reservation's KV (limit)")
    for label, pages, style in (("small", "4 KiB", "r:"), ("huge", "huge", "g:")):
        if pin_rows:
            ax.plot([r["prompt_tokens"] for r in pin_rows],
                    [r[f"{label}_pin_us_median"] + r[f"{label}_unpin_us_median"] for r in pin_rows], style,
                    marker="s", label=f"kernel pin + unpin, {pages} pages (RDMA's share)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (llama3-8b-kv: 32 layers, 128 KiB pages)")
    ax.set_ylabel("microseconds")
    ax.set_title("registering one reservation's windows vs. copying its KV once")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200,
                        help="reservations registered and closed per row (the pin table uses a tenth, at least 5)")
    parser.add_argument("--no-pin", action="store_true",
                        help="skip the kernel pin table (it needs io_uring and root or CAP_IPC_LOCK)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "bench_registration.json",
                        help="where the rows go (the PNG is written beside it)")
    args = parser.parse_args()
    memcpy = memcpy_gbps(1 << 28, 5)["median"]
    providers = [p for p in ("net", "tcp") if p in available_providers()]
    rows = [measure(p, r, t, args.repeats, memcpy) for p in providers for r in RAILS for t in PROMPT_TOKENS]
    print(f"memcpy (one thread, this run): {memcpy:.2f} GB/s")
    print(format_table(rows))
    pin_rows: list[dict[str, Any]] = []
    if not args.no_pin:
        try:
            pin_rows = [measure_pin(t, max(5, args.repeats // 10), memcpy) for t in PROMPT_TOKENS]
            print(format_pin_table(pin_rows))
        except PinUnavailable as e:
            print(f"kernel pin table skipped: {e}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"memcpy_gbps": memcpy, "config": CONFIG.name, "rows": rows,
                                     "kernel_pin_rows": pin_rows}, indent=2))
    plot(rows, pin_rows, args.json.with_suffix(".png"))
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
