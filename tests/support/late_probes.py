"""A decoder engine whose probes are held back: the fault a starved host makes (a live
prefiller's probe not delivered within prefiller_probe_timeout_s), injected from outside."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvxfer.errors import TransferTimeout
from kvxfer.kv.protocol import encode_probe
from kvxfer.transfer.engine import TransferEngine


class Undelivered:
    """A message the fabric holds back: never done."""

    def done(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> None:
        raise TransferTimeout(None, "held back by the test")


def hold_back_probes(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Has `engine.send` hold back every probe (the other messages go out as usual) until
    `monkeypatch` undoes it; returns the list it appends each held probe's send time to."""
    held: list[float] = []
    real_send = engine.send
    probe = encode_probe()

    def send(address: bytes, message: Any) -> Any:
        if bytes(message) == probe:
            held.append(time.monotonic())
            return Undelivered()
        return real_send(address, message)

    monkeypatch.setattr(engine, "send", send)
    return held


def watch_severs(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Records each `engine.sever_peer` call's address (the sever still runs); returns that list."""
    severed: list[bytes] = []
    real_sever = engine.sever_peer

    def sever_peer(address: bytes) -> bool:
        severed.append(address)
        return real_sever(address)

    monkeypatch.setattr(engine, "sever_peer", sever_peer)
    return severed
