"""Shared target/initiator loop for the peer programs of compare_peers.py.

Each `*_peer.py` program runs in its own virtual environment (it may only rely on numpy
and the standard library from here) and plugs one transfer system into this loop through
a small `PeerSystem` class. The loop owns everything that must be identical across
systems so that the numbers compare: the workloads (bulk writes, a KV push shaped like
one Llama-3-8B request, 4 KiB latency), the buffers and their data pattern, the
per-repeat handshake, the clocks and the data verification.

Protocol between the two processes of one run (all on 127.0.0.1):
  1. The target sets up its engine and destination buffer, listens on a control socket
     and publishes {ctrl_port, info} by atomically writing `--rendezvous` (a JSON file).
  2. The initiator reads that file, sets up its engine, connects to the control socket and
     sends `hello` with its own info (NIXL needs the initiator's metadata, for example).
  3. For every repeat (warm-up ones first): the initiator sends `arm`; the target clears
     its destination and its completion counters and answers `armed`; the initiator takes
     t0 = time.monotonic() and transfers. For the KV workload the target stamps t_recv as
     soon as its receiver-side completion signal fires (it is not told by the initiator).
     Then the initiator sends `check` and the target verifies every byte against the
     pattern and answers with the verdict and t_recv. CLOCK_MONOTONIC is system-wide on
     Linux, so t_recv - t0 is a valid cross-process interval.
  4. Both sides write their result JSON (`--result`) and leave with os._exit (NIXL may
     crash at interpreter exit, after the result is on disk).

Every blocking step has a deadline (`--timeout-s`), so a stuck peer ends with a failure
record instead of a hang; compare_peers.py also kills the process group past its own
deadline.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import sys
import time
import traceback
from typing import Any

import numpy as np

# Golden-ratio multiplier: word i of the source holds (i ^ seed_mix) * _PATTERN_MUL, so
# every 8-byte word of every page is distinct and a page landing at the wrong index, a
# torn page or a missing write all show up as mismatches.
_PATTERN_MUL = np.uint64(0x9E3779B97F4A7C15)
_SEED_MUL = 0xD1B54A32D192ED03
# Words generated per numpy step when filling/verifying: bounds temporary memory (64 MiB).
_PATTERN_CHUNK_WORDS = 8 << 20

KV_IMM = 9
BULK_IMM = 7


# --------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------
class Workload:
    """Geometry of one workload, identical on both sides (derived from the CLI).

    kind "bulk": `total` bytes as writes of `write_size`, offset i*write_size on both sides.
    kind "kv":   a KV cache laid out [layers, pages, 2 (K,V), page_size] on both sides
                 (the layout of docs/architecture.md), with `pages` request pages written
                 from source pages 0..N-1 to random destination pages of a larger pool;
                 one write per (layer, K|V, page).
    kind "lat":  one write of `write_size` bytes, `iters` times, timed one by one.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.kind: str = args.workload
        self.write_size: int = int(args.write_size)
        self.seed: int = int(args.seed)
        if self.kind == "bulk":
            self.total = int(args.total_bytes)
            if self.total % self.write_size:
                raise ValueError("total_bytes must be a multiple of write_size")
            self.n_writes = self.total // self.write_size
            self.src_bytes = self.dst_bytes = self.total
        elif self.kind == "kv":
            self.layers = int(args.layers)
            self.page_size = int(args.page_size)
            # K (or V) bytes per token per layer: Llama-3-8B has 8 KV heads x 128 dims x
            # 2 bytes (bf16) = 2 KiB, so a 16 KiB page holds 8 tokens of K (or of V).
            per_page_tokens = max(1, self.page_size // int(args.kv_token_bytes))
            self.pages = -(-int(args.tokens) // per_page_tokens)
            # The decoder's pool is larger than one request so destination pages scatter.
            self.pool_pages = self.pages + max(1, self.pages // 4)
            rng = np.random.default_rng(self.seed)
            self.src_pages = np.arange(self.pages, dtype=np.int64)
            self.dst_pages = np.sort(
                rng.choice(self.pool_pages, size=self.pages, replace=False)
            ).astype(np.int64)
            rng.shuffle(self.dst_pages)
            self.n_writes = self.layers * 2 * self.pages
            self.total = self.n_writes * self.page_size
            self.src_bytes = self.layers * self.pages * 2 * self.page_size
            self.dst_bytes = self.layers * self.pool_pages * 2 * self.page_size
        elif self.kind == "lat":
            self.iters = int(args.iters)
            self.total = self.write_size
            self.n_writes = 1
            # A little room so the write does not sit at offset 0 of a fresh mapping.
            self.src_bytes = self.dst_bytes = max(1 << 20, 2 * self.write_size)
        else:
            raise ValueError(f"unknown workload {self.kind!r}")

    # Offsets of the KV writes, for systems that take explicit address lists.
    def kv_stride(self) -> int:
        return 2 * self.page_size

    def kv_src_offset(self, layer: int, kv: int) -> int:
        return ((layer * self.pages) * 2 + kv) * self.page_size

    def kv_dst_offset(self, layer: int, kv: int) -> int:
        return ((layer * self.pool_pages) * 2 + kv) * self.page_size

    def kv_segments(self) -> tuple[np.ndarray, np.ndarray]:
        """(src_offsets, dst_offsets) of every KV write, int64, in submission order:
        layer by layer, K then V, request pages in order."""
        stride = self.kv_stride()
        src, dst = [], []
        for layer in range(self.layers):
            for kv in range(2):
                src.append(self.kv_src_offset(layer, kv) + self.src_pages * stride)
                dst.append(self.kv_dst_offset(layer, kv) + self.dst_pages * stride)
        return np.concatenate(src), np.concatenate(dst)

    def bulk_offsets(self) -> np.ndarray:
        return np.arange(self.n_writes, dtype=np.int64) * self.write_size


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=["target", "initiator"], required=True)
    p.add_argument("--workload", choices=["bulk", "kv", "lat"], required=True)
    p.add_argument("--rendezvous", required=True, help="JSON file the target publishes")
    p.add_argument("--result", required=True, help="where this side writes its result JSON")
    p.add_argument("--total-bytes", type=int, default=1 << 30)
    p.add_argument("--write-size", type=int, default=64 << 10)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16 << 10)
    p.add_argument("--kv-token-bytes", type=int, default=2048)
    p.add_argument("--iters", type=int, default=1000, help="latency samples")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--depth", type=int, default=64, help="writes in flight (bulk)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each step")


# --------------------------------------------------------------------------------------
# Buffers and data pattern
# --------------------------------------------------------------------------------------
def alloc_buffer(nbytes: int) -> np.ndarray:
    """Page-aligned, zero-filled uint8 array (anonymous mmap): safe to register anywhere."""
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    # arr.base holds the mmap, so the mapping lives as long as the array.
    return arr


def _pattern(seed: int, first_word: np.ndarray | int, n_words: int | None = None) -> np.ndarray:
    mix = np.uint64((seed * _SEED_MUL) & 0xFFFFFFFFFFFFFFFF)
    if n_words is not None:
        words = np.arange(first_word, first_word + n_words, dtype=np.uint64)
    else:
        words = np.asarray(first_word, dtype=np.uint64)
    words ^= mix
    words *= _PATTERN_MUL
    return words


def fill_pattern(buf: np.ndarray, seed: int) -> None:
    """Fills the whole buffer with the seeded pattern (word i of the buffer = f(seed, i))."""
    w = buf[: buf.nbytes // 8 * 8].view(np.uint64)
    for a in range(0, w.size, _PATTERN_CHUNK_WORDS):
        b = min(w.size, a + _PATTERN_CHUNK_WORDS)
        w[a:b] = _pattern(seed, a, b - a)


def verify_kv(dst: np.ndarray, wl: "Workload") -> tuple[bool, str]:
    """Checks every KV write: destination page dst_pages[i] of (layer, K|V) must hold the
    pattern bytes of source page src_pages[i] of the same (layer, K|V)."""
    words = wl.page_size // 8
    d4 = dst[: wl.dst_bytes].view(np.uint64).reshape(wl.layers, wl.pool_pages, 2, words)
    lane = np.arange(words, dtype=np.uint64)
    bad, first = 0, None
    for layer in range(wl.layers):
        for kv in range(2):
            got = d4[layer, wl.dst_pages, kv]  # row gather: one copy of the request's pages
            base = (wl.kv_src_offset(layer, kv) // 8 + wl.src_pages * (2 * words)).astype(np.uint64)
            want = _pattern(wl.seed, base[:, None] + lane[None, :])
            rows = np.nonzero(np.any(got != want, axis=1))[0]
            if rows.size:
                bad += int(rows.size)
                if first is None:
                    first = (layer, kv, int(wl.dst_pages[rows[0]]))
    if bad:
        return False, (
            f"{bad} of {wl.n_writes} page writes hold wrong data "
            f"(first: layer {first[0]}, {'KV'[first[1]]}, destination page {first[2]})"
        )
    return True, f"{wl.n_writes} page writes of {wl.page_size} B verified"


def verify_contiguous(dst: np.ndarray, seed: int, nbytes: int) -> tuple[bool, str]:
    """Checks dst[:nbytes] == pattern (bulk: source and destination offsets are equal)."""
    d64 = dst[:nbytes].view(np.uint64)
    for a in range(0, d64.size, _PATTERN_CHUNK_WORDS):
        b = min(d64.size, a + _PATTERN_CHUNK_WORDS)
        if not np.array_equal(d64[a:b], _pattern(seed, a, b - a)):
            bad = np.nonzero(d64[a:b] != _pattern(seed, a, b - a))[0]
            return False, f"wrong data from byte {8 * (a + int(bad[0]))} ({bad.size} words in that chunk)"
    return True, f"{nbytes} B verified"


# --------------------------------------------------------------------------------------
# Control channel (JSON lines over a loopback socket)
# --------------------------------------------------------------------------------------
class Control:
    """One JSON message per line; every receive has a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def send(self, **msg: Any) -> None:
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def recv(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no control message within {timeout_s:.0f} s")
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("peer closed the control connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def expect(self, cmd: str, timeout_s: float) -> dict[str, Any]:
        msg = self.recv(timeout_s)
        if msg.get("cmd") == "abort":
            raise RuntimeError(f"peer aborted: {msg.get('reason')}")
        if msg.get("cmd") != cmd:
            raise RuntimeError(f"expected {cmd!r}, got {msg!r}")
        return msg


def publish(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def wait_for_file(path: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"target did not publish {os.path.basename(path)} in {timeout_s:.0f} s")
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------
# The system interface
# --------------------------------------------------------------------------------------
class PeerSystem:
    """What one transfer system provides to the loop; every method may raise.

    Target side: `target_setup` (engine up, `dst` registered, returns JSON-able info for the
    initiator), `target_hello` (initiator's info), `target_arm` (reset completion state
    before a repeat), `target_wait_kv` (block until the receiver-side signal says the whole
    KV push landed; return False on timeout), `target_check` (extra check after a repeat,
    e.g. an immediate count; returns an error string or None).
    Initiator side: `initiator_setup` (engine up, `src` registered, target info in; returns
    info for the target), `initiator_connect` (after hello: warm the connection),
    `run_bulk`, `run_kv` (submit everything, wait for local completion), `lat_once`.
    `notes` is a dict that ends up in the result (API choices worth knowing).
    """

    name = "?"
    kv_completion = "receiver"  # what t_recv means for this system (shown in the table)

    def __init__(self, args: argparse.Namespace, wl: Workload) -> None:
        self.args = args
        self.wl = wl
        self.notes: dict[str, Any] = {}

    # target
    def alloc_target_buffer(self, nbytes: int) -> np.ndarray | None:
        """The destination buffer, for a system that wants it in memory of its own kind
        (zero-filled uint8); None: the harness's anonymous mapping."""
        return None

    def target_setup(self, dst: np.ndarray) -> dict[str, Any]:
        raise NotImplementedError

    def target_hello(self, init_info: dict[str, Any]) -> None:
        pass

    def target_arm(self, rep: int) -> None:
        pass

    def target_wait_kv(self, rep: int, deadline: float) -> bool:
        raise NotImplementedError

    def target_wait_bulk(self, rep: int, deadline: float) -> bool | None:
        return None  # no receiver-side signal for plain writes

    def target_check(self, rep: int) -> str | None:
        return None

    # initiator
    def initiator_setup(self, src: np.ndarray, target_info: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def initiator_connect(self) -> None:
        pass

    def run_bulk(self, rep: int) -> None:
        raise NotImplementedError

    def run_kv(self, rep: int) -> None:
        raise NotImplementedError

    def lat_once(self) -> None:
        raise NotImplementedError


# --------------------------------------------------------------------------------------
# The two roles
# --------------------------------------------------------------------------------------
def _write_result(path: str, obj: dict[str, Any]) -> None:
    publish(path, obj)


def _run_target(sys_: PeerSystem, args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    to = args.timeout_s
    dst = sys_.alloc_target_buffer(wl.dst_bytes)
    if dst is None:
        dst = alloc_buffer(wl.dst_bytes)
    dst.fill(0)  # fault the pages in before registration, as a real KV pool would be
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    info = sys_.target_setup(dst)
    publish(args.rendezvous, {"ctrl_port": listener.getsockname()[1], "info": info, "pid": os.getpid()})
    listener.settimeout(to)
    conn, _ = listener.accept()
    ctl = Control(conn)
    hello = ctl.expect("hello", to)
    sys_.target_hello(hello["info"])
    ctl.send(cmd="ready")
    verdicts = []
    while True:
        msg = ctl.recv(to)
        if msg["cmd"] == "done":
            break
        if msg["cmd"] == "abort":
            raise RuntimeError(f"initiator aborted: {msg.get('reason')}")
        if msg["cmd"] != "arm":
            raise RuntimeError(f"unexpected control message {msg!r}")
        rep = int(msg["rep"])
        dst.fill(0)  # a write that never lands cannot pass for one of an earlier repeat
        sys_.target_arm(rep)
        ctl.send(cmd="armed", rep=rep)
        t_recv = None
        recv_ok = True
        if wl.kind == "kv":
            recv_ok = sys_.target_wait_kv(rep, time.monotonic() + to)
            t_recv = time.monotonic()
        elif wl.kind == "bulk":
            # Optional: systems with a receiver-side signal also report when bulk data was
            # known to have landed (the headline bulk figure is initiator completion).
            got = sys_.target_wait_bulk(rep, time.monotonic() + to)
            if got is not None:
                recv_ok = got
                t_recv = time.monotonic()
        ctl.expect("check", to)
        t_v = time.monotonic()
        err = None if recv_ok else "receiver-side completion signal did not arrive"
        if err is None:
            err = sys_.target_check(rep)
        if err is None:
            if wl.kind == "bulk":
                ok, detail = verify_contiguous(dst, wl.seed, wl.total)
            elif wl.kind == "kv":
                ok, detail = verify_kv(dst, wl)
            else:
                ok, detail = verify_contiguous(dst, wl.seed, wl.write_size)
        else:
            ok, detail = False, err
        verdicts.append({"rep": rep, "ok": ok, "detail": detail, "verify_s": time.monotonic() - t_v})
        ctl.send(cmd="verdict", rep=rep, ok=ok, detail=detail, t_recv=t_recv)
    return {"verdicts": verdicts}


def _run_initiator(sys_: PeerSystem, args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    to = args.timeout_s
    rdv = wait_for_file(args.rendezvous, to)
    src = alloc_buffer(wl.src_bytes)
    fill_pattern(src, wl.seed)
    info = sys_.initiator_setup(src, rdv["info"])
    sock = socket.create_connection(("127.0.0.1", rdv["ctrl_port"]), timeout=to)
    ctl = Control(sock)
    ctl.send(cmd="hello", info=info)
    ctl.expect("ready", to)
    sys_.initiator_connect()
    reps: list[dict[str, Any]] = []
    try:
        for rep in range(args.warmup + args.repeats):
            ctl.send(cmd="arm", rep=rep)
            ctl.expect("armed", to)
            rec: dict[str, Any] = {"rep": rep, "warmup": rep < args.warmup}
            t0 = time.monotonic()
            if wl.kind == "bulk":
                sys_.run_bulk(rep)
            elif wl.kind == "kv":
                sys_.run_kv(rep)
            else:
                lat = np.empty(wl.iters, dtype=np.float64)
                for i in range(wl.iters):
                    a = time.perf_counter()
                    sys_.lat_once()
                    lat[i] = time.perf_counter() - a
                rec["lat_us"] = {
                    "p50": float(np.percentile(lat, 50) * 1e6),
                    "p99": float(np.percentile(lat, 99) * 1e6),
                    "mean": float(lat.mean() * 1e6),
                    "min": float(lat.min() * 1e6),
                    "max": float(lat.max() * 1e6),
                }
            t_init = time.monotonic()
            ctl.send(cmd="check", rep=rep)
            v = ctl.expect("verdict", to + 300)  # verification of GiBs takes seconds
            rec["init_s"] = t_init - t0
            if v.get("t_recv") is not None:
                rec["recv_s"] = float(v["t_recv"]) - t0
            rec["bytes"] = wl.total
            rec["verified"] = bool(v["ok"])
            rec["verify_detail"] = v["detail"]
            reps.append(rec)
            if not v["ok"]:
                raise RuntimeError(f"data verification failed on repeat {rep}: {v['detail']}")
        ctl.send(cmd="done")
    except BaseException as e:
        try:
            ctl.send(cmd="abort", reason=f"{type(e).__name__}: {e}")
        except OSError:
            pass
        e.partial_reps = reps  # type: ignore[attr-defined]
        raise
    return {"reps": reps}


def main(system_cls: type[PeerSystem], extra_args: Any = None) -> None:
    """Entry point of a peer program: parse the CLI, run the role, write the result."""
    p = argparse.ArgumentParser(description=f"{system_cls.name} peer for compare_peers.py")
    add_workload_args(p)
    if extra_args:
        extra_args(p)
    args = p.parse_args()
    result: dict[str, Any] = {"system": system_cls.name, "role": args.role, "workload": args.workload,
                              "pid": os.getpid()}
    code = 0
    sys_ = None
    try:
        wl = Workload(args)
        sys_ = system_cls(args, wl)
        result["kv_completion"] = sys_.kv_completion
        body = _run_target(sys_, args, wl) if args.role == "target" else _run_initiator(sys_, args, wl)
        result.update(body)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - every failure must end up in the result file
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        if getattr(e, "partial_reps", None):
            result["reps"] = e.partial_reps  # type: ignore[attr-defined]
        code = 1
    if sys_ is not None:
        result["notes"] = sys_.notes
    try:
        _write_result(args.result, result)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # NIXL (and sometimes Mooncake) crash in static destructors at interpreter exit;
        # the result is on disk, so skip the teardown.
        os._exit(code)
