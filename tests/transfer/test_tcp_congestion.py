"""The TCP congestion control of the engine's fabric connections (tcp_congestion): a
separate peer process and this one, over loopback, read back with `ss`. Under BBR without
fq the engine's connections ran at TCP's pacing rate (native/src/tcp_congestion.hpp)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from support.engine_pairs import KIB, LOOPBACK, SPARE_BYTES, WAIT_S, PeerProcess, fresh_imm
from support.tcp_sockets import tcp_sockets as support_tcp_sockets
from support.waiting import wait_until

from kvxfer.errors import EngineError
from kvxfer.transfer import engine as engine_module
from kvxfer.transfer.engine import DEFAULT_TCP_CONGESTION, TransferEngine, _tcp_congestion, available_providers

SOCKET_PROVIDERS = [p for p in ("net", "tcp") if p in available_providers()]
SYSCTL = Path("/proc/sys/net/ipv4")
SYSTEM_DEFAULT = (SYSCTL / "tcp_congestion_control").read_text().strip()
# An algorithm other than the system's, so that the engine's choice is visible, and one
# this process may set: any available one with CAP_NET_ADMIN (root), else an allowed one.
_MAY_SET = (SYSCTL / ("tcp_available_congestion_control" if os.geteuid() == 0
                      else "tcp_allowed_congestion_control")).read_text().split()
CHOSEN = next((name for name in ("reno", "cubic", *_MAY_SET) if name in _MAY_SET and name != SYSTEM_DEFAULT), "")
needs_another_algorithm = pytest.mark.skipif(not CHOSEN, reason="only the system's congestion control may be set here")


def tcp_sockets(pid: int) -> dict[tuple[int, int], str]:
    """(local port, peer port or 0 for a listener) -> congestion control, for every TCP
    socket of process `pid`, as `ss` reports them."""
    return {(s.local_port, s.peer_port): s.congestion_control for s in support_tcp_sockets(pid)}


@pytest.fixture()
def unrelated_connection() -> Iterator[tuple[int, int]]:
    """A TCP connection of this process that is none of the engine's: (listener port, client port)."""
    with socket.create_server((LOOPBACK, 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection((LOOPBACK, port)) as client:
            accepted, _ = listener.accept()
            with accepted:
                yield port, client.getsockname()[1]


@needs_another_algorithm
@pytest.mark.parametrize("provider", SOCKET_PROVIDERS)
def test_the_engines_connections_take_the_chosen_algorithm_at_both_ends_and_no_other_socket_changes(
    provider: str, unrelated_connection: tuple[int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The peer process chooses by KVXFER_TCP_CONGESTION, this one by the argument. The
    # initiator's connection is switched once the first write opened it; the target's
    # listener is switched at start, and the connection it accepts inherits that.
    monkeypatch.setenv("KVXFER_TCP_CONGESTION", CHOSEN)
    peer = PeerProcess(provider, 1, SPARE_BYTES, tmp_path)
    monkeypatch.delenv("KVXFER_TCP_CONGESTION")
    try:
        with TransferEngine(provider, bind_host=LOOPBACK, same_host=False, tcp_congestion=CHOSEN) as engine:
            mr = engine.register(np.ones(64 * KIB, dtype=np.uint8))
            imm = fresh_imm()
            engine.write(mr, 0, peer.descriptor, 0, 64 * KIB, imm=imm).wait(WAIT_S)
            peer.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)
            # A connection still being set up has no peer address yet; the worker looks
            # again 1 ms later. Its listener and its connection: 2 sockets switched.
            wait_until(lambda: engine.engine_stats()["tcp_congestion_set"] >= 2, WAIT_S, "the connection's switch")
            theirs = tcp_sockets(peer.proc.pid)
            ours = tcp_sockets(os.getpid())
            their_ports = {local for local, _ in theirs}
            to_them = {key: cc for key, cc in ours.items() if key[1] in their_ports}
            assert any(remote == 0 for _, remote in theirs), f"no listener in the peer: {theirs}"
            assert any(remote != 0 for _, remote in theirs), f"no accepted connection in the peer: {theirs}"
            assert to_them, f"no connection from here to the peer: {ours}"
            assert set(theirs.values()) == {CHOSEN}, theirs
            assert set(to_them.values()) == {CHOSEN}, to_them
            assert engine.engine_stats()["tcp_congestion_refused"] == 0
            listener_port, client_port = unrelated_connection
            unrelated = {key: cc for key, cc in ours.items() if listener_port in key or client_port in key}
            assert len(unrelated) == 3 and set(unrelated.values()) == {SYSTEM_DEFAULT}, unrelated
    finally:
        peer.close()


@pytest.mark.parametrize("provider", SOCKET_PROVIDERS)
def test_system_leaves_the_engines_connections_as_the_system_made_them(
    provider: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVXFER_TCP_CONGESTION", "system")
    peer = PeerProcess(provider, 1, SPARE_BYTES, tmp_path)
    try:
        with TransferEngine(provider, bind_host=LOOPBACK, same_host=False) as engine:
            mr = engine.register(np.ones(64 * KIB, dtype=np.uint8))
            engine.write(mr, 0, peer.descriptor, 0, 64 * KIB).wait(WAIT_S)
            theirs = tcp_sockets(peer.proc.pid)
            assert theirs and set(theirs.values()) == {SYSTEM_DEFAULT}, theirs
            assert engine.engine_stats()["tcp_congestion_set"] == 0
    finally:
        peer.close()


def _offering(tmp_path: Path, names: str) -> Path:
    """A stand-in for tcp_available_congestion_control that offers `names`."""
    path = tmp_path / "tcp_available_congestion_control"
    path.write_text(names + "\n")
    return path


def test_the_default_prefers_cubic_to_reno_and_a_name_the_kernel_does_not_offer_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KVXFER_TCP_CONGESTION", raising=False)
    assert DEFAULT_TCP_CONGESTION == "cubic,reno"
    assert _tcp_congestion("system") == ""
    monkeypatch.setattr(engine_module, "_AVAILABLE_CONGESTION", _offering(tmp_path, "reno cubic bbr"))
    assert _tcp_congestion(None) == "cubic,reno"
    assert _tcp_congestion(" reno , cubic ") == "reno,cubic"
    # The default keeps what the kernel offers instead of failing every engine.
    monkeypatch.setattr(engine_module, "_AVAILABLE_CONGESTION", _offering(tmp_path, "reno bbr"))
    assert _tcp_congestion(None) == "reno"
    with pytest.raises(EngineError, match="cubic"):  # chosen by someone: an error
        _tcp_congestion("cubic")
    with pytest.raises(EngineError, match="cubic"):  # the default's names, chosen by someone
        _tcp_congestion(DEFAULT_TCP_CONGESTION)
    monkeypatch.undo()
    with pytest.raises(EngineError, match=re.escape(SYSTEM_DEFAULT)):  # the error lists what is offered
        TransferEngine(SOCKET_PROVIDERS[0] if SOCKET_PROVIDERS else "auto", tcp_congestion="no-such-cc")
    monkeypatch.setenv("KVXFER_TCP_CONGESTION", "no-such-cc")
    with pytest.raises(EngineError, match="no-such-cc"):
        TransferEngine(SOCKET_PROVIDERS[0] if SOCKET_PROVIDERS else "auto")
