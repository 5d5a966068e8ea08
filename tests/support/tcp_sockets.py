"""The TCP sockets of a process as `ss -tainpH` reports them: ports and the info line (its
congestion control, segment counts), for tests of the engine's connections."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

SS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of a process: local port, peer port (0 for a listener) and `ss`'s info."""

    local_port: int
    peer_port: int
    info: str

    @property
    def congestion_control(self) -> str:
        return self.info.split()[0]

    def counter(self, name: str) -> int:
        """A `name:value` counter of the info line (segs_out, data_segs_out, ...); 0 if absent."""
        found = re.search(rf"\b{re.escape(name)}:(\d+)", self.info)
        return int(found.group(1)) if found else 0


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """Every TCP socket of process `pid`."""
    lines = subprocess.run(["ss", "-tainpH"], capture_output=True, text=True, timeout=SS_TIMEOUT_S,
                           check=True).stdout
    found = []
    rows = lines.splitlines()
    for head, info in zip(rows, rows[1:]):
        if f"pid={pid}," not in head or not info[:1].isspace():
            continue
        fields = head.split()
        local, peer = fields[3], fields[4]
        peer_port = 0 if peer.endswith(":*") else int(peer.rsplit(":", 1)[1])
        found.append(TcpSocket(int(local.rsplit(":", 1)[1]), peer_port, info.strip()))
    return found
