"""A prefill process's death, told to its decoders by the kernel in milliseconds.

The fabric does not say when a peer dies: over the `net` provider a message to a killed
process is neither delivered nor failed (measured: a probe still pending after 5 s), so a
probe of kv_receiver.py only times out, and a timeout proves nothing (a starved live
prefiller's probe is late too): it fails the silent loads with the regular fence and
severs nothing. A plain TCP
connection does: when a process dies, however it dies, its kernel closes its sockets, and
the peer reads EOF (or a reset) as soon as it did.

So the prefill worker binds a small TCP port (`LivenessListener`, its "host:port" in the
instance's registry record as `liveness_address`, carried by the router into the decode
leg's kv_transfer_params as `peer_liveness`) whose connections a tiny keeper process in the
worker's process group holds (liveness_keeper.py: the kernel closes a killed process's
sockets only after tearing down its address space, GiBs for a vLLM worker, a few MiB for
the keeper, which imports the standard library only). Under tensor parallelism only rank 0
binds one, for the whole instance: every rank's loads name it (worker_side.py), since an
instance cannot serve once any rank died (vLLM's executor shuts every worker down, rank 0
with them), and its close declares every rank gone (kv_receiver.py). A decoder with loads
waiting on that prefiller holds one connection to it (`LivenessWatch`), polled without
blocking on each poll of its loads:

- the keeper writes one byte (`HELD`) on each connection it keeps; a watcher counts a
  connection as a liveness signal only after that byte, so a keeper at its bound
  (`max_connections`), which closes new connections without it, sends its decoders back to
  the probes instead of declaring itself dead;
- EOF or a reset after that byte, or a refused connect (nothing listens there any more):
  the process is gone;
- a connect or that byte not there within `connect_timeout_s`, an address that does not
  parse, any other socket error: no signal; the decoder falls back to the probes. A
  frozen (SIGSTOPped) process keeps its sockets open, so it is never declared gone here.

The keeper never reads what a client sends beyond noticing its close, and holds at most
`max_connections` connections, so a flood of connections costs it a bounded number of
descriptors and leaves the port serving.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from enum import Enum

from kvxfer.errors import KvxferError

from . import liveness_keeper
from .liveness_keeper import DISCARD_BYTES, HELD

log = logging.getLogger(__name__)

#: How long the keeper may take to exit once killed by close().
_KEEPER_EXIT_WAIT_S = 2.0
#: Pause before a keeper that exited is started again.
_KEEPER_RESTART_PAUSE_S = 1.0


class LivenessAddressError(KvxferError, ValueError):
    """A liveness address is not "host:port" with a numeric host."""


def parse_liveness_address(address: str) -> tuple[str, int]:
    """(host, port) of "host:port" or "[v6]:port"; LivenessAddressError otherwise. The host
    must be numeric: resolving a name could block the poll that asks."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LivenessAddressError(f"liveness address {address!r:.80} is not host:port")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        raise LivenessAddressError(f"liveness address {address!r:.80} has no numeric host") from None
    return host, int(port)


def keeper_cpus() -> set[int]:
    """The CPUs a keeper started by this thread should run on: those this thread is not
    pinned to, or every CPU where it may use them all (see place_keeper)."""
    everywhere = set(range(os.cpu_count() or 1))
    return (everywhere - os.sched_getaffinity(0)) or everywhere


def place_keeper(pid: int, cpus: set[int]) -> None:
    """Lets the keeper process `pid` run on `cpus` (keeper_cpus()): the CPUs this process
    is not pinned to; where it may use them all, or its cgroup allows none of those, on
    every CPU it allows (the kernel keeps only those). Left as it is where that is refused.
    The keeper also pins itself to them once started (liveness_keeper.py).

    Why not the instance's own CPUs: once the instance is killed they are busy in the
    kernel tearing down its address spaces, GiBs each, milliseconds at a time without a
    reschedule, which is exactly when the keeper must run to exit and close its
    connections. The kernel wakes a task on the CPU it last ran on, so a keeper merely
    allowed elsewhere still waited there behind the teardown (perf sched: 9.7 ms of
    scheduling delay, a 2-core machine, the instance pinned to one core and the keeper free
    to run on both). It uses no CPU until then."""
    everywhere = set(range(os.cpu_count() or 1))
    for allowed in (cpus, everywhere):
        try:
            os.sched_setaffinity(pid, allowed)
            return
        except OSError:  # none of them in this cgroup's cpuset (EINVAL), or refused
            continue


class LivenessListener:
    """Prefill side: the port whose connections close as soon as this process is killed.

    This process binds the port and keeps it; a small keeper process (liveness_keeper.py,
    started here, in this process's group) accepts and holds the connections. Why not a
    thread here: a killed process's sockets close only after the kernel tore down its
    address space (measured: 46 ms per touched GiB, 79 ms per mlocked GiB), a vLLM worker's
    being GiBs, while the keeper's is a few MiB. So when the group is killed (SIGKILL to a
    pod's or an instance's processes) the decoders read EOF in milliseconds. The keeper
    ignores SIGINT and SIGTERM and exits when this process's pipe to it reads EOF (this
    process died alone: then as late as its own sockets close). A keeper that dies alone
    is started again on the same port (a connect meanwhile is queued, not refused, so its
    decoder falls back to the probes). `address` is "host:port" as decoders reach it: the
    bound host, or `advertise_host` where it binds every interface ("").
    """

    def __init__(self, bind_host: str, max_connections: int, advertise_host: str | None = None) -> None:
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((bind_host, 0))
        # The kernel's full queue, not max_connections: connections beyond the bound are
        # accepted and closed at once, while a short queue would drop SYNs (a decoder's
        # connect then waits out TCP's retransmits, seconds).
        self._server.listen(socket.SOMAXCONN)
        host = advertise_host or bind_host or "127.0.0.1"
        port = self._server.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._alive_r, self._alive_w = os.pipe()  # the keeper's EOF when this process is gone
        self._closed = threading.Event()
        self._keeper = self._start_keeper()
        self._monitor = threading.Thread(target=self._restart_keeper, name="kvxfer-liveness", daemon=True)
        self._monitor.start()

    @property
    def keeper_pid(self) -> int:
        """The keeper process's id (it holds the connections)."""
        return self._keeper.pid

    def _start_keeper(self) -> subprocess.Popen[bytes]:
        fds = (self._server.fileno(), self._alive_r)
        # By path, isolated and without site: the keeper imports the standard library only.
        # With the kvxfer package (numpy and its BLAS threads, the engine's libraries) a
        # killed keeper took a median 6 ms to close its sockets, without it under 1 ms.
        # Placed twice: from here at once, and by the keeper itself once it runs. Seen with
        # perf sched in a vLLM worker: a keeper placed from here (Popen had returned while
        # the child was still in exec) was back on the worker's CPU 7 ms later, for good,
        # and after a kill waited there 6.5 ms behind the killed worker's threads. Not found
        # what moved it; a keeper that pins itself after its start is not moved back.
        cpus = keeper_cpus()
        keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", liveness_keeper.__file__, *map(str, fds), str(self.max_connections),
             ",".join(map(str, sorted(cpus)))],
            pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        place_keeper(keeper.pid, cpus)
        return keeper

    def _restart_keeper(self) -> None:
        while True:
            code = self._keeper.wait()
            if self._closed.is_set():
                return
            log.error("kvxfer liveness keeper exited (%s); starting it again on %s", code, self.address)
            time.sleep(_KEEPER_RESTART_PAUSE_S)  # a keeper that cannot start does not spin
            if self._closed.is_set():
                return
            self._keeper = self._start_keeper()

    def close(self) -> None:
        """Stops the keeper and closes the port (its decoders then read EOF: call it only as
        this process's engine goes away too)."""
        self._closed.set()
        self._keeper.kill()
        self._keeper.wait(timeout=_KEEPER_EXIT_WAIT_S)
        self._server.close()
        os.close(self._alive_w)
        os.close(self._alive_r)


class _Phase(Enum):
    CONNECTING = "connecting"
    AWAITING_HELD = "awaiting_held"
    HELD = "held"
    NO_SIGNAL = "no_signal"
    GONE = "gone"


@dataclass
class _Connection:
    sock: socket.socket | None
    started_at: float
    phase: _Phase = _Phase.CONNECTING
    why_no_signal: str = field(default="")  # why NO_SIGNAL, or why GONE


class LivenessWatch:
    """Decode side: one connection per watched prefiller liveness address, polled without
    blocking. `watch` starts one; `poll` returns the addresses whose process is gone;
    `keep` closes those no load waits on any more. Not thread-safe (the worker thread's)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._connections: dict[str, _Connection] = {}

    def watch(self, address: str, now: float | None = None) -> None:
        """Starts connecting to `address` unless it is watched already."""
        if address in self._connections:
            return
        now = time.monotonic() if now is None else now
        try:
            host, port = parse_liveness_address(address)
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)[0]
            sock = socket.socket(info[0], socket.SOCK_STREAM)
        except (LivenessAddressError, OSError) as exc:
            self._connections[address] = _Connection(None, now, _Phase.NO_SIGNAL, str(exc))
            log.info("kvxfer liveness: not watching %s (%s); the probes cover it", address[:80], exc)
            return
        sock.setblocking(False)
        code = sock.connect_ex(info[4])
        conn = _Connection(sock, now)
        self._connections[address] = conn
        if code not in (0, errno.EINPROGRESS, errno.EAGAIN):
            why = self._connect_failed(address, conn, code)
            if why:  # reported by the next poll
                sock.close()
                conn.sock, conn.phase, conn.why_no_signal = None, _Phase.GONE, why

    def phase(self, address: str) -> str:
        """Where the watch of `address` is ("" if not watched): connecting, awaiting_held,
        held or no_signal (the probes cover it)."""
        conn = self._connections.get(address)
        return conn.phase.value if conn is not None else ""

    def held_fds(self) -> list[int]:
        """The descriptors of the held connections, for a wait that must end at their close
        (TransferEngine.wait_imm_any). Valid until the next poll or keep."""
        return [c.sock.fileno() for c in self._connections.values() if c.phase is _Phase.HELD and c.sock is not None]

    def poll(self, now: float | None = None) -> dict[str, str]:
        """Address -> why, for each watched prefiller found gone since the last poll (its
        watch ends); never blocks."""
        now = time.monotonic() if now is None else now
        gone: dict[str, str] = {}
        for address, conn in list(self._connections.items()):
            if conn.phase is _Phase.GONE:
                why = conn.why_no_signal
            elif conn.sock is None:
                continue
            else:
                why = self._step(address, conn, now)
            if why:
                gone[address] = why
                self._close(address)
        return gone

    def keep(self, addresses: set[str]) -> None:
        """Closes the watches of every address not in `addresses`."""
        for address in [a for a in self._connections if a not in addresses]:
            self._close(address)

    def close(self) -> None:
        """Closes every watch."""
        self.keep(set())

    def _step(self, address: str, conn: _Connection, now: float) -> str:
        sock = conn.sock
        assert sock is not None
        if conn.phase is _Phase.CONNECTING:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                return self._connect_failed(address, conn, err)
            try:
                sock.getpeername()
            except OSError:  # not connected yet
                return self._expired(conn, now, "no connection")
            conn.phase = _Phase.AWAITING_HELD
        try:
            data = sock.recv(DISCARD_BYTES)
        except (BlockingIOError, InterruptedError):
            return self._expired(conn, now, f"no {HELD!r} byte") if conn.phase is not _Phase.HELD else ""
        except OSError as exc:
            data, reset = b"", exc
        else:
            reset = None
        if conn.phase is _Phase.AWAITING_HELD:
            if data.startswith(HELD):
                conn.phase = _Phase.HELD
                return ""
            # Closed before the byte (a listener at its bound, or a process dying right
            # then): no signal either way.
            self._no_signal(conn, "the listener closed the connection without keeping it")
            return ""
        if data:
            return ""  # the listener sends nothing more; ignore it
        return f"its liveness connection was {'reset' if reset is not None else 'closed'} (the kernel closes " \
               f"a dead process's sockets)"

    def _connect_failed(self, address: str, conn: _Connection, code: int) -> str:
        if code == errno.ECONNREFUSED:
            return "nothing listens at its liveness address any more (connection refused)"
        self._no_signal(conn, f"connect failed: {errno.errorcode.get(code, code)}")
        return ""

    def _expired(self, conn: _Connection, now: float, what: str) -> str:
        if now - conn.started_at > self.connect_timeout_s:
            self._no_signal(conn, f"{what} within liveness_connect_timeout_s={self.connect_timeout_s}")
        return ""

    def _no_signal(self, conn: _Connection, why: str) -> None:
        if conn.sock is not None:
            conn.sock.close()
        conn.sock, conn.phase, conn.why_no_signal = None, _Phase.NO_SIGNAL, why
        log.info("kvxfer liveness: no liveness signal (%s); the probes cover this prefiller", why)

    def _close(self, address: str) -> None:
        conn = self._connections.pop(address, None)
        if conn is not None and conn.sock is not None:
            conn.sock.close()
