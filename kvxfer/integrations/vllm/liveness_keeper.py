"""The liveness keeper: a small process holding a prefill worker's liveness connections.

Started by `prefiller_liveness.LivenessListener` as
`python -I -S .../liveness_keeper.py LISTEN_FD ALIVE_FD MAX_CONNECTIONS`, in its worker's
process group, with the worker's listening socket and the read end of a pipe whose write
end only the worker holds. It serves the port (`LivenessServer`) until that pipe reads EOF,
and ignores SIGINT and SIGTERM: a graceful stop of the instance is the worker's to finish,
and the keeper goes with it.

It imports the standard library only, and is started by path, isolated and without site
packages: killed with its group, the kernel closes its connections once every thread of it
exited and its address space is gone, and the kvxfer package would bring numpy (BLAS
threads) and the engine's libraries. Measured: a median 6 ms from SIGKILL to its peer's
EOF with the package imported, under 1 ms without.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys

log = logging.getLogger("kvxfer.integrations.vllm.liveness_keeper")

#: The byte the keeper writes on each connection it keeps.
HELD = b"k"
#: How long the keeper blocks in select at most (it wakes on any event anyway).
_LISTENER_TICK_S = 0.5
#: Bytes a held connection's unsolicited input is discarded in (it is never interpreted).
DISCARD_BYTES = 4096


class LivenessServer:
    """The liveness port's loop: accepts connections on `server` (a listening socket),
    writes `HELD` on each of at most `max_connections` (closing any beyond without it) and
    closes the held ones their client closed; it reads nothing else. Runs in the keeper
    process (liveness_keeper.py) until `stop_fd` reads EOF (its worker is gone)."""

    def __init__(self, server: socket.socket, max_connections: int) -> None:
        self.max_connections = max_connections
        self._server = server
        self._server.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._held: set[socket.socket] = set()

    def serve(self, stop_fd: int) -> None:
        """Serves until `stop_fd` is readable (EOF of the worker's pipe)."""
        self._selector.register(stop_fd, selectors.EVENT_READ)
        while True:
            for key, _ in self._selector.select(_LISTENER_TICK_S):
                if key.fileobj is self._server:
                    self._accept_pending()
                elif key.fileobj == stop_fd:
                    return
                else:
                    self._client_readable(key.fileobj)  # type: ignore[arg-type]

    def _accept_pending(self) -> None:
        # Everything queued at once: a full backlog would delay the next decoder's connect.
        while True:
            try:
                conn, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, or the like: the clients fall back to probes
                log.warning("kvxfer liveness port: accept failed: %s", exc)
                return
            if len(self._held) >= self.max_connections:
                conn.close()  # without HELD: its client falls back to the probes
                continue
            try:
                conn.setblocking(False)
                conn.send(HELD)
            except OSError:
                conn.close()
                continue
            self._held.add(conn)
            self._selector.register(conn, selectors.EVENT_READ)

    def _client_readable(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(DISCARD_BYTES)  # only its close matters; the bytes are dropped
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._held.discard(conn)
            self._selector.unregister(conn)
            conn.close()


def pin_to(cpus: str) -> None:
    """Runs this process on `cpus` ("1,2,3"), where permitted: off the worker's CPUs, which
    are busy tearing the worker down exactly when this process must exit (see
    prefiller_liveness.place_keeper). Left as it is where refused or not given."""
    wanted = {int(c) for c in cpus.split(",") if c.isdigit()}
    if wanted:
        try:
            os.sched_setaffinity(0, wanted)
        except OSError:  # none of them in this cgroup's cpuset, or refused
            pass


def main(argv: list[str]) -> int:
    """Serves the liveness port of the worker that started it; returns when that worker is gone."""
    if len(argv) not in (3, 4) or not all(a.isdigit() for a in argv[:3]):
        print("usage: python -I -S liveness_keeper.py LISTEN_FD ALIVE_FD MAX_CONNECTIONS [CPUS]", file=sys.stderr)
        return 2
    listen_fd, alive_fd, max_connections = map(int, argv[:3])
    if len(argv) == 4:
        pin_to(argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    LivenessServer(socket.socket(fileno=listen_fd), max_connections).serve(alive_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
