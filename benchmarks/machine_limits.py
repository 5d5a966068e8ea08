"""What this machine allows, as ceilings for the transfer benchmarks.

- memcpy: numpy copy between two preallocated buffers (1 GiB by default), GB/s. Any
  same-host transfer moves each byte at least once, so this is the same-host ceiling.
- one loopback TCP stream: two processes, `sendall` of a preallocated buffer to a
  `recv_into` of another over 127.0.0.1, GB/s. This is the ceiling of one TCP connection,
  which is what the TCP-class transports (kvxfer tcp/net, Mooncake TCP, UCX tcp) ride on.
- process_vm_writev: the kernel copying into another process's private, pre-faulted memory
  (a numpy array: huge pages where the kernel gives them), in calls of 4 MiB (the
  same-host path's slice), GB/s. The ceiling of kvxfer's
  same-host path into memory that is not a SharedBuffer (which it maps and memcpys into
  instead); the kernel pins and maps the target's pages call by call.
- first fill: writing memory this process never touched (a fresh private mapping, huge
  pages asked for as registration asks), GB/s. What the kernel, and under a VM the
  hypervisor, charge for new memory; populating pages at registration cannot be quicker.
  On a VM whose balloon reports free pages to the host, memory freed a while ago must be
  given back page by page: this rate then falls to a few hundred MB/s.

Reusable: `memcpy_gbps(...)`, `tcp_stream_gbps(...)`, `process_vm_writev_gbps(...)` and
`first_fill_gbps(...)` return a `Measurement` dict {median, min, max, samples, unit}; compare_peers.py calls them
in the same run.
Run alone: `python benchmarks/machine_limits.py [--size 1G] [--repeats 5] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

# Receiver reads at most this much per recv_into call: large enough that syscall cost
# does not bound the rate, small enough to stay inside the socket buffer autotuning.
_RECV_CHUNK = 4 << 20
_STREAM_TIMEOUT_S = 120.0


def _summary(samples: list[float], unit: str = "GB/s") -> dict[str, Any]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": samples,
        "unit": unit,
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (all its threads); NaN if it
    is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def parse_size(text: str) -> int:
    """'1G', '512M', '64K' or a plain byte count -> bytes (binary units)."""
    t = text.strip().upper().rstrip("IB").rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def memcpy_gbps(nbytes: int = 1 << 30, repeats: int = 5, gap_s: float = 0.0) -> dict[str, Any]:
    """Copy of `nbytes` between two preallocated, pre-faulted buffers; GB/s (1e9 B/s).

    With `gap_s`, each timed copy follows a pause of that long, as a lone write `gap_s`
    after the last one does: back to back, a 1 MiB copy runs from cache (31 GB/s here),
    1 ms apart at about 18 GB/s."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # warm-up: fault pages, settle the allocator
    samples = []
    for _ in range(repeats):
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        np.copyto(dst, src)
        samples.append(nbytes / (time.perf_counter() - t) / 1e9)
    return _summary(samples)


def _tcp_sink(nbytes: int, rounds: int) -> None:
    """Receiver process: prints its port, then per round reads nbytes and acks 1 byte."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    srv.settimeout(_STREAM_TIMEOUT_S)
    conn, _ = srv.accept()
    conn.settimeout(_STREAM_TIMEOUT_S)
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], min(_RECV_CHUNK, nbytes - got))
            if n == 0:
                raise ConnectionError("sender closed early")
            got += n
        conn.sendall(b"k")
    conn.close()


def tcp_stream_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, Any]:
    """One TCP stream over 127.0.0.1 between two processes; GB/s per round of `nbytes`.

    Each round is timed from the first sendall byte to the receiver's 1-byte ack after it
    holds all `nbytes`, so the figure is delivered bytes, not bytes queued in the kernel.
    """
    rounds = repeats + 1  # first one warms up (socket buffer autotuning, page faults)
    proc = subprocess.Popen(
        [sys.executable, __file__, "_tcp_sink", str(nbytes), str(rounds)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip():
            raise RuntimeError("tcp sink did not start")
        port = int(line)
        src = np.ones(nbytes, dtype=np.uint8)
        view = memoryview(src).cast("B")
        sock = socket.create_connection(("127.0.0.1", port), timeout=_STREAM_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for r in range(rounds):
            t = time.perf_counter()
            sock.sendall(view)
            if sock.recv(1) != b"k":
                raise ConnectionError("no ack from the tcp sink")
            if r:
                samples.append(nbytes / (time.perf_counter() - t) / 1e9)
        sock.close()
        proc.wait(timeout=_STREAM_TIMEOUT_S)
        return _summary(samples)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# The same-host path copies in slices of this many bytes (SameHostCopy::kSliceBytes).
_PVW_CALL_BYTES = 4 << 20


def _pvw_sink(nbytes: int) -> None:
    """Target process: pre-faults `nbytes` of private memory (numpy asks for huge pages on
    arrays this large), prints its address, and holds it until stdin closes."""
    region = np.ones(nbytes, dtype=np.uint8)
    print(region.ctypes.data, flush=True)
    sys.stdin.read()


def process_vm_writev_gbps(nbytes: int = 1 << 28, repeats: int = 5) -> dict[str, Any]:
    """process_vm_writev of `nbytes` into another process's warm anonymous memory, in calls
    of _PVW_CALL_BYTES; GB/s per pass (the first pass is a warm-up). Source and target are
    both numpy arrays, so they share their offset within a cache line, as KV caches do: the
    kernel's copy runs at about half speed between buffers that do not
    (bench_first_touch.aligned_source)."""
    import ctypes

    class _Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    proc = subprocess.Popen([sys.executable, __file__, "_pvw_sink", str(nbytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip():
            raise RuntimeError("process_vm_writev sink did not start")
        remote = int(line)
        src = np.full(nbytes, 7, dtype=np.uint8)
        samples = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            for off in range(0, nbytes, _PVW_CALL_BYTES):
                n = min(_PVW_CALL_BYTES, nbytes - off)
                local_iov, remote_iov = _Iovec(src.ctypes.data + off, n), _Iovec(remote + off, n)
                if libc.process_vm_writev(proc.pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0) != n:
                    raise OSError(ctypes.get_errno(), "process_vm_writev")
            if r:
                samples.append(nbytes / (time.perf_counter() - t) / 1e9)
        return _summary(samples)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def first_fill_gbps(nbytes: int = 1 << 28, repeats: int = 3) -> dict[str, Any]:
    """One write over `nbytes` of memory never touched before: a new private anonymous
    mapping each repeat, with MADV_HUGEPAGE (as `huge_pages_on_register` asks), filled once
    and unmapped; GB/s. The kernel hands out (zeroed) pages as they are first written, and
    under a VM the hypervisor may have to back them first, so this is the machine's price
    of fresh memory: the floor under `populate_on_register`'s cost."""
    samples = []
    for _ in range(repeats):
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
            view = np.frombuffer(region, dtype=np.uint8)
            t = time.perf_counter()
            view.fill(1)
            samples.append(nbytes / (time.perf_counter() - t) / 1e9)
            del view  # the mapping cannot close while a view of it exists
        finally:
            region.close()
    return _summary(samples)


def measure_all(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, dict[str, Any]]:
    """Every limit, by name."""
    return {
        "memcpy": memcpy_gbps(nbytes, repeats),
        "tcp_loopback_1_stream": tcp_stream_gbps(nbytes, repeats),
        "process_vm_writev": process_vm_writev_gbps(nbytes, repeats),
        "first_fill": first_fill_gbps(nbytes, repeats),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_tcp_sink":
        _tcp_sink(int(sys.argv[2]), int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_pvw_sink":
        _pvw_sink(int(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1G", help="bytes per copy / per stream round (default 1G)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()
    res = measure_all(parse_size(a.size), a.repeats)
    for name, m in res.items():
        print(f"{name:24s} {m['median']:7.2f} GB/s  (min {m['min']:.2f}, max {m['max']:.2f}, n={len(m['samples'])})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
