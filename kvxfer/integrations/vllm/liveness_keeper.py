"""The liveness keeper: a small process holding a prefill worker's liveness connections.

Started by `prefiller_liveness.LivenessListener` as
`python -m kvxfer.integrations.vllm.liveness_keeper LISTEN_FD ALIVE_FD MAX_CONNECTIONS`,
in its worker's process group, with the worker's listening socket and the read end of a
pipe whose write end only the worker holds. It serves the port (`LivenessServer`) until
that pipe reads EOF, and ignores SIGINT and SIGTERM: a graceful stop of the instance is the
worker's to finish, and the keeper goes with it. Killed with the group, its few MiB of
address space let the kernel close its connections at once.
"""

from __future__ import annotations

import signal
import socket
import sys

from kvxfer.integrations.vllm.prefiller_liveness import LivenessServer


def main(argv: list[str]) -> int:
    """Serves the liveness port of the worker that started it; returns when that worker is gone."""
    if len(argv) != 3 or not all(a.isdigit() for a in argv):
        print("usage: python -m kvxfer.integrations.vllm.liveness_keeper LISTEN_FD ALIVE_FD MAX_CONNECTIONS",
              file=sys.stderr)
        return 2
    listen_fd, alive_fd, max_connections = map(int, argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    LivenessServer(socket.socket(fileno=listen_fd), max_connections).serve(alive_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
