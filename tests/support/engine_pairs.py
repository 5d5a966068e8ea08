"""Two-process engine pairs for the transfer tests: peer processes driven over JSON lines,
pools of pairs per provider and rail count, and the byte-level assertions the tests share.

The far side of every pair is tests/support/engine_peer.py, a separate process. Modes:
every loopback provider present among net, tcp and shm (the same-host path off), and the
same-host path itself ("same-host", "same-host-mapped"), with immediates over net.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer.transfer.engine import TransferEngine, available_providers
from support.engine_peer import (
    SAME_HOST_MODES,
    engine_options,
    region_buffer,
    seeded_bytes,
)
from support.waiting import wait_until_stopped

PEER_PROGRAM = Path(__file__).resolve().with_name("engine_peer.py")
PROVIDERS = [p for p in ("net", "tcp", "shm") if p in available_providers()]
# Test modes: each provider with the same-host path off, and the same-host path itself.
MODES = PROVIDERS + (list(SAME_HOST_MODES) if {"net", "tcp"} & set(PROVIDERS) else [])
LOOPBACK = "127.0.0.1"
KIB, MIB = 1024, 1024 * 1024
# Region 0 of each pair's target and the initiator's source; rails=1 holds the 64 MiB write.
PAIR_BYTES = {1: 64 * MIB + 64 * KIB, 2: 16 * MIB}
# Tests other than the 64 MiB one stay below this, so only this much is zeroed between tests.
RESET_BYTES = 16 * MIB
# This process's receive region, which peers write into.
INBOX_BYTES = 1 * MIB
# Region 0 of the peers that tests start for themselves.
SPARE_BYTES = 1 * MIB
# One request to a peer process, start-up included: several starting at once on the shared
# 2-core machine have taken 15 s.
REPLY_TIMEOUT_S = 60.0
WAIT_S = 20.0  # one transfer or immediate count between healthy peers
DEAD_PEER_TIMEOUT_S = 3.0  # transfer_timeout_s of engines that face dead peers
MAX_INFLIGHT_PER_RAIL = 256  # TransferEngine's default
# How long a write to a dead peer may take to fail: the engine's deadline plus a generous
# margin, since 2 shared cores can stall either process.
FAIL_BOUND_S = DEAD_PEER_TIMEOUT_S + 7.0
# After a receiver reached a count, arrivals that should not exist would show up within this.
STRAY_ARRIVAL_GRACE_S = 0.05

_imms = itertools.count(1000)


def fresh_imm() -> int:
    """An immediate value no other test uses, so counts never mix across tests."""
    return next(_imms)


class PeerError(AssertionError):
    """A peer process failed a request, gave no reply in time or died."""


class PeerProcess:
    """One tests/engine_peer.py process. Every request has a deadline; close() always ends it."""

    def __init__(
        self,
        provider: str,
        rails: int,
        size: int,
        log_dir: Path,
        *,
        transfer_timeout_s: float = WAIT_S,
    ) -> None:
        self.provider = provider
        self.log_path = log_dir / f"peer-{provider}-{rails}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        self._pending = b""
        self._hello: dict[str, Any] | None = None
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(PEER_PROGRAM),
                f"--provider={provider}",
                f"--rails={rails}",
                f"--size={size}",
                f"--transfer-timeout-s={transfer_timeout_s}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=PEER_PROGRAM.parent,
        )

    # Start-up is read lazily, so several peers can start in parallel.
    @property
    def hello(self) -> dict[str, Any]:
        if self._hello is None:
            self._hello = self._read_reply(REPLY_TIMEOUT_S)
            if not self._hello.get("ok"):
                raise PeerError(f"peer failed to start: {self._hello}")
        return self._hello

    @property
    def address(self) -> bytes:
        return bytes.fromhex(self.hello["address"])

    @property
    def descriptor(self) -> bytes:
        """Descriptor of the peer's region 0."""
        return bytes.fromhex(self.hello["descriptor"])

    def request(
        self, op: str, *, reply_timeout: float = REPLY_TIMEOUT_S, **args: Any
    ) -> dict[str, Any]:
        """Sends one request and returns the peer's reply, failed or not."""
        self.hello  # noqa: B018 - the start-up line comes first
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read_reply(reply_timeout)

    def call(
        self, op: str, *, reply_timeout: float = REPLY_TIMEOUT_S, **args: Any
    ) -> dict[str, Any]:
        """Sends one request that must succeed."""
        reply = self.request(op, reply_timeout=reply_timeout, **args)
        if not reply["ok"]:
            raise PeerError(f"peer {op} failed: {reply['error']}: {reply['message']}")
        return reply

    def _read_reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"peer gave no reply within {timeout} s\n{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise PeerError(f"peer exited (rc={self.proc.wait(5)})\n{self.log_tail()}")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def log_tail(self) -> str:
        self._log.flush()
        return "peer stderr: " + self.log_path.read_text(errors="replace")[-3000:]

    def freeze(self) -> None:
        """SIGSTOP the peer; returns once the kernel shows it stopped."""
        self.proc.send_signal(signal.SIGSTOP)
        wait_until_stopped(self.proc.pid, "the peer process")

    def thaw(self) -> None:
        """SIGCONT the peer."""
        self.proc.send_signal(signal.SIGCONT)

    def exit(self, timeout: float = 10.0) -> None:
        """Asks the peer to close its engine and exit, and waits until it did."""
        self.call("exit", reply_timeout=timeout)
        self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the peer dies wherever it is, mid-transfer included."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        if self.provider == "shm":
            # A killed shm endpoint cannot unlink its shared-memory regions: we do. (Nothing
            # may post to a killed shm peer afterwards: it may have died holding its region's
            # spinlock, on which a sender would spin forever.)
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"{self.proc.pid}:"):
                    os.unlink(f"/dev/shm/{name}")

    def close(self) -> None:
        """Ends the process for sure. SIGKILL rather than a polite exit: nothing is left to
        say to it, and a wedged engine would not exit anyway."""
        try:
            self.kill()
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._log.close()


class EnginePair:
    """An initiator engine in this process and a target peer process with the same provider
    and rails; the peer also writes into this process's inbox region."""

    def __init__(self, provider: str, rails: int, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.target = PeerProcess(provider, rails, PAIR_BYTES[rails], work_dir)
        try:
            self.engine = TransferEngine(
                **engine_options(provider), rails=rails, bind_host=LOOPBACK, transfer_timeout_s=WAIT_S
            )
        except BaseException:
            self.target.close()
            raise
        self.src = np.zeros(PAIR_BYTES[rails], dtype=np.uint8)
        self.mr = self.engine.register(self.src)
        self.inbox = region_buffer(provider, INBOX_BYTES)
        self.inbox_mr = self.engine.register(self.inbox)
        self._dumps = itertools.count()

    @property
    def descriptor(self) -> bytes:
        return self.target.descriptor

    def reset(self) -> "EnginePair":
        """Zeroes what tests use of the target's region 0, and this side's inbox."""
        self.target.call("fill", seed=None, length=RESET_BYTES)
        self.inbox[:] = 0
        return self

    def target_bytes(self, offset: int, length: int, region: int = 0) -> np.ndarray:
        """Bytes [offset, offset+length) of a target region, read back from the peer."""
        if length <= 256 * KIB:
            data = self.target.call("read", offset=offset, length=length, region=region)["data"]
            return np.frombuffer(bytes.fromhex(data), dtype=np.uint8)
        path = self.work_dir / f"dump-{next(self._dumps)}.bin"
        self.target.call("dump", path=str(path), offset=offset, length=length, region=region)
        try:
            return np.fromfile(path, dtype=np.uint8)
        finally:
            path.unlink()

    def target_count(self, imm: int) -> int:
        return int(self.target.call("imm_count", imm=imm)["count"])

    def wait_target_count(self, imm: int, count: int) -> None:
        """Waits until the target counted `count` units of imm, then checks no more arrive."""
        self.target.call("wait_imm", imm=imm, count=count, timeout=WAIT_S)
        time.sleep(STRAY_ARRIVAL_GRACE_S)
        assert self.target_count(imm) == count

    def close(self) -> None:
        # Engine first: nothing may post to the target once it is killed (see PeerProcess.kill).
        try:
            self.engine.close()
        finally:
            self.target.close()


def spares_needed(provider: str) -> int:
    """Peers the dead-peer tests take from the pool: gone and frozen (not on shm, see
    freezable), the refused-ops test's frozen peer, then the killed-peer test's initiator
    and victim."""
    return 5 if freezable(provider) else 3


def freezable(provider: str) -> bool:
    """Whether a peer of this provider may be SIGSTOPped while this process writes to it.

    Not shm: a peer stopped (or killed) while holding its region's spinlock makes every
    sender that posts to it spin inside libfabric until it runs again, wedging our engine.
    """
    return provider != "shm"


class PairPool:
    """The 1-rail and 2-rail pairs of one provider, shared by that provider's tests, and
    spare single-rail peers for the tests that need peers of their own.

    Every process starts at once, when the provider's first test runs: Python and numpy
    take seconds to start on the shared 2-core machine, and this way they do so while
    earlier tests run rather than in front of the test that needs them.
    """

    def __init__(self, provider: str, work_dir: Path) -> None:
        self.provider, self.work_dir = provider, work_dir
        self._pairs: dict[int, EnginePair] = {}
        self._spares: list[PeerProcess] = []
        try:
            for rails in (1, 2):
                self._pairs[rails] = EnginePair(provider, rails, work_dir)
            for _ in range(spares_needed(provider)):
                self._spares.append(self.new_peer())
        except BaseException:
            self.close()
            raise

    def get(self, rails: int) -> EnginePair:
        return self._pairs[rails].reset()

    def new_peer(self) -> PeerProcess:
        """A fresh single-rail peer; as an initiator it gives up on dead peers quickly."""
        return PeerProcess(
            self.provider, 1, SPARE_BYTES, self.work_dir, transfer_timeout_s=DEAD_PEER_TIMEOUT_S
        )

    def spare_peer(self) -> PeerProcess:
        """A single-rail peer no test has talked to, started earlier if one is left."""
        return self._spares.pop() if self._spares else self.new_peer()

    def close(self) -> None:
        for closeable in [*self._pairs.values(), *self._spares]:
            closeable.close()


# -- helpers ----------------------------------------------------------------------------


def assert_same_bytes(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Byte-for-byte equality, reporting where the first difference is."""
    assert actual.shape == expected.shape, f"{what}: {actual.size} bytes, expected {expected.size}"
    if np.array_equal(actual, expected):
        return
    diff = np.flatnonzero(actual != expected)
    raise AssertionError(
        f"{what}: {diff.size} of {expected.size} bytes differ, first at {diff[0]} "
        f"(got {actual[diff[0]]}, expected {expected[diff[0]]})"
    )


def assert_zero(actual: np.ndarray, what: str) -> None:
    assert_same_bytes(actual, np.zeros_like(actual), what)


def ops_posted(engine: TransferEngine) -> int:
    """Fabric ops and same-host copies posted so far."""
    return sum(path["ops_posted"] for path in engine.path_stats().values())


def bytes_completed_per_path(engine: TransferEngine) -> dict[str, int]:
    """Bytes completed so far by each rail ("0", "1", ...) and by "same_host"."""
    return {name: path["bytes_completed"] for name, path in engine.path_stats().items()}


def assert_carried_by_every_rail(
    engine: TransferEngine, before: dict[str, int], size: int, mode: str
) -> None:
    """Each rail carried a share of `size` bytes and together exactly `size`; in same-host
    mode the process-to-process copy carried all of them and the rails none."""
    after = bytes_completed_per_path(engine)
    carried = {name: after[name] - before.get(name, 0) for name in after}
    if mode in SAME_HOST_MODES:
        assert carried.pop("same_host") == size, carried
        assert not any(carried.values()), f"fabric rails carried payload: {carried}"
        return
    carried.pop("same_host", None)
    assert all(c > 0 for c in carried.values()), f"per-rail bytes {carried}: a rail carried nothing"
    assert sum(carried.values()) == size


def assert_still_delivers(pair: EnginePair, seed: int = 99) -> None:
    """The engine of `pair` still writes correct data to its target."""
    imm, length, dst = fresh_imm(), 4 * KIB + 7, 3 * MIB
    data = seeded_bytes(seed, length)
    pair.src[:length] = data
    pair.engine.write(pair.mr, 0, pair.descriptor, dst, length, imm).wait(WAIT_S)
    pair.wait_target_count(imm, 1)
    assert_same_bytes(pair.target_bytes(dst, length), data, "write after the error")


class NothingPosted:
    """Context: what happens inside posts nothing, lands nothing in a watched target range
    and counts no immediate; afterwards the engine still delivers."""

    def __init__(
        self, pair: EnginePair, imm: int, watch: tuple[int, int] = (0, 64 * KIB), region: int = 0
    ) -> None:
        self.pair, self.imm, self.watch, self.region = pair, imm, watch, region

    def __enter__(self) -> "NothingPosted":
        self.ops = ops_posted(self.pair.engine)
        self.before = self.pair.target_bytes(*self.watch, region=self.region)
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            return
        time.sleep(STRAY_ARRIVAL_GRACE_S)
        assert ops_posted(self.pair.engine) == self.ops, "a refused request posted fabric ops"
        after = self.pair.target_bytes(*self.watch, region=self.region)
        assert_same_bytes(after, self.before, "target after refused requests")
        assert self.pair.target_count(self.imm) == 0
        assert_still_delivers(self.pair)


class OwnPeers:
    """Peer processes one test uses for itself; all are ended at the test's teardown."""

    def __init__(self, pairs: PairPool) -> None:
        self._pairs = pairs
        self.taken: list[PeerProcess] = []

    def spare(self) -> PeerProcess:
        """A peer started before this test (but never talked to)."""
        self.taken.append(self._pairs.spare_peer())
        return self.taken[-1]

    def start(self) -> PeerProcess:
        """A peer started now."""
        self.taken.append(self._pairs.new_peer())
        return self.taken[-1]

def wait_for_stat(engine: TransferEngine, key: str, value: int) -> None:
    """Waits (bounded) until engine_stats()[key] reached `value`: a sender's completion may
    come before the receiver's worker read the arrival."""
    deadline = time.monotonic() + WAIT_S
    while engine.engine_stats()[key] < value and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.engine_stats()[key] == value, engine.engine_stats()

only_first_provider = pytest.mark.parametrize("provider", PROVIDERS[:1], indirect=True)

def fnv1a32(data: bytes) -> int:
    h = 2166136261
    for byte in data:
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h
