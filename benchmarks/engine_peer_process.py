"""Target process of bench_engine.py, and the case geometry both processes share.

bench_engine.py (the initiator) starts this program once per (provider, rails, tunables)
configuration. The target owns a `kvxfer.TransferEngine`, registers one destination region
and prints its descriptor; from then on it obeys one JSON command per stdin line and
answers one JSON line on stdout:

  {"cmd": "case", "spec": {...},          switch to a case; with zero_units, first zero what
   "zero_units": U}                       U units of it can touch; answers {"ok"}
  {"cmd": "arm", "imm": I, "count": N,    answers {"armed"}, then blocks in wait_imm(I, N)
   "source": initiator address hex}       (with --data-plane scoped, I bound to source first)
                                          and answers {"t_end": monotonic seconds, "cpu_s":
                                          process CPU seconds while waiting} once the N-th
                                          unit arrived (consuming them for the next run)
  {"cmd": "verify", "units": U}           CRC32 of what U units of the case wrote here
  {"cmd": "quit"}

The clock is time.monotonic(): CLOCK_MONOTONIC is system-wide on Linux, so the
initiator's submit timestamp and the target's t_end make one valid interval.

`CaseSpec` fixes where every unit (one single write, or one paged write of N pages) lands,
from the spec alone, so both processes agree on the layout and the checksum without
shipping page lists through the pipe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np

SINGLE = "single"
PAGED_RANDOM = "paged-random"
PAGED_ADJACENT = "paged-adjacent"
CASE_KINDS = (SINGLE, PAGED_RANDOM, PAGED_ADJACENT)

# A case whose count is not reached by then fails instead of hanging the whole run; runs
# here last well under a second even under load, so 8 s means stuck, not slow.
WAIT_IMM_TIMEOUT_S = 8.0
# Windows of a scoped descriptor (--data-plane scoped): one per layer of the 8B-shaped model.
SCOPED_WINDOWS = 32
# Golden-ratio multiplier: every 8-byte word of the source region is distinct, so a page
# landing at the wrong index or a torn write changes the checksum.
_PATTERN_MUL = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class CaseSpec:
    """Geometry of one benchmark case; identical on both sides.

    kind "single":         unit k writes `size` bytes at offset (k mod slots) * size, the
                           same offset on both sides.
    kind "paged-adjacent": unit k writes pages [k*N, (k+1)*N) (mod the region) on both
                           sides: the engine may coalesce them into large ops.
    kind "paged-random":   unit k writes N pages picked at random from even page indices,
                           different ones on each side; no two pages of one list are
                           neighbours, so nothing can be coalesced.
    """

    kind: str
    size: int  # bytes per single write, or bytes per page
    pages_per_write: int
    region_bytes: int
    seed: int = 1

    @property
    def pages(self) -> int:
        """Pages (or writes) per unit: what one imm count unit stands for, times units."""
        return 1 if self.kind == SINGLE else self.pages_per_write

    @property
    def unit_bytes(self) -> int:
        return self.size * self.pages

    @property
    def slots(self) -> int:
        """Distinct units before the layout wraps around the region."""
        if self.kind == SINGLE:
            return self.region_bytes // self.size
        pool = self.region_bytes // self.size
        if self.kind == PAGED_ADJACENT:
            return pool // self.pages_per_write
        return (pool // 2) // self.pages_per_write

    @cached_property
    def _random_lists(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        half = (self.region_bytes // self.size) // 2
        n = self.slots * self.pages_per_write
        src = (rng.permutation(half)[:n] * 2).astype(np.int64).reshape(self.slots, -1)
        dst = (rng.permutation(half)[:n] * 2).astype(np.int64).reshape(self.slots, -1)
        return src, dst

    def page_lists(self, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """(src_pages, dst_pages) of paged unit `unit`."""
        k = unit % self.slots
        if self.kind == PAGED_RANDOM:
            src, dst = self._random_lists
            return src[k], dst[k]
        pages = np.arange(k * self.pages_per_write, (k + 1) * self.pages_per_write, dtype=np.int64)
        return pages, pages

    def offset(self, unit: int) -> int:
        """Byte offset (both sides) of single-write unit `unit`."""
        return (unit % self.slots) * self.size

    def checksum(self, region: np.ndarray, units: int, side: str) -> int:
        """CRC32 of the bytes `units` units wrote, read from `region` on `side` (src/dst).

        Random pages are gathered in list order, so a page written to the wrong index
        changes the result even if the multiset of bytes is right.
        """
        n = min(units, self.slots)
        if self.kind != PAGED_RANDOM:
            return zlib.crc32(region[: n * self.unit_bytes])
        src, dst = self._random_lists
        pages = (src if side == "src" else dst)[:n].ravel()
        pool = region[: (self.region_bytes // self.size) * self.size].reshape(-1, self.size)
        crc = 0
        for chunk in np.array_split(pages, max(1, pages.size * self.size // (32 << 20))):
            crc = zlib.crc32(np.ascontiguousarray(pool[chunk]), crc)
        return crc

    def touched_bytes(self, units: int) -> int:
        """Prefix of the region `units` units can touch (the whole region for random)."""
        if self.kind == PAGED_RANDOM:
            return self.region_bytes
        return min(units, self.slots) * self.unit_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def fill_pattern(region: np.ndarray, seed: int = 0) -> None:
    """Fills a uint8 region with distinct 8-byte words (any tail bytes get 0x5a)."""
    words = region[: region.size // 8 * 8].view(np.uint64)
    step = 8 << 20
    for start in range(0, words.size, step):
        chunk = np.arange(start, min(words.size, start + step), dtype=np.uint64)
        np.multiply(chunk ^ np.uint64(seed), _PATTERN_MUL, out=words[start : start + chunk.size])
    region[words.size * 8 :] = 0x5A


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """TransferEngine keyword arguments from the tunables both processes are given."""
    same_host = args.provider == "same-host"
    return dict(
        # "same-host" is the engine's process-to-process path, its immediates over net;
        # every other name is a libfabric provider measured with that path off.
        provider="net" if same_host else args.provider,
        same_host=same_host,
        rails=args.rails,
        bind_host="127.0.0.1",
        transfer_timeout_s=WAIT_IMM_TIMEOUT_S,
        max_inflight_per_rail=args.max_inflight_per_rail,
        idle_spin_us=args.idle_spin_us,
        shard_min_bytes=args.shard_min_bytes,
        # Newer engines only: passed when asked for, so older builds keep working.
        **({} if args.delivery_complete == "default" else {"delivery_complete": args.delivery_complete == "on"}),
        **({} if getattr(args, "progress", "thread") == "thread" else {"progress": args.progress}),
        **({} if getattr(args, "tcp_congestion", "default") == "default" else {"tcp_congestion": args.tcp_congestion}),
    )


def add_engine_arguments(p: argparse.ArgumentParser, lists: bool = False) -> None:
    """The engine tunables (TransferEngine's defaults), shared by both processes' CLIs.

    With `lists`, each takes a comma-separated list (the initiator sweeps combinations).
    """
    suffix = " (comma list: one table per combination)" if lists else ""
    for flag, kind, default, what in (
        ("--max-inflight-per-rail", int, 256, "fabric ops in flight per rail"),
        ("--idle-spin-us", float, 30.0, "progress thread busy-polls this long before sleeping"),
        ("--shard-min-bytes", int, 512 * 1024, "single writes this large are split across rails"),
    ):
        p.add_argument(flag, type=str if lists else kind, default=str(default) if lists else default,
                       help=what + suffix)
    p.add_argument("--delivery-complete", default="default",
                   help="on|off: writes complete only once delivered (engines that have the "
                        "option); default: the engine's own default" + suffix)
    p.add_argument("--data-plane", default="open",
                   help="open: the target hands out its region's own descriptor and counts immediates from "
                        "anyone; scoped: as a decoder with kv_registration=per_reservation does, the region "
                        f"registered again as {SCOPED_WINDOWS} windows with fresh keys, and each run's immediate "
                        "bound to the initiator (the data plane's security, on)" + suffix)
    p.add_argument("--tcp-congestion", default="default",
                   help="TCP congestion control of the engines' connections over tcp/net: default (the "
                        "engine's own: cubic,reno, or KVXFER_TCP_CONGESTION), system (what the system chose), or "
                        "an algorithm's name; A/B: --tcp-congestion system,default" + suffix)
    p.add_argument("--progress", default="thread",
                   help="thread: a progress thread per engine (the default); caller: the thread that made "
                        "the engine drives it inside its own calls (no thread hand-offs; the target then "
                        "makes progress only while it waits for a run's immediates)" + suffix)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(args: argparse.Namespace) -> None:
    """Runs the target: one engine, one region, commands from stdin until quit/EOF."""
    from kvxfer import TransferEngine

    engine = TransferEngine(**engine_kwargs(args))
    if args.provider == "same-host":
        # Where kvxfer keeps its KV cache: a SharedBuffer, mapped by same-host writers.
        from kvxfer import SharedBuffer

        region = SharedBuffer(args.region_bytes).array
    else:
        region = np.zeros(args.region_bytes, dtype=np.uint8)
    mr = engine.register(region)
    descriptor = mr.descriptor
    if args.data_plane == "scoped":
        # What a decoder with kv_registration=per_reservation hands out: the region
        # registered again in windows with fresh keys (one per layer of the 8B-shaped
        # model), so every write is checked against the window list.
        step = args.region_bytes // SCOPED_WINDOWS
        descriptor = engine.register_windows(mr, [(k * step, step) for k in range(SCOPED_WINDOWS)]).descriptor
    _reply({"ready": True, "descriptor": descriptor.hex(), "provider": engine.provider,
            "rails": engine.rails, "pid": os.getpid()})
    spec: CaseSpec | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            if cmd == "quit":
                break
            if cmd == "case":
                spec = CaseSpec(**msg["spec"])
                if msg.get("zero_units"):
                    region[: spec.touched_bytes(msg["zero_units"])] = 0
                _reply({"ok": True})
            elif cmd == "arm":
                imm, count = int(msg["imm"]), int(msg["count"])
                if args.data_plane == "scoped":
                    # A decoder binds its reservation's immediate to the prefiller it named:
                    # immediates from anyone else are dropped and counted, never credited.
                    engine.bind_imm_source(imm, bytes.fromhex(msg["source"]))
                _reply({"armed": True})
                cpu0 = time.process_time()  # all threads: the progress worker's polling too
                engine.wait_imm(imm, count, WAIT_IMM_TIMEOUT_S)
                t_end = time.monotonic()
                cpu_s = time.process_time() - cpu0
                engine.consume_imm(imm, count)
                if args.data_plane == "scoped":
                    engine.unbind_imm_source(imm)
                _reply({"t_end": t_end, "cpu_s": cpu_s})
            elif cmd == "verify":
                assert spec is not None, "verify before case"
                _reply({"crc": spec.checksum(region, int(msg["units"]), "dst")})
            else:
                _reply({"error": f"unknown command {cmd!r}"})
        except Exception as e:  # the initiator records it against the case
            _reply({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", required=True)
    p.add_argument("--rails", type=int, default=1)
    p.add_argument("--region-bytes", type=int, required=True)
    add_engine_arguments(p)
    serve(p.parse_args())


if __name__ == "__main__":
    main()
