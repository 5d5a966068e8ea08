"""How fast is the kvxfer engine here, next to what this machine and bare libfabric allow?

Prints, per provider and rail count, a table shaped like the paper's Table 2: single
writes (4 KiB .. 64 MiB) and paged writes (1 KiB .. 64 KiB pages, at random non-adjacent
indices and at adjacent indices), each as GB/s, Mops/s and CPU seconds per GB (both
processes, all threads), beside limits measured in the same run:

- memcpy and one loopback TCP stream (benchmarks/machine_limits.py), measured before and
  after every table;
- a bare libfabric fi_writedata loop on the same provider (kvxfer-bare-writedata), at
  window 1 (the bare loop T2 names) and deep: as many writes in flight as the engine
  keeps (max_inflight_per_rail per rail, on as many rails, each rail its own endpoint;
  delivery-complete when the engine's writes are), with the CPU seconds per GB of both of
  its processes (getrusage over the timed loop).

and a verdict per target of the issue:
  T1  single writes >= 1 MiB at >= 90% of one loopback TCP stream (tcp-class providers)
  T2  paged writes of 16 KiB pages at random indices at >= 2x the bare loop (window 1)
  T3  adjacent pages at >= 90% of single-write speed (same bytes per write call)
  T4  same host (shm, and the engine's own same-host path) at >= 50% of memcpy
      (single writes >= 1 MiB)
  F1  fabric single writes (4 KiB .. 64 MiB) at >= 0.9x the deep-window bare loop
  F2  fabric paged writes at random indices (1 .. 64 KiB pages) at >= 0.9x the deep bare loop
      (F1 and F2 also per row, in the table's "deep" column: ok / LOW)

Method: the target is a separate process (engine_peer_process.py) that registers a
region and publishes its descriptor. The initiator submits one case's units (a single
write, or a paged write of --pages-per-write pages, each with an immediate) keeping
--window transfers in flight; a run is timed from the first submit to the moment the
target's wait_imm sees the full count (CLOCK_MONOTONIC is system-wide). A warm-up run per
case sizes the runs to about --seconds-per-repeat; the --repeats runs of all cases are
interleaved round-robin (median, min, max). The last run of each case starts from a zeroed
destination and ends with a CRC32 of the written bytes on both sides.

  python benchmarks/bench_engine.py                       # full run, about 5 min idle
  python benchmarks/bench_engine.py --quick               # < 60 s smoke run
  python benchmarks/bench_engine.py --providers net --rails 1 --interleave \\
      --cases paged-random:16K --max-inflight-per-rail 64,256 \\
      --baselines-from benchmarks/results/bench_engine.json --name tune_inflight

Writes <out>/<name>.json and <out>/<name>.png (default benchmarks/results/bench_engine.*).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from engine_peer_process import (  # noqa: E402  (sibling module, path set above)
    PAGED_ADJACENT,
    PAGED_RANDOM,
    SINGLE,
    CaseSpec,
    add_engine_arguments,
    engine_kwargs,
    fill_pattern,
)

try:
    import machine_limits  # noqa: E402  (the other limits benchmark; shared functions)
except ImportError as e:  # pragma: no cover - only when the sibling file is missing
    raise SystemExit(f"bench_engine needs benchmarks/machine_limits.py next to it: {e}")

KIB, MIB = 1 << 10, 1 << 20
SINGLE_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
PAGE_SIZES = [1 * KIB, 2 * KIB, 4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB]
QUICK_SINGLE_SIZES = [64 * KIB, 1 * MIB, 16 * MIB]
QUICK_PAGE_SIZES = [4 * KIB, 16 * KIB, 64 * KIB]
# Where the bare loop runs (see bare_settings): every other size.
BARE_SINGLE_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB]
BARE_W16_PAGE_SIZES = [1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB]

# Targets of the issue, as ratios.
T1_TCP_RATIO, T2_BARE_RATIO, T3_SINGLE_RATIO, T4_MEMCPY_RATIO = 0.90, 2.0, 0.90, 0.50
# F1/F2: the engine against a bare loop that keeps as many writes in flight as it does.
DEEP_BARE_RATIO = 0.90
T1_MIN_SIZE = 1 * MIB
T2_PAGE_SIZE = 16 * KIB
# Paged write calls in flight with the default window (each of --pages-per-write pages:
# 16 x 256 pages keeps far more pages in flight than max_inflight_per_rail).
PAGED_WINDOW = 16
# The deep-window bare runs of a --quick run (each costs seconds of libfabric start-up).
QUICK_DEEP_CASES = ((PAGED_RANDOM, 16 * KIB), (SINGLE, 1 * MIB))
TCP_CLASS_PROVIDERS = ("net", "tcp", "sockets")
# The engine's same-host path (process_vm_writev, immediates over net): not a libfabric
# provider, so its bare-loop baseline is libfabric's own same-host provider, shm.
SAME_HOST = "same-host"
SAME_HOST_CLASS = ("shm", SAME_HOST)


def bare_provider(provider: str) -> str:
    """The libfabric provider whose bare loop is `provider`'s baseline."""
    return "shm" if provider == SAME_HOST else provider

# Deadlines: a stuck peer fails its case instead of hanging the run.
PEER_START_TIMEOUT_S = 60.0
PEER_REPLY_TIMEOUT_S = 30.0
TRANSFER_WAIT_TIMEOUT_S = 8.0
BARE_RUN_TIMEOUT_S = 120.0
# Units per case are bounded so a very fast case cannot take a huge page-list build.
MAX_UNITS_PER_RUN = 100_000
BARE_BINARY = "kvxfer-bare-writedata"
# Immediate of the connection warm-up; cases use 200 and up.
CONNECT_IMM = 199


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'4K', '64M', '1G' or a byte count -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KIB, "M": MIB, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def size_text(n: int) -> str:
    for unit, name in ((1 << 30, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def summary(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": samples}


def load_snapshot() -> dict[str, Any]:
    """Load average and the busiest processes: the noise other users put on the numbers."""
    snap: dict[str, Any] = {"loadavg": list(os.getloadavg()), "time": time.time()}
    try:
        snap["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
        top = subprocess.run(["ps", "-eo", "pcpu,pid,comm", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=5).stdout.splitlines()[1:6]
        snap["top_cpu"] = [line.strip() for line in top]
    except (OSError, subprocess.SubprocessError):
        pass
    return snap


def find_bare_writedata() -> Path:
    """Path of the bare fi_writedata baseline binary.

    Looked up in order: $KVXFER_BARE_WRITEDATA; package data kvxfer/bin next to the
    imported kvxfer (non-editable installs); the CMake build dir build/*/native (editable
    installs, newest first); kvxfer/bin in the environment's site-packages; $PATH.
    """
    candidates: list[Path] = []
    if os.environ.get("KVXFER_BARE_WRITEDATA"):
        candidates.append(Path(os.environ["KVXFER_BARE_WRITEDATA"]))
    try:
        import kvxfer

        candidates.append(Path(kvxfer.__file__).resolve().parent / "bin" / BARE_BINARY)
    except ImportError:
        pass
    built = [Path(p) for p in glob.glob(str(REPO / "build" / "*" / "native" / BARE_BINARY))]
    candidates += sorted(built, key=lambda p: p.stat().st_mtime, reverse=True)
    for key in ("platlib", "purelib"):
        candidates.append(Path(sysconfig.get_paths()[key]) / "kvxfer" / "bin" / BARE_BINARY)
    on_path = shutil.which(BARE_BINARY)
    if on_path:
        candidates.append(Path(on_path))
    candidates = list(dict.fromkeys(candidates))  # platlib and purelib are often one folder
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    looked = "\n  ".join(str(c) for c in candidates) or "(nowhere)"
    raise SystemExit(
        f"{BARE_BINARY} not found; looked in:\n  {looked}\n"
        "Build it with `.venv/bin/pip install --no-build-isolation -e .` (CMake builds it into "
        "build/<tag>/native) or point KVXFER_BARE_WRITEDATA at it."
    )


# --------------------------------------------------------------------------------------
# Limits: memcpy, one TCP stream (machine_limits.py), bare fi_writedata loop
# --------------------------------------------------------------------------------------
def measure_machine_limits(nbytes: int, repeats: int) -> dict[str, Any]:
    return {
        "memcpy": machine_limits.memcpy_gbps(nbytes, repeats),
        "tcp_stream": machine_limits.tcp_stream_gbps(nbytes, repeats),
        "bytes": nbytes,
        "load": load_snapshot(),
    }


def merge_limits(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Several limit measurements (start, between tables, end), pooled."""
    out = {}
    for name in ("memcpy", "tcp_stream"):
        out[name] = summary([s for r in runs for s in r[name]["samples"]])
    return out


def run_bare_once(binary: Path, provider: str, size: int, count: int, window: int,
                  random: bool, rails: int = 1, delivery_complete: bool = False) -> dict[str, Any]:
    region = max(64 * MIB, 4 * size)
    cmd = [str(binary), "--provider", provider, "--size", str(size), "--count", str(count),
           "--window", str(window), "--region", str(region), "--rails", str(rails)]
    if random:
        cmd.append("--random")
    if delivery_complete:
        cmd.append("--delivery-complete")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=BARE_RUN_TIMEOUT_S)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def bare_key(provider: str, size: int, window: int, random: bool, rails: int = 1,
             delivery_complete: bool = False) -> str:
    """Key of one bare-loop setting in the results (window is per rail)."""
    # One rail without delivery-complete keeps the key older result files use.
    extra = (f"/r{rails}" if rails > 1 else "") + ("/dc" if delivery_complete else "")
    return f"{provider}/{size}/w{window}{extra}/{'random' if random else 'seq'}"


@dataclass(frozen=True)
class BareRun:
    """One bare-loop setting to measure: `window` writes in flight per rail."""

    provider: str
    size: int
    window: int
    random: bool
    repeats: int
    rails: int = 1
    delivery_complete: bool = False
    deep: bool = False  # the deep-window baseline of some configuration

    def key(self) -> str:
        return bare_key(self.provider, self.size, self.window, self.random, self.rails, self.delivery_complete)


def measure_bare(binary: Path, run: BareRun, args: argparse.Namespace) -> dict[str, Any]:
    """GB/s, Mops/s and CPU s/GB of the bare loop (median/min/max over `repeats` processes).

    Every invocation pays 1.5-3 s of libfabric start-up (fi_getinfo reads /proc/kallsyms,
    in both of its processes) outside its timed loop, so counts are fixed by a byte budget
    instead of a calibration run, and only T2's baseline is repeated. A deep window gets a
    larger budget and at least 4 windows of writes, so filling and draining the pipeline
    is a small part of the run.
    """
    size = run.size
    if run.deep:
        # At least 4 windows of writes, unless that is over 4x the byte budget (a window of
        # 64 MiB writes is 16 GiB: the engine has 16 such transfers in flight, not 256).
        by_bytes = args.bare_deep_bytes // size
        floor = min(4 * run.window * run.rails, 4 * by_bytes)
        count = max(8, min(max(floor, by_bytes), args.bare_deep_max_ops))
    else:
        count = max(2, min(args.bare_max_ops, args.bare_bytes // size))
    base = {"provider": run.provider, "size": size, "window": run.window, "random": run.random,
            "rails": run.rails, "delivery_complete": run.delivery_complete, "deep": run.deep, "count": count}
    try:
        runs = [run_bare_once(binary, run.provider, size, count, run.window, run.random, run.rails,
                              run.delivery_complete) for _ in range(run.repeats)]
    except (RuntimeError, subprocess.SubprocessError, ValueError) as e:
        return {**base, "error": str(e)}
    out = {**base, "gbps": summary([r["gbytes_per_s"] for r in runs]),
           "mops": summary([r["ops_per_s"] / 1e6 for r in runs]),
           "seconds": [r["seconds"] for r in runs]}
    if all("initiator_cpu_s" in r for r in runs):
        # Both processes over their timed loops: the bare loop busy-polls on both sides.
        out["cpu_s_per_gb"] = summary([(r["initiator_cpu_s"] + r["target_cpu_s"]) / (size * count) * 1e9
                                       for r in runs])
    return out


def pool_bare(first: dict[str, Any], again: dict[str, Any]) -> dict[str, Any]:
    """One bare setting's results over both its rounds (before and after the engine tables):
    every sample of each, so the median sits between the machine's phases. An error in
    either round keeps the other."""
    if "error" in again:
        return {**first, "error_after": again["error"]}
    if "error" in first:
        return again
    out = {**first, "rounds": 2, "seconds": first["seconds"] + again["seconds"]}
    for key in ("gbps", "mops", "cpu_s_per_gb"):
        if key in first and key in again:
            out[key] = summary(first[key]["samples"] + again[key]["samples"])
    return out


def engine_delivery_complete(delivery_complete: str) -> bool:
    """Whether the engine's writes complete on delivery in this setting (on by default)."""
    return delivery_complete != "off"


# --------------------------------------------------------------------------------------
# The engine: target process + initiator
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineConfig:
    """One table: a provider, a rail count and the engine/initiator tunables."""

    provider: str
    rails: int
    window: int
    max_inflight_per_rail: int
    idle_spin_us: float
    shard_min_bytes: int
    delivery_complete: str = "default"
    # "many": write_many/write_paged_many into a CompletionCounter; "handles": one
    # write/write_paged call and one Transfer handle per unit (the pre-batching way).
    submit: str = "many"
    # "thread" or "caller" (TransferEngine's progress, on both sides).
    progress: str = "thread"
    # "open" or "scoped" (the target's descriptor and immediates; engine_peer_process.py).
    data_plane: str = "open"
    # TransferEngine's tcp_congestion on both sides: "default" (the engine's own, cubic,reno, or
    # KVXFER_TCP_CONGESTION), "system", or an algorithm's name.
    tcp_congestion: str = "default"

    @property
    def caller_progress(self) -> bool:
        """Caller-driven progress, which the labels name (thread progress is the default)."""
        return self.progress == "caller"

    def units_in_flight(self, kind: str) -> int:
        """Write calls the initiator keeps in flight: --window, or with the default (0,
        "deep") as many single writes as the deep bare loop keeps (max_inflight_per_rail
        per rail) and PAGED_WINDOW paged calls (each of --pages-per-write pages)."""
        if self.window:
            return self.window
        return self.max_inflight_per_rail * self.rails if kind == SINGLE else PAGED_WINDOW

    def window_text(self) -> str:
        return str(self.window) if self.window else f"deep: {self.units_in_flight(SINGLE)} single / {PAGED_WINDOW} paged"

    def label(self) -> str:
        dc = "" if self.delivery_complete == "default" else f", delivery_complete {self.delivery_complete}"
        how = ("" if self.submit == "many" else f", submit {self.submit}") + \
            (f", progress {self.progress}" if self.caller_progress else "") + \
            (f", data plane {self.data_plane}" if self.data_plane != "open" else "") + \
            (f", tcp_congestion {self.tcp_congestion}" if self.tcp_congestion != "default" else "")
        return (f"{self.provider}, rails={self.rails}{how} (window {self.window_text()}, max_inflight_per_rail "
                f"{self.max_inflight_per_rail}, idle_spin_us {self.idle_spin_us:g}, shard_min_bytes "
                f"{size_text(self.shard_min_bytes)}{dc})")

    def namespace(self) -> argparse.Namespace:
        return argparse.Namespace(provider=self.provider, rails=self.rails,
                                  max_inflight_per_rail=self.max_inflight_per_rail,
                                  idle_spin_us=self.idle_spin_us, shard_min_bytes=self.shard_min_bytes,
                                  delivery_complete=self.delivery_complete, progress=self.progress,
                                  data_plane=self.data_plane, tcp_congestion=self.tcp_congestion)


class TargetProcess:
    """The target (engine_peer_process.py) and its JSON-lines channel, with deadlines."""

    def __init__(self, cfg: EngineConfig, region_bytes: int) -> None:
        cmd = [sys.executable, str(HERE / "engine_peer_process.py"), "--provider", cfg.provider,
               "--rails", str(cfg.rails), "--region-bytes", str(region_bytes),
               "--max-inflight-per-rail", str(cfg.max_inflight_per_rail),
               "--idle-spin-us", str(cfg.idle_spin_us), "--shard-min-bytes", str(cfg.shard_min_bytes),
               "--delivery-complete", cfg.delivery_complete, "--progress", cfg.progress,
               "--data-plane", cfg.data_plane, "--tcp-congestion", cfg.tcp_congestion]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()
        hello = self.read(PEER_START_TIMEOUT_S)
        self.descriptor = bytes.fromhex(hello["descriptor"])

    def _pump_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the target is gone

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = PEER_REPLY_TIMEOUT_S) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"target gave no answer within {timeout_s:.0f} s") from None
        if line is None:
            raise RuntimeError("target exited: " + "".join(self._stderr)[-1500:])
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError("target: " + msg["error"])
        return msg

    def request(self, obj: dict[str, Any], timeout_s: float = PEER_REPLY_TIMEOUT_S) -> dict[str, Any]:
        self.send(obj)
        return self.read(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclass
class Initiator:
    """The initiator side of one configuration: its engine, the source region, the target."""

    cfg: EngineConfig
    src: np.ndarray
    engine: Any = None
    mr: Any = None
    target: TargetProcess | None = None
    threads: list[str] | None = None

    def start(self) -> None:
        from kvxfer import TransferEngine

        self.target = TargetProcess(self.cfg, self.src.size)
        before = set(os.listdir("/proc/self/task"))
        self.engine = TransferEngine(**engine_kwargs(self.cfg.namespace()))
        # This engine's threads plus the submitting one: with --interleave other engines
        # live in this process too, and their idle threads are not this run's cost.
        self.threads = sorted(set(os.listdir("/proc/self/task")) - before) + [str(threading.get_native_id())]
        self.mr = self.engine.register(self.src)
        # Connect now (address exchange, socket handshakes), so that the first case's
        # warm-up, which sizes its runs, measures transfers and not connection set-up.
        self._run(CaseSpec(SINGLE, 4096, 1, self.src.size), 4, CONNECT_IMM)

    def cpu_seconds(self) -> float:
        """CPU time of this initiator's threads (schedstat: nanoseconds on a CPU)."""
        total = 0
        for tid in self.threads:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass
        return total / 1e9

    def stop(self) -> None:
        if self.target is not None:
            self.target.close()
        if self.engine is not None:
            self.engine.close()
        self.engine = self.mr = self.target = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _run(self, spec: CaseSpec, n: int, imm: int) -> dict[str, float]:
        """n units of a case: seconds to the target's full count and to local completion,
        and the CPU seconds both processes spent (all threads) meanwhile."""
        assert self.target is not None
        window = self.cfg.units_in_flight(spec.kind)
        self.target.request({"cmd": "arm", "imm": imm, "count": n * spec.pages,
                             "source": self.engine.address.hex()})
        offsets, lists = None, None
        if spec.kind == SINGLE:
            offsets = np.fromiter((spec.offset(k) for k in range(n)), dtype=np.int64, count=n)
        else:
            lists = tuple(zip(*(spec.page_lists(k) for k in range(n))))
        submit = self._submit_with_handles if self.cfg.submit == "handles" else self._submit_many
        cpu0 = self.cpu_seconds()
        t0 = time.monotonic()
        submit(spec, n, imm, window, offsets, lists)
        t_local = time.monotonic()
        cpu_local = self.cpu_seconds() - cpu0
        done = self.target.read()
        return {"seconds": done["t_end"] - t0, "local": t_local - t0,
                "cpu_initiator_s": cpu_local, "cpu_target_s": done["cpu_s"]}

    def _submit_many(self, spec: CaseSpec, n: int, imm: int, window: int, offsets: np.ndarray | None,
                     lists: tuple[Any, Any] | None) -> None:
        """The way a user with a deep window submits: calls of a quarter window each into one
        CompletionCounter, and one counter wait per call for the window to have room (no
        handle and no GIL round trip per write)."""
        eng, mr, desc = self.engine, self.mr, self.target.descriptor
        batch = max(1, window // 4)
        counter = eng.completion_counter()
        submitted = 0
        while submitted < n:
            end = min(submitted + batch, n)
            if end > window:
                counter.wait(end - window, TRANSFER_WAIT_TIMEOUT_S)
            if offsets is not None:
                part = offsets[submitted:end]
                eng.write_many(mr, part, desc, part, spec.size, imm=imm, counter=counter)
            else:
                eng.write_paged_many(mr, lists[0][submitted:end], desc, lists[1][submitted:end], spec.size,
                                     imm=imm, counter=counter)
            submitted = end
        counter.wait(n, TRANSFER_WAIT_TIMEOUT_S)

    def _submit_with_handles(self, spec: CaseSpec, n: int, imm: int, window: int, offsets: np.ndarray | None,
                             lists: tuple[Any, Any] | None) -> None:
        """The pre-batching way: one call and one Transfer handle per unit, waiting on the
        oldest handle whenever `window` are in flight (--submit handles, for A/B)."""
        eng, mr, desc = self.engine, self.mr, self.target.descriptor
        inflight: deque[Any] = deque()
        for k in range(n):
            if offsets is not None:
                off = int(offsets[k])
                inflight.append(eng.write(mr, off, desc, off, spec.size, imm=imm))
            else:
                inflight.append(eng.write_paged(mr, lists[0][k], desc, lists[1][k], spec.size, imm=imm))
            if len(inflight) >= window:
                inflight.popleft().wait(TRANSFER_WAIT_TIMEOUT_S)
        while inflight:
            inflight.popleft().wait(TRANSFER_WAIT_TIMEOUT_S)

    def calibrate(self, spec: CaseSpec, imm: int, args: argparse.Namespace) -> int:
        """Warm-up run; returns the units that make about --seconds-per-repeat."""
        assert self.target is not None
        max_units = min(MAX_UNITS_PER_RUN, max(args.min_units, 1_000_000 // spec.pages))
        self.target.request({"cmd": "case", "spec": spec.to_json(), "zero_units": 0})
        spec.checksum(self.src, 1, "src")  # builds the random page lists before any timing
        # A run of a few units is mostly pipeline fill and drain, which underrates the steady
        # rate: warm-up and runs move at least warm_bytes, or 4 windows of units if less.
        floor = max(args.min_units, min(4 * self.cfg.units_in_flight(spec.kind),
                                        math.ceil(args.warm_bytes / spec.unit_bytes)))
        n_warm = min(max_units, floor)
        warm_s = self._run(spec, n_warm, imm)["seconds"]
        return max(n_warm, min(max_units, int(n_warm / warm_s * args.seconds_per_repeat)))

    def timed_run(self, spec: CaseSpec, n: int, imm: int, last: bool) -> dict[str, Any]:
        """One timed run. The last run of a case starts from a zeroed destination and is
        followed by the checksum of everything it wrote, on both sides."""
        assert self.target is not None
        self.target.request({"cmd": "case", "spec": spec.to_json(), "zero_units": n if last else 0})
        before = self.engine.stats()
        out = self._run(spec, n, imm)
        after = self.engine.stats()
        out["ops"] = sum(a["ops_posted"] - b["ops_posted"] for a, b in zip(after, before))
        if last:
            self.target.send({"cmd": "verify", "units": n})
            out["crc_src"] = spec.checksum(self.src, n, "src")
            out["crc_dst"] = self.target.read()["crc"]
        return out


class ConfigRun:
    """One configuration's initiator, rows and failure handling inside measure_configs."""

    def __init__(self, cfg: EngineConfig, specs: list[CaseSpec], src: np.ndarray,
                 args: argparse.Namespace) -> None:
        self.cfg = cfg
        self.specs = specs
        self.rows = [{"kind": s.kind, "size": s.size, "bytes_per_unit": s.unit_bytes,
                      "pages_per_unit": s.pages, "runs": []} for s in specs]
        self.config: dict[str, Any] = {
            "provider": cfg.provider, "rails": cfg.rails, "window": cfg.window,
            "submit": cfg.submit, "window_single": cfg.units_in_flight(SINGLE), "window_paged": cfg.units_in_flight(PAGED_RANDOM),
            "max_inflight_per_rail": cfg.max_inflight_per_rail, "idle_spin_us": cfg.idle_spin_us,
            "shard_min_bytes": cfg.shard_min_bytes, "delivery_complete": cfg.delivery_complete,
            "pages_per_write": args.pages_per_write, "progress": cfg.progress, "label": cfg.label(),
            "data_plane": cfg.data_plane, "tcp_congestion": cfg.tcp_congestion,
            "label_short": f"{cfg.provider} rails={cfg.rails}" + (" caller" if cfg.caller_progress else "")
            + (f" {cfg.data_plane}" if cfg.data_plane != "open" else "")
            + (f" {cfg.tcp_congestion}" if cfg.tcp_congestion != "default" else ""),
            "load": load_snapshot(), "cases": self.rows,
        }
        self.initiator = Initiator(cfg, src)
        # Immediates per case; every run consumes what it counted, so values are reused.
        self.imms = [200 + i for i in range(len(specs))]
        try:
            self.initiator.start()
        except Exception as e:
            self.initiator.stop()
            self.config["error"] = f"{type(e).__name__}: {e}"
            for row in self.rows:
                row["error"] = self.config["error"]

    def attempt(self, i: int, what: str, fn: Any, progress: Any) -> Any:
        """Runs fn for case i; on failure records it, restarts both sides, returns None."""
        row = self.rows[i]
        try:
            if "error" in row:
                return None
            progress.set_description(f"{self.cfg.provider} r{self.cfg.rails} {what} {row['kind']} "
                                     f"{size_text(row['size'])}")
            return fn()
        except Exception as e:
            row["error"] = f"{what}: {type(e).__name__}: {e}"
            row["trace"] = traceback.format_exc()
            try:
                self.initiator.restart()
            except Exception as e2:
                row["error"] += f"; restart failed: {e2}"
            return None
        finally:
            progress.update(1)

    def finish(self) -> dict[str, Any]:
        self.initiator.stop()
        for spec, row in zip(self.specs, self.rows):
            if "error" in row or not row["runs"]:
                continue
            n, runs = row["units"], row["runs"]
            secs = [x["seconds"] for x in runs]
            row.update({
                "bytes_per_run": n * spec.unit_bytes,
                "gbps": summary([n * spec.unit_bytes / s / 1e9 for s in secs]),
                "mops": summary([n * spec.pages / s / 1e6 for s in secs]),
                "fabric_ops_per_unit": statistics.mean(x["ops"] for x in runs) / n,
                # CPU seconds per GB moved, both processes, all threads: on a 2-core machine
                # the throughput ceiling is about 2 / this, whatever the load.
                "cpu_s_per_gb": summary([(x["cpu_initiator_s"] + x["cpu_target_s"])
                                         / (n * spec.unit_bytes) * 1e9 for x in runs]),
                "cpu_share_initiator": statistics.mean(
                    x["cpu_initiator_s"] / max(1e-9, x["cpu_initiator_s"] + x["cpu_target_s"]) for x in runs),
                "checksum_ok": runs[-1]["crc_src"] == runs[-1]["crc_dst"],
            })
        return self.config


def measure_configs(cfgs: list[EngineConfig], cases: list[tuple[str, int]], src: np.ndarray,
                    args: argparse.Namespace, progress: Any) -> list[dict[str, Any]]:
    """Every case of the given configurations, repeats interleaved round-robin.

    Runs go case by case, and within a case configuration by configuration, round after
    round: each row's samples spread over the whole measurement, so load that other users
    put on the machine hits all rows (and, when several configurations are given, all of
    them) alike instead of landing on one. A failed case (a stuck transfer, a dead target)
    is recorded, both sides restart, and the case is skipped from then on.
    """
    started = time.monotonic()
    specs = [CaseSpec(kind, size, args.pages_per_write, args.region_bytes) for kind, size in cases]
    runs = [ConfigRun(cfg, specs, src, args) for cfg in cfgs]
    for i, spec in enumerate(specs):
        for cr in runs:
            cr.rows[i]["units"] = cr.attempt(
                i, "warm-up", lambda: cr.initiator.calibrate(spec, cr.imms[i], args), progress)
    for r in range(args.repeats):
        last = r == args.repeats - 1
        for i, spec in enumerate(specs):
            for cr in runs:
                run = cr.attempt(i, f"run {r + 1}/{args.repeats}",
                                 lambda: cr.initiator.timed_run(spec, cr.rows[i]["units"], cr.imms[i], last),
                                 progress)
                if run is not None:
                    cr.rows[i]["runs"].append(run)
    out = [cr.finish() for cr in runs]
    for config in out:
        config["elapsed_s"] = time.monotonic() - started
    return out


# --------------------------------------------------------------------------------------
# Cases, verdicts, table, plot
# --------------------------------------------------------------------------------------
def case_list(args: argparse.Namespace) -> list[tuple[str, int]]:
    single = QUICK_SINGLE_SIZES if args.quick else SINGLE_SIZES
    pages = QUICK_PAGE_SIZES if args.quick else PAGE_SIZES
    cases = [(SINGLE, s) for s in single]
    cases += [(PAGED_RANDOM, p) for p in pages] + [(PAGED_ADJACENT, p) for p in pages]
    if args.cases:
        wanted = []
        for item in args.cases.split(","):
            kind, _, size = item.partition(":")
            if kind not in (SINGLE, PAGED_RANDOM, PAGED_ADJACENT):
                raise SystemExit(f"--cases: unknown kind {kind!r}")
            wanted.append((kind, parse_size(size)) if size else (kind, None))
        cases = [c for c in cases if any(k == c[0] and (s is None or s == c[1]) for k, s in wanted)]
        cases += [(k, s) for k, s in wanted if s is not None and (k, s) not in cases]
    return cases


def bare_settings(cases: list[tuple[str, int]], configs: list[EngineConfig], repeats: int,
                  windows: tuple[int, ...], only_t2: bool) -> list[BareRun]:
    """The bare runs the tables show.

    Every bare invocation spends 1.5-3 s in libfabric start-up here, so the shallow loop
    runs where it answers something: random pages at every page size (window 1; window 16,
    if asked for, at every other size), single writes at every other size (window 1);
    adjacent rows compare with single writes instead. T2's baseline (random, 16 KiB) gets
    the full repeats, the others one run each; with `only_t2` (quick runs) it is the only
    shallow run. The deep-window loop (F1, F2) runs at every single and random-page size of
    every configuration on a libfabric provider (same-host has no fabric to compare with);
    quick runs only at QUICK_DEEP_CASES.
    """
    out: list[BareRun] = []

    def add(run: BareRun) -> None:
        if all(r.key() != run.key() for r in out):
            out.append(run)

    for provider in dict.fromkeys(c.provider for c in configs):
        for kind, size in cases:
            rnd = kind == PAGED_RANDOM
            if kind == PAGED_ADJACENT or (only_t2 and (kind, size) != (PAGED_RANDOM, T2_PAGE_SIZE)):
                continue
            if kind == SINGLE and size not in BARE_SINGLE_SIZES:
                continue
            for window in windows if rnd else windows[:1]:
                if window != 1 and size not in BARE_W16_PAGE_SIZES and size != T2_PAGE_SIZE:
                    continue
                add(BareRun(bare_provider(provider), size, window, rnd,
                            repeats if rnd and size == T2_PAGE_SIZE else 1))
    for cfg in configs:
        if cfg.provider == SAME_HOST:
            continue
        for kind, size in cases:
            if kind == PAGED_ADJACENT or (only_t2 and (kind, size) not in QUICK_DEEP_CASES):
                continue
            add(BareRun(cfg.provider, size, cfg.max_inflight_per_rail, kind == PAGED_RANDOM, 1,
                        cfg.rails, engine_delivery_complete(cfg.delivery_complete), deep=True))
    return out


def deep_bare(config: dict[str, Any], bare: dict[str, Any], kind: str, size: int) -> dict[str, Any] | None:
    """The deep-window bare result a case row of `config` compares with, if measured."""
    if kind == PAGED_ADJACENT or config["provider"] == SAME_HOST:
        return None
    b = bare.get(bare_key(config["provider"], size, config["max_inflight_per_rail"], kind == PAGED_RANDOM,
                          config["rails"], engine_delivery_complete(config["delivery_complete"])))
    return b if b and "gbps" in b else None


def interpolate_single(cases: dict[tuple[str, int], dict[str, Any]], nbytes: int) -> tuple[float, str] | None:
    """Single-write GB/s at `nbytes`, log-interpolated between measured sizes."""
    pts = sorted((s, r["gbps"]["median"]) for (k, s), r in cases.items() if k == SINGLE and "gbps" in r)
    if not pts:
        return None
    for s, g in pts:
        if s == nbytes:
            return g, size_text(s)
    below = [p for p in pts if p[0] < nbytes]
    above = [p for p in pts if p[0] > nbytes]
    if not below or not above:
        s, g = (below or above)[-1 if below else 0]
        return g, f"{size_text(s)} (nearest)"
    (s0, g0), (s1, g1) = below[-1], above[0]
    f = (math.log2(nbytes) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
    return g0 + f * (g1 - g0), f"{size_text(nbytes)} (interp.)"


def annotate(config: dict[str, Any], limits: dict[str, Any], bare: dict[str, Any]) -> None:
    """Adds ratios to every case row of one configuration."""
    provider = config["provider"]
    by_key = {(c["kind"], c["size"]): c for c in config["cases"]}
    tcp = limits["tcp_stream"]["median"]
    memcpy = limits["memcpy"]["median"]
    for c in config["cases"]:
        if "gbps" not in c:
            continue
        g = c["gbps"]["median"]
        c["x_tcp_stream"] = g / tcp
        c["x_memcpy"] = g / memcpy
        for window in (1, 16):
            if c["kind"] == PAGED_ADJACENT:
                break
            b = bare.get(bare_key(bare_provider(provider), c["size"], window, c["kind"] == PAGED_RANDOM))
            if b and "gbps" in b:
                c[f"bare_w{window}_gbps"] = b["gbps"]["median"]
                c[f"x_bare_w{window}"] = g / b["gbps"]["median"]
        deep = deep_bare(config, bare, c["kind"], c["size"])
        if deep:
            c["bare_deep_gbps"] = deep["gbps"]["median"]
            c["x_bare_deep"] = g / deep["gbps"]["median"]
            c["bare_deep_cpu_s_per_gb"] = deep.get("cpu_s_per_gb", {}).get("median")
            c["deep_met"] = c["x_bare_deep"] >= DEEP_BARE_RATIO
        if c["kind"] == PAGED_ADJACENT:
            ref = interpolate_single(by_key, c["bytes_per_unit"])
            if ref:
                c["single_ref_gbps"], c["single_ref"] = ref
                c["x_single"] = g / ref[0]


def verdicts(config: dict[str, Any]) -> list[dict[str, Any]]:
    """One verdict per target that applies to this configuration's provider."""
    rows = [c for c in config["cases"] if "gbps" in c]
    out = []

    def verdict(target: str, text: str, ratios: list[tuple[str, float]], need: float) -> None:
        if not ratios:
            out.append({"target": target, "text": text, "met": None, "detail": "not measured"})
            return
        worst = min(r for _, r in ratios)
        met = worst >= need
        detail = ", ".join(f"{name} {r:.2f}" for name, r in ratios)
        out.append({"target": target, "text": text, "met": met, "need": need, "worst": worst,
                    "ratios": dict(ratios), "detail": detail})

    if config["provider"] in TCP_CLASS_PROVIDERS:
        verdict("T1", f"single writes >= 1 MiB at >= {T1_TCP_RATIO:.0%} of one TCP stream",
                [(size_text(c["size"]), c["x_tcp_stream"]) for c in rows
                 if c["kind"] == SINGLE and c["size"] >= T1_MIN_SIZE], T1_TCP_RATIO)
    verdict("T2", f"paged {size_text(T2_PAGE_SIZE)} random at >= {T2_BARE_RATIO:g}x bare loop (window 1)",
            [(size_text(c["size"]), c["x_bare_w1"]) for c in rows
             if c["kind"] == PAGED_RANDOM and c["size"] == T2_PAGE_SIZE and "x_bare_w1" in c],
            T2_BARE_RATIO)
    verdict("T3", f"adjacent {size_text(T2_PAGE_SIZE)} pages at >= {T3_SINGLE_RATIO:.0%} of single writes",
            [(size_text(c["size"]), c["x_single"]) for c in rows
             if c["kind"] == PAGED_ADJACENT and c["size"] == T2_PAGE_SIZE and "x_single" in c],
            T3_SINGLE_RATIO)
    if config["provider"] != SAME_HOST:
        verdict("F1", f"single writes at >= {DEEP_BARE_RATIO:g}x the deep-window bare loop",
                [(size_text(c["size"]), c["x_bare_deep"]) for c in rows
                 if c["kind"] == SINGLE and "x_bare_deep" in c], DEEP_BARE_RATIO)
        verdict("F2", f"random pages at >= {DEEP_BARE_RATIO:g}x the deep-window bare loop",
                [(size_text(c["size"]), c["x_bare_deep"]) for c in rows
                 if c["kind"] == PAGED_RANDOM and "x_bare_deep" in c], DEEP_BARE_RATIO)
    if config["provider"] in SAME_HOST_CLASS:
        verdict("T4", f"same host single writes >= 1 MiB at >= {T4_MEMCPY_RATIO:.0%} of memcpy",
                [(size_text(c["size"]), c["x_memcpy"]) for c in rows
                 if c["kind"] == SINGLE and c["size"] >= T1_MIN_SIZE], T4_MEMCPY_RATIO)
    return out


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(config: dict[str, Any], limits: dict[str, Any]) -> None:
    tcp, memcpy = limits["tcp_stream"]["median"], limits["memcpy"]["median"]
    print(f"\n== {config['label']}   load {config['load']['loadavg'][0]:.1f}")
    where = config.get("limits_source", "measured around this table")
    print(f"   limits {where}: TCP stream {tcp:.2f} GB/s, memcpy {memcpy:.2f} GB/s; "
          f"{config['pages_per_write']} pages per paged write")
    deep_window = config["max_inflight_per_rail"] * config["rails"]
    print(f"   deep = bare fi_writedata loop with {config['max_inflight_per_rail']} writes in flight per rail x "
          f"{config['rails']} rail(s) = {deep_window}; 'deep' column: ok if x deep >= {DEEP_BARE_RATIO:g}")
    head = (f"{'case':<22}{'GB/s':>7} {'min..max':>12}{'Mops/s':>9}{'CPU s/GB':>9}{'xTCP':>6}{'xmemcpy':>8}"
            f"{'bare1':>7}{'x bare1':>8}{'deep':>7}{'x deep':>7}{'CPU/GB':>7}{'deep':>5}  {'x single':<8}")
    print(head)
    print("-" * len(head))
    names = {SINGLE: "single", PAGED_RANDOM: "paged random", PAGED_ADJACENT: "paged adjacent"}
    for c in config["cases"]:
        name = f"{names[c['kind']]} {size_text(c['size'])}"
        if "gbps" not in c:
            print(f"{name:<22}  FAILED: {c.get('error', '?')[:90]}")
            continue
        g = c["gbps"]
        xs = f"{c['x_single']:.2f} vs {c['single_ref']}" if "x_single" in c else ""
        bad = "" if c["checksum_ok"] else "  CHECKSUM MISMATCH"
        print(f"{name:<22}{g['median']:>7.3f} {g['min']:>5.2f}..{g['max']:<5.2f}{c['mops']['median']:>9.4g}"
              f"{c['cpu_s_per_gb']['median']:>9.2f}{c['x_tcp_stream']:>6.2f}{c['x_memcpy']:>8.2f}{fmt(c.get('bare_w1_gbps'), '.3f'):>7}"
              f"{fmt(c.get('x_bare_w1')):>8}{fmt(c.get('bare_deep_gbps'), '.3f'):>7}"
              f"{fmt(c.get('x_bare_deep')):>7}{fmt(c.get('bare_deep_cpu_s_per_gb')):>7}"
              f"{ {True: 'ok', False: 'LOW', None: '-'}[c.get('deep_met')]:>5}  {xs}{bad}")
    for v in config["verdicts"]:
        if v["met"] is None:
            continue
        state = {True: "MET", False: "NOT MET", None: "n/a"}[v["met"]]
        worst = f" (worst ratio {v['worst']:.3f}, need {v['need']:g})" if v["met"] is not None else ""
        print(f"  {v['target']} {v['text']}: {state}{worst}  [{v['detail']}]")


def overall(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per target: met by which configurations (a target counts as met if any rail count meets it)."""
    out = []
    for target in ("T1", "T2", "T3", "T4", "F1", "F2"):
        rows = [(c["label_short"], v) for c in configs for v in c["verdicts"] if v["target"] == target]
        if not rows:
            continue
        out.append({
            "target": target,
            "text": rows[0][1]["text"],
            "met_by": [name for name, v in rows if v["met"]],
            "not_met_by": [f"{name} (worst {v['worst']:.2f})" for name, v in rows if v["met"] is False],
        })
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = list(dict.fromkeys(c["provider"] for c in result["configs"]))
    fig, axes = plt.subplots(len(providers), 2, figsize=(13, 4.2 * len(providers)), squeeze=False)
    tcp = result["limits"]["tcp_stream"]["median"]
    memcpy = result["limits"]["memcpy"]["median"]
    bare = result["bare"]
    for row, provider in enumerate(providers):
        for col, kinds in enumerate(((SINGLE,), (PAGED_RANDOM, PAGED_ADJACENT))):
            ax = axes[row][col]
            for cfg in (c for c in result["configs"] if c["provider"] == provider):
                for kind in kinds:
                    pts = [c for c in cfg["cases"] if c["kind"] == kind and "gbps" in c]
                    if not pts:
                        continue
                    x = [c["size"] for c in pts]
                    y = [c["gbps"]["median"] for c in pts]
                    err = [[c["gbps"]["median"] - c["gbps"]["min"] for c in pts],
                           [c["gbps"]["max"] - c["gbps"]["median"] for c in pts]]
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3,
                                label=f"kvxfer {kind} ({cfg['label_short'].split(' ', 1)[1]})")
            for cfg in (c for c in result["configs"] if c["provider"] == provider):
                deep = sorted((c["size"], c["bare_deep_gbps"]) for c in cfg["cases"]
                              if c["kind"] == kinds[0] and "bare_deep_gbps" in c)
                if deep:
                    ax.plot(*zip(*deep), "--", marker="+",
                            label=f"bare deep window ({cfg['label_short'].split(' ', 1)[1]})")
            for window, style in ((1, ":"), (16, "-.")):
                # The bare loop that each panel's rows compare with (adjacent rows: none).
                for kind in (kinds[0],):
                    rnd = kind == PAGED_RANDOM
                    pts = sorted((b["size"], b["gbps"]["median"]) for b in bare.values()
                                 if b["provider"] == provider and b["window"] == window
                                 and b["random"] == rnd and "gbps" in b
                                 and b["size"] in (SINGLE_SIZES if kind == SINGLE else PAGE_SIZES))
                    if pts:
                        ax.plot(*zip(*pts), style, marker="x", color="gray" if window == 1 else "black",
                                label=f"bare fi_writedata w{window} {'random' if rnd else 'seq'}")
            ax.axhline(tcp, color="tab:red", lw=1, ls="--", label=f"TCP stream {tcp:.2f}")
            ax.axhline(memcpy, color="tab:green", lw=1, ls="--", label=f"memcpy {memcpy:.2f}")
            ax.set_xscale("log", base=2)
            ticks = SINGLE_SIZES if col == 0 else PAGE_SIZES
            ax.set_xticks(ticks, [size_text(t).replace(" ", "") for t in ticks], fontsize=8)
            ax.set_xlabel("write size" if col == 0 else f"page size ({result['configs'][0]['pages_per_write']} pages per write)")
            ax.set_ylabel("GB/s")
            ax.set_title(f"{provider}: {'single writes' if col == 0 else 'paged writes'}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    load = result["meta"]["load_start"]["loadavg"][0]
    fig.suptitle(f"kvxfer engine vs limits ({result['meta']['host']}, {os.cpu_count()} cores, load {load:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--providers", default=f"net,shm,tcp,{SAME_HOST}",
                   help=f"comma list of libfabric providers (run with the same-host path off) and "
                        f"{SAME_HOST!r}, the engine's process-to-process path (default net,shm,tcp,{SAME_HOST})")
    p.add_argument("--rails", default=None, help="comma list of rail counts (default 1,2; quick 1)")
    p.add_argument("--quick", action="store_true", help="few sizes, small totals: < 60 s")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 3, quick 2)")
    p.add_argument("--window", default="deep",
                   help="write calls in flight at the initiator (comma list); deep: as many single writes as "
                        f"the deep bare loop, {PAGED_WINDOW} paged calls")
    p.add_argument("--pages-per-write", type=int, default=256, help="pages per paged write call")
    p.add_argument("--submit", default="many",
                   help="many (write_many into a counter) or handles (one call and handle per unit); comma list")
    p.add_argument("--region-bytes", default=None, help="registered region on each side (256M, quick 64M)")
    p.add_argument("--seconds-per-repeat", type=float, default=None,
                   help="aim of one timed run (default 0.15, quick 0.05)")
    p.add_argument("--cases", default="", help="only these, e.g. single:1M,paged-random:16K,paged-adjacent")
    p.add_argument("--baselines-from", default="", help="reuse limits and bare results of this JSON")
    p.add_argument("--out", default=str(HERE / "results"), help="output folder")
    p.add_argument("--name", default="bench_engine", help="file stem of the JSON and PNG")
    p.add_argument("--interleave", action="store_true",
                   help="keep every configuration alive and alternate their runs (for A/B sweeps)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--deep-after", choices=("on", "off"), default="on",
                   help="run the deep bare loop again after the engine tables and pool both runs "
                        "(default on; the machine's speed drifts by up to 2x over minutes, so one run "
                        "before the tables could meet the engine in another phase)")
    add_engine_arguments(p, lists=True)
    a = p.parse_args(argv)
    a.repeats = a.repeats or (2 if a.quick else 3)
    a.rails = a.rails or ("1" if a.quick else "1,2")
    a.seconds_per_repeat = a.seconds_per_repeat or (0.05 if a.quick else 0.15)
    a.warm_bytes = (8 if a.quick else 32) * MIB
    a.min_units = 3
    # Bare loop counts: about 0.1-0.3 s per run here at window 1.
    a.bare_bytes = (16 if a.quick else 64) * MIB
    a.bare_max_ops = 600 if a.quick else 2000
    # Window 1 is T2's bare loop; the deep window (F1, F2) replaced window 16 as the ceiling.
    a.bare_windows = (1,)
    # Deep-window runs: more bytes, so the pipeline's fill and drain stay a small part.
    a.bare_deep_bytes = (64 if a.quick else 256) * MIB
    # Small writes over tcp ran at about 4,000/s under load here: 40,000 is 10 s.
    a.bare_deep_max_ops = 20_000 if a.quick else 40_000
    a.limits_bytes = (64 if a.quick else 256) * MIB
    a.limits_repeats = 3 if a.quick else 5
    a.region_bytes = parse_size(a.region_bytes or ("64M" if a.quick else "256M"))
    return a


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from kvxfer.transfer.engine import available_providers

    args = parse_args(argv)
    started = time.monotonic()
    providers = [p for p in args.providers.split(",") if p]
    present = available_providers()
    missing = [p for p in providers if p not in present and p != SAME_HOST]
    if missing:
        raise SystemExit(f"providers {missing} not available here (have {present})")
    configs = [
        EngineConfig(p, int(r), 0 if w == "deep" else int(w), int(mi), float(sp), parse_size(sh), dc, sub, pr, dp, cc)
        for p, r, w, mi, sp, sh, dc, sub, pr, dp, cc in itertools.product(
            providers, args.rails.split(","), args.window.split(","),
            args.max_inflight_per_rail.split(","), args.idle_spin_us.split(","),
            args.shard_min_bytes.split(","), args.delivery_complete.split(","), args.submit.split(","),
            args.progress.split(","), args.data_plane.split(","), args.tcp_congestion.split(","))
    ]
    for cfg in configs:
        if cfg.submit not in ("many", "handles"):
            raise SystemExit(f"--submit takes many or handles, not {cfg.submit!r}")
        if cfg.progress not in ("thread", "caller"):
            raise SystemExit(f"--progress takes thread or caller, not {cfg.progress!r}")
        if cfg.data_plane not in ("open", "scoped"):
            raise SystemExit(f"--data-plane takes open or scoped, not {cfg.data_plane!r}")
        if cfg.delivery_complete not in ("default", "on", "off"):
            raise SystemExit(f"--delivery-complete takes default, on or off, not {cfg.delivery_complete!r}")
    cases = case_list(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    meta: dict[str, Any] = {
        "argv": sys.argv[1:] if argv is None else argv,
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "load_start": load_snapshot(),
    }
    try:
        import hashlib

        from kvxfer import _native

        # Others may rebuild the engine between runs: name the exact binary measured.
        native = Path(_native.__file__)
        meta["native_build"] = {"path": str(native), "mtime": native.stat().st_mtime,
                                "sha256": hashlib.sha256(native.read_bytes()).hexdigest()[:16]}
        meta["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=5).stdout.strip()
        meta["git_dirty_native"] = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "native"],
            capture_output=True, text=True, timeout=5).stdout.split("\n")
        meta["libfabric"] = subprocess.run(["fi_info", "--version"], capture_output=True, text=True,
                                           timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        pass

    baselines = json.loads(Path(args.baselines_from).read_text()) if args.baselines_from else None
    binary = None if baselines else find_bare_writedata()
    meta["bare_binary"] = str(binary) if binary else f"from {args.baselines_from}"
    bare_todo = [] if baselines else bare_settings(cases, configs, args.repeats, args.bare_windows, args.quick)

    # The deep runs again after the engine tables, pooled with the first (--deep-after).
    deep_again = [r for r in bare_todo if r.deep] if args.deep_after == "on" else []
    n_limits = 0 if baselines else (2 if args.interleave else len(configs) + 2)
    progress = tqdm(total=n_limits + len(bare_todo) + len(deep_again) + len(configs) * len(cases) * (1 + args.repeats),
                    unit="step", dynamic_ncols=True, file=sys.stderr)

    def limits_now(when: str) -> dict[str, Any]:
        progress.set_description(f"limits ({when})")
        run = measure_machine_limits(args.limits_bytes, args.limits_repeats)
        run["when"] = when
        progress.update(1)
        return run

    # Limits are measured before the bare loops, between configurations and at the end;
    # each table's ratios use the two measurements around it (the load changes).
    limit_runs = [] if baselines else [limits_now("start")]
    bare: dict[str, Any] = dict(baselines["bare"]) if baselines else {}
    for run in bare_todo:
        progress.set_description(f"bare {run.provider} {size_text(run.size)} w{run.window} r{run.rails}"
                                 f"{' rnd' if run.random else ''}")
        t = time.monotonic()
        b = bare[run.key()] = measure_bare(binary, run, args)
        b["elapsed_s"] = time.monotonic() - t
        progress.update(1)

    src = np.empty(args.region_bytes, dtype=np.uint8)
    fill_pattern(src)
    results = []
    # Sequential: one configuration after the other, limits measured between them.
    # Interleaved (--interleave): all configurations alive at once, runs alternating.
    groups = [configs] if args.interleave else [[cfg] for cfg in configs]
    limits_of_group = []
    for group in groups:
        if not baselines and not args.interleave:
            limit_runs.append(limits_now(f"before {group[0].provider} rails={group[0].rails}"))
        results += measure_configs(group, cases, src, args, progress)
        limits_of_group += [len(limit_runs) - 1] * len(group)
    if baselines:
        limit_runs = baselines["limit_runs"]
    else:
        for run in deep_again:
            progress.set_description(f"bare again {run.provider} {size_text(run.size)} r{run.rails}"
                                     f"{' rnd' if run.random else ''}")
            bare[run.key()] = pool_bare(bare[run.key()], measure_bare(binary, run, args))
            progress.update(1)
        limit_runs.append(limits_now("end"))
    progress.close()

    limits = merge_limits(limit_runs)
    sweep = len(configs) > (len(providers) * len(args.rails.split(",")) * len(args.progress.split(","))
                            * len(args.data_plane.split(",")) * len(args.tcp_congestion.split(",")))
    for k, config in enumerate(results):
        if sweep:
            config["label_short"] += (f" w{config['window']} inflight{config['max_inflight_per_rail']} "
                                      f"spin{config['idle_spin_us']:g} shard{size_text(config['shard_min_bytes'])}"
                                      f" dc-{config['delivery_complete']}")
        # Sequential tables use the measurements just before and just after them.
        before = limits_of_group[k]
        pooled = baselines or args.interleave
        config["limits"] = limits if pooled else merge_limits(limit_runs[before : before + 2])
        if pooled:
            config["limits_source"] = f"from {args.baselines_from}" if baselines else "pooled over the run"
        annotate(config, config["limits"], bare)
        config["verdicts"] = verdicts(config)
    meta["load_end"] = load_snapshot()
    meta["elapsed_s"] = time.monotonic() - started
    result = {"meta": meta, "args": {k: v for k, v in vars(args).items()},
              "limits": limits, "limit_runs": limit_runs, "bare": bare, "configs": results,
              "overall": overall(results)}

    print(f"\nkvxfer engine benchmark: {meta['host']}, {meta['cpus']} cores, "
          f"load {meta['load_start']['loadavg'][0]:.1f} -> {meta['load_end']['loadavg'][0]:.1f}, "
          f"{meta['elapsed_s']:.0f} s")
    print(f"limits (all {len(limit_runs)} measurements pooled): memcpy {limits['memcpy']['median']:.2f} GB/s "
          f"[{limits['memcpy']['min']:.2f}..{limits['memcpy']['max']:.2f}], one TCP stream "
          f"{limits['tcp_stream']['median']:.2f} GB/s "
          f"[{limits['tcp_stream']['min']:.2f}..{limits['tcp_stream']['max']:.2f}]"
          + (f"  (from {args.baselines_from})" if baselines else ""))
    for config in results:
        print_table(config, config["limits"])
    print("\nTargets (met if any configuration listed meets it):")
    for o in result["overall"]:
        if not o["met_by"] and not o["not_met_by"]:
            continue
        print(f"  {o['target']} {o['text']}: met by {o['met_by'] or 'none'}; "
              f"not met by {o['not_met_by'] or 'none'}")
    bad = [c for cfg in results for c in cfg["cases"] if "error" in c or not c.get("checksum_ok", True)]
    json_path = out_dir / f"{args.name}.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        png_path = out_dir / f"{args.name}.png"
        plot(result, png_path)
        print(f"wrote {png_path}")
    if bad:
        print(f"{len(bad)} case(s) failed or did not verify", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
