"""Specification of kvxfer.TransferEngine between two processes, on every loopback provider.

The initiator engine lives in this process; the far side is tests/support/engine_peer.py, a
separate process driven over JSON lines, which also writes back into memory registered
here. Every provider present among net, tcp and shm is tested (with the same-host path
off), and so is the same-host path, with immediates over net: "same-host" (regions in
plain memory, bytes by process_vm_writev) and "same-host-mapped" (regions in
SharedBuffers, mapped by the writer, bytes by memcpy); 1 and 2 rails where sharding
matters. Payloads are seeded (numpy default_rng) and compared byte for byte,
together with the bytes around each destination, which must stay zero. Data is checked
only after the receiver counted the write's immediate: that is the engine's contract for
"every byte landed" (an initiator's completion is not, on socket providers).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from support.engine_peer import (
    SAME_HOST,
    SAME_HOST_MAPPED,
    SAME_HOST_MODES,
    engine_options,
    provider_of,
    region_buffer,
    seeded_bytes,
)
from kvxfer.transfer.engine import TransferEngine, available_providers
from kvxfer.errors import BoundsError, DescriptorError, EngineError, TransferError, TransferTimeout

PEER_PROGRAM = Path(__file__).resolve().parents[1] / "support" / "engine_peer.py"
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
    freezable), then the killed-peer test's initiator and victim."""
    return 4 if freezable(provider) else 3


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


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=MODES)
def provider(request: pytest.FixtureRequest) -> str:
    """The test mode: a libfabric provider, or SAME_HOST."""
    return request.param


@pytest.fixture(scope="module")
def pairs(provider: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PairPool]:
    pool = PairPool(provider, tmp_path_factory.mktemp(f"engine-{provider}"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture()
def pair(pairs: PairPool) -> EnginePair:
    """The provider's single-rail pair, target zeroed."""
    return pairs.get(1)


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


@pytest.fixture()
def peers(pairs: PairPool) -> Iterator[OwnPeers]:
    own = OwnPeers(pairs)
    try:
        yield own
    finally:
        for peer in own.taken:
            peer.close()


# -- single writes ----------------------------------------------------------------------


@pytest.mark.parametrize("rails", [1, 2])
@pytest.mark.parametrize("size", [1, 4 * KIB + 3, 1 * MIB], ids=["1B", "4KiB+3", "1MiB"])
def test_single_write_lands_byte_for_byte_and_counts_one_immediate(
    pairs: PairPool, rails: int, size: int
) -> None:
    pair = pairs.get(rails)
    imm, src_offset, dst_offset, margin = fresh_imm(), 13, 8 * KIB + 5, 4 * KIB
    data = seeded_bytes(size, size)
    pair.src[src_offset : src_offset + size] = data

    pair.engine.write(pair.mr, src_offset, pair.descriptor, dst_offset, size, imm).wait(WAIT_S)

    pair.wait_target_count(imm, 1)
    expected = np.zeros(size + 2 * margin, dtype=np.uint8)
    expected[margin : margin + size] = data
    landed = pair.target_bytes(dst_offset - margin, size + 2 * margin)
    assert_same_bytes(landed, expected, f"{size}-byte write and its surroundings")


def test_64_mib_write_lands_byte_for_byte(pairs: PairPool) -> None:
    pair = pairs.get(1)
    imm, size, dst_offset = fresh_imm(), 64 * MIB, 32 * KIB
    data = seeded_bytes(64, size)
    pair.src[:size] = data

    transfer = pair.engine.write(pair.mr, 0, pair.descriptor, dst_offset, size, imm)
    transfer.wait(WAIT_S)

    assert transfer.bytes == size
    pair.wait_target_count(imm, 1)
    target = pair.target_bytes(0, PAIR_BYTES[1])
    assert_zero(target[:dst_offset], "bytes before the write")
    assert_same_bytes(target[dst_offset : dst_offset + size], data, "64 MiB write")
    assert_zero(target[dst_offset + size :], "bytes after the write")


def test_single_write_over_two_rails_is_sharded_yet_counts_exactly_one_immediate(
    pairs: PairPool, provider: str
) -> None:
    pair = pairs.get(2)
    imm, size = fresh_imm(), 8 * MIB
    data = seeded_bytes(8, size)
    pair.src[:size] = data
    before = bytes_completed_per_path(pair.engine)

    pair.engine.write(pair.mr, 0, pair.descriptor, 0, size, imm).wait(WAIT_S)

    pair.wait_target_count(imm, 1)
    landed = pair.target_bytes(0, size + 64 * KIB)
    assert_same_bytes(landed[:size], data, "sharded write")
    assert_zero(landed[size:], "bytes after the sharded write")
    assert_carried_by_every_rail(pair.engine, before, size, provider)


# -- paged writes -----------------------------------------------------------------------


def page_lists(seed: int, pages_per_side: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` distinct source and destination pages in random order: runs of 4 pages that
    stay adjacent on both sides (coalescable) and runs scattered within themselves."""
    rng = np.random.default_rng(seed)
    runs = count // 4
    src_runs = rng.permutation(pages_per_side // 4)[:runs] * 4
    dst_runs = rng.permutation(pages_per_side // 4)[:runs] * 4
    src, dst = [], []
    for k, (s, d) in enumerate(zip(src_runs, dst_runs)):
        order = np.arange(4) if k % 2 == 0 else rng.permutation(4)
        src.extend(s + order)
        dst.extend(d + np.arange(4))
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


@pytest.mark.parametrize("rails", [1, 2])
def test_writes_without_an_immediate_land_and_count_nothing_not_even_immediate_0(
    pairs: PairPool, rails: int
) -> None:
    # Such writes still carry CQ data (a marker that keeps the target's worker polling,
    # rail_group.hpp): it must never reach a counter. Its immediate field is 0.
    pair = pairs.get(rails)
    page, count = 16 * KIB, 64
    data = seeded_bytes(7 + rails, 2 * MIB)
    pair.src[: data.size] = data
    single = pair.engine.write(pair.mr, 0, pair.descriptor, 0, 1 * MIB)
    paged = pair.engine.write_paged(
        pair.mr, list(range(64, 64 + count)), pair.descriptor,
        list(range(count - 1, -1, -1)), page, dst_offset=1 * MIB,
    )
    single.wait(WAIT_S)
    paged.wait(WAIT_S)

    expected = data.copy()
    for i in range(count):
        d = count - 1 - i
        expected[MIB + d * page : MIB + (d + 1) * page] = data[(64 + i) * page : (65 + i) * page]
    assert_same_bytes(pair.target_bytes(0, 2 * MIB), expected, "writes without immediates")
    time.sleep(STRAY_ARRIVAL_GRACE_S)
    assert pair.target_count(0) == 0


@pytest.mark.parametrize("rails", [1, 2])
def test_paged_write_with_random_permutations_lands_every_page_and_counts_one_per_page(
    pairs: PairPool, provider: str, rails: int
) -> None:
    pair = pairs.get(rails)
    imm, page, pages_per_side, count = fresh_imm(), 16 * KIB, 512, 300
    src_pages, dst_pages = page_lists(rails, pages_per_side, count)
    region = pages_per_side * page
    data = seeded_bytes(100 + rails, region)
    pair.src[:region] = data
    before = bytes_completed_per_path(pair.engine)

    transfer = pair.engine.write_paged(
        pair.mr, src_pages, pair.descriptor, dst_pages, page, imm=imm
    )
    transfer.wait(WAIT_S)

    assert transfer.bytes == len(src_pages) * page
    pair.wait_target_count(imm, len(src_pages))
    expected = np.zeros(region + 64 * KIB, dtype=np.uint8)
    for s, d in zip(src_pages, dst_pages):
        expected[d * page : (d + 1) * page] = data[s * page : (s + 1) * page]
    assert_same_bytes(pair.target_bytes(0, expected.size), expected, "paged target")
    assert_carried_by_every_rail(pair.engine, before, len(src_pages) * page, provider)


@pytest.mark.parametrize("rails", [1, 2])
def test_paged_write_places_page_p_at_offset_plus_p_times_stride_on_each_side(
    pairs: PairPool, rails: int
) -> None:
    pair = pairs.get(rails)
    imm, page = fresh_imm(), 4 * KIB + 100
    src_stride, dst_stride, src_offset, dst_offset = 2 * page, 3 * page + 1, 1000, 5003
    src_pages, dst_pages = np.array([5, 0, 7, 3, 1]), np.array([2, 9, 0, 4, 6])
    data = seeded_bytes(31, 8 * src_stride + src_offset)
    pair.src[: data.size] = data

    pair.engine.write_paged(
        pair.mr, src_pages, pair.descriptor, dst_pages, page,
        src_stride=src_stride, dst_stride=dst_stride, src_offset=src_offset,
        dst_offset=dst_offset, imm=imm,
    ).wait(WAIT_S)

    pair.wait_target_count(imm, len(src_pages))
    expected = np.zeros(dst_offset + 11 * dst_stride, dtype=np.uint8)
    for s, d in zip(src_pages, dst_pages):
        at, frm = dst_offset + d * dst_stride, src_offset + s * src_stride
        expected[at : at + page] = data[frm : frm + page]
    assert_same_bytes(pair.target_bytes(0, expected.size), expected, "strided pages")


# -- immediates -------------------------------------------------------------------------


@pytest.mark.parametrize("rails", [1, 2])
def test_interleaved_immediates_are_counted_exactly_per_value_in_any_arrival_order(
    pairs: PairPool, rails: int
) -> None:
    pair = pairs.get(rails)
    imms = [fresh_imm() for _ in range(3)]
    rng = np.random.default_rng(5)
    expected = dict.fromkeys(imms, 0)
    transfers = []
    # All submitted before any is waited for, so arrivals interleave freely across rails.
    for step in range(48):
        imm = imms[int(rng.integers(3))]
        kind = step % 4
        if kind == 0:
            transfers.append(
                pair.engine.write(pair.mr, 0, pair.descriptor, step * 4 * KIB, 4 * KIB, imm)
            )
            expected[imm] += 1
        elif kind == 1:
            pages = int(rng.integers(1, 9))
            dst = rng.permutation(256)[:pages]
            transfers.append(
                pair.engine.write_paged(
                    pair.mr, np.arange(pages), pair.descriptor, dst, 4 * KIB, imm=imm
                )
            )
            expected[imm] += pages
        elif kind == 2:
            transfers.append(pair.engine.write_imm(pair.target.address, imm))
            expected[imm] += 1
        else:  # large enough to be sharded when rails=2
            transfers.append(pair.engine.write(pair.mr, 0, pair.descriptor, 2 * MIB, 1 * MIB, imm))
            expected[imm] += 1
    for t in transfers:
        t.wait(WAIT_S)

    for imm, count in expected.items():
        pair.wait_target_count(imm, count)


def test_wait_imm_that_is_not_reached_raises_transfer_timeout_saying_how_many_arrived(
    pair: EnginePair,
) -> None:
    imm, inbox = fresh_imm(), pair.inbox_mr.descriptor.hex()
    pair.target.call("write", descriptor=inbox, src_offset=0, dst_offset=0, length=64, imm=imm)
    pair.engine.wait_imm(imm, 1, WAIT_S)

    started = time.monotonic()
    with pytest.raises(TransferTimeout, match=rf"^imm {imm}: 1 of 2 arrived within 0\.3 s$"):
        pair.engine.wait_imm(imm, 2, 0.3)
    assert 0.3 <= time.monotonic() - started < 5.0

    refused = pair.target.request("wait_imm", imm=imm, count=1, timeout=0.2)
    assert (refused["ok"], refused["error"]) == (False, "TransferTimeout")
    assert refused["message"] == f"imm {imm}: 0 of 1 arrived within 0.2 s"


def test_consume_imm_subtracts_a_finished_request_so_the_value_can_be_reused(
    pair: EnginePair,
) -> None:
    imm, inbox = fresh_imm(), pair.inbox_mr.descriptor.hex()
    pages = {"descriptor": inbox, "page_size": 4 * KIB, "imm": imm}
    pair.target.call("write_paged", src_pages=[0, 1, 2], dst_pages=[4, 5, 6], **pages)
    pair.engine.wait_imm(imm, 3, WAIT_S)

    pair.engine.consume_imm(imm, 3)

    assert pair.engine.imm_count(imm) == 0
    with pytest.raises(TransferTimeout):
        pair.engine.wait_imm(imm, 1, 0.1)
    pair.target.call("write_paged", src_pages=[0, 1], dst_pages=[7, 8], **pages)
    pair.engine.wait_imm(imm, 2, WAIT_S)
    time.sleep(STRAY_ARRIVAL_GRACE_S)
    assert pair.engine.imm_count(imm) == 2


def wait_for_stat(engine: TransferEngine, key: str, value: int) -> None:
    """Waits (bounded) until engine_stats()[key] reached `value`: a sender's completion may
    come before the receiver's worker read the arrival."""
    deadline = time.monotonic() + WAIT_S
    while engine.engine_stats()[key] < value and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.engine_stats()[key] == value, engine.engine_stats()


only_first_provider = pytest.mark.parametrize("provider", PROVIDERS[:1], indirect=True)


@only_first_provider
def test_arrivals_beyond_the_immediate_table_are_counted_as_overflows_and_their_waits_fail(
    provider: str, peers: OwnPeers
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvxfer.errors import ImmCounterOverflow
    from kvxfer.metrics import EngineMetrics

    capacity, extra = 16, 5
    with TransferEngine(
        **engine_options(provider), bind_host=LOOPBACK, imm_table_capacity=capacity
    ) as receiver:
        sender = peers.spare()
        imms = list(range(1, capacity + extra + 1))
        sender.call("write_imms", target=receiver.address.hex(), imms=imms)
        wait_for_stat(receiver, "imm_table_overflows", extra)

        receiver.wait_imm(imms[0], 1, WAIT_S)  # counted values still work
        started = time.monotonic()
        with pytest.raises(ImmCounterOverflow, match=rf"^imm {imms[-1]}: 0 of 1 arrived, .*table is full \({capacity} distinct.* {extra} arrivals were dropped"):
            receiver.wait_imm(imms[-1], 1, WAIT_S)
        with pytest.raises(ImmCounterOverflow):
            receiver.wait_imm(10_000, 1, WAIT_S)  # no slot left for it either
        with pytest.raises(ImmCounterOverflow):
            asyncio.run(asyncio.wait_for(receiver.wait_imm_async(imms[-2], 1, WAIT_S), 60))
        assert time.monotonic() - started < WAIT_S / 2, "failed waits must not run to their deadline"

        registry = CollectorRegistry()
        EngineMetrics(registry, receiver.path_stats)
        assert f"kvxfer_engine_imm_table_overflows_total {float(extra)}" in generate_latest(registry).decode()


@only_first_provider
@pytest.mark.parametrize("bound", ["messages", "bytes"])
def test_unread_control_messages_are_held_up_to_the_inbox_bounds_and_the_rest_dropped_and_counted(
    provider: str, peers: OwnPeers, bound: str
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvxfer.metrics import EngineMetrics

    size, sent, kept = 16 * KIB, 20, 5
    limits = (
        {"inbox_max_messages": kept}
        if bound == "messages"
        else {"inbox_max_bytes": kept * size + size - 1}
    )
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK, **limits) as receiver:
        sender = peers.spare()
        sender.call("send_many", target=receiver.address.hex(), count=sent, size=size)
        wait_for_stat(receiver, "inbox_dropped_messages", sent - kept)

        stats = receiver.engine_stats()
        assert stats["inbox_dropped_bytes"] == (sent - kept) * size
        assert (stats["inbox_messages"], stats["inbox_bytes"]) == (kept, kept * size)
        received = [receiver.recv(WAIT_S) for _ in range(kept)]
        assert all(m is not None and len(m) == size and m == m[:1] * size for m in received)
        assert receiver.recv(0.1) is None
        assert (receiver.engine_stats()["inbox_messages"], receiver.engine_stats()["inbox_bytes"]) == (0, 0)

        registry = CollectorRegistry()
        EngineMetrics(registry, receiver.path_stats)
        text = generate_latest(registry).decode()
        assert f"kvxfer_engine_inbox_dropped_messages_total {float(sent - kept)}" in text
        assert f"kvxfer_engine_inbox_dropped_bytes_total {float((sent - kept) * size)}" in text


# -- asyncio ----------------------------------------------------------------------------


def test_transfers_and_immediate_counts_can_be_awaited_in_an_event_loop(pair: EnginePair) -> None:
    out_imm, in_imm, seed = fresh_imm(), fresh_imm(), 17
    data = seeded_bytes(seed, 64 * KIB)
    pair.src[: data.size] = data
    pair.target.call("fill", seed=seed, length=16 * KIB)
    inbox = pair.inbox_mr.descriptor.hex()

    async def scenario() -> None:
        await pair.engine.write(pair.mr, 0, pair.descriptor, 0, data.size, out_imm)
        arrival = asyncio.ensure_future(pair.engine.wait_imm_async(in_imm, 2, WAIT_S))
        # The peer's blocking request runs in a thread while this loop keeps running.
        await asyncio.to_thread(
            pair.target.call, "write_paged", descriptor=inbox,
            src_pages=[3, 0], dst_pages=[1, 5], page_size=4 * KIB, imm=in_imm,
        )
        await arrival
        with pytest.raises(TransferTimeout, match=rf"imm {in_imm}: 2 of 3 arrived"):
            await pair.engine.wait_imm_async(in_imm, 3, 0.2)

    asyncio.run(asyncio.wait_for(scenario(), 60))

    pair.wait_target_count(out_imm, 1)
    assert_same_bytes(pair.target_bytes(0, data.size), data, "awaited write")
    peer_bytes = seeded_bytes(seed, 16 * KIB)
    assert_same_bytes(pair.inbox[4 * KIB : 8 * KIB], peer_bytes[12 * KIB : 16 * KIB], "peer page 3")
    assert_same_bytes(pair.inbox[20 * KIB : 24 * KIB], peer_bytes[: 4 * KIB], "peer page 0")


# -- control messages -------------------------------------------------------------------


def test_control_messages_round_trip_between_processes(pair: EnginePair) -> None:
    payload = seeded_bytes(23, 1000).tobytes()
    message = pair.engine.address.hex().encode() + b"|" + payload.hex().encode()

    pair.engine.send(pair.target.address, message).wait(WAIT_S)
    assert pair.target.call("echo", timeout=WAIT_S)["echoed"]

    assert pair.engine.recv(WAIT_S) == payload[::-1]


def test_control_message_of_64_kib_arrives_whole_and_larger_or_empty_ones_are_refused(
    pair: EnginePair,
) -> None:
    largest = seeded_bytes(29, 64 * KIB).tobytes()
    pair.engine.send(pair.target.address, largest).wait(WAIT_S)
    assert bytes.fromhex(pair.target.call("recv", timeout=WAIT_S)["payload"]) == largest

    posted = ops_posted(pair.engine)
    with pytest.raises(BoundsError, match="exceeds the 65536-byte limit"):
        pair.engine.send(pair.target.address, largest + b"x")
    with pytest.raises(BoundsError, match="empty message"):
        pair.engine.send(pair.target.address, b"")
    assert ops_posted(pair.engine) == posted
    assert pair.target.call("recv", timeout=0.1)["payload"] is None


def test_recv_with_nothing_sent_returns_none_after_its_timeout(pair: EnginePair) -> None:
    started = time.monotonic()
    assert pair.engine.recv(0.2) is None
    assert 0.2 <= time.monotonic() - started < 5.0


# -- descriptors ------------------------------------------------------------------------


def test_pickled_descriptor_round_trips_and_still_addresses_the_region(pair: EnginePair) -> None:
    imm = fresh_imm()
    descriptor = pickle.loads(pickle.dumps(pair.descriptor))
    assert type(descriptor) is bytes and descriptor == pair.descriptor
    mine = pickle.loads(pickle.dumps(pair.inbox_mr.descriptor))
    assert mine == pair.inbox_mr.descriptor
    data = seeded_bytes(37, 777)
    pair.src[: data.size] = data

    pair.engine.write(pair.mr, 0, descriptor, 100, data.size, imm).wait(WAIT_S)

    pair.wait_target_count(imm, 1)
    assert_same_bytes(pair.target_bytes(100, data.size), data, "write through a pickled descriptor")


def test_descriptor_with_any_one_byte_flipped_is_refused_with_descriptor_error(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    with NothingPosted(pair, imm):
        for i in range(len(pair.descriptor)):
            corrupt = bytearray(pair.descriptor)
            corrupt[i] ^= 0x01
            with pytest.raises(DescriptorError, match="malformed memory descriptor"):
                pair.engine.write(pair.mr, 0, bytes(corrupt), 0, 64, imm)


def test_truncated_descriptor_is_refused_with_descriptor_error(pair: EnginePair) -> None:
    imm = fresh_imm()
    with NothingPosted(pair, imm):
        for length in range(len(pair.descriptor)):
            with pytest.raises(DescriptorError, match="malformed memory descriptor"):
                pair.engine.write(pair.mr, 0, pair.descriptor[:length], 0, 64, imm)
            with pytest.raises(DescriptorError):
                pair.engine.write_paged(pair.mr, [0], pair.descriptor[:length], [0], 64, imm=imm)


def test_foreign_descriptors_are_refused_with_descriptor_error(
    pair: EnginePair, provider: str
) -> None:
    imm = fresh_imm()
    other = next((p for p in PROVIDERS if p != provider_of(provider)), None)
    with NothingPosted(pair, imm):
        with pytest.raises(DescriptorError, match="wrong magic"):
            # An engine address is a valid blob of the wrong kind.
            pair.engine.write(pair.mr, 0, pair.target.address, 0, 64, imm)
        with pytest.raises(DescriptorError):
            noise = seeded_bytes(41, len(pair.descriptor)).tobytes()
            pair.engine.write(pair.mr, 0, noise, 0, 64, imm)
        if other is not None:
            with TransferEngine(other, bind_host=LOOPBACK) as stranger:
                buf = np.zeros(4 * KIB, dtype=np.uint8)
                foreign = stranger.register(buf).descriptor
                with pytest.raises(DescriptorError, match=f"provider '{other}'"):
                    pair.engine.write(pair.mr, 0, foreign, 0, 64, imm)
                with pytest.raises(DescriptorError, match=f"provider '{other}'"):
                    pair.engine.write_imm(stranger.address, imm)


def test_descriptor_naming_a_provider_that_is_not_utf8_is_refused_with_descriptor_error(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    provider = pair.engine.provider.encode()
    body = pair.descriptor[:-4]
    assert body.count(bytes([len(provider)]) + provider) == 1
    # Same length, checksum valid again: only the name itself is wrong.
    bad = body.replace(provider, provider[:-1] + b"\xff")
    bad += fnv1a32(bad).to_bytes(4, "little")
    with NothingPosted(pair, imm):
        with pytest.raises(DescriptorError, match="provider name is not printable ASCII"):
            pair.engine.write(pair.mr, 0, bad, 0, 64, imm)


def test_seeded_fuzz_of_descriptors_only_ever_raises_descriptor_error(pair: EnginePair) -> None:
    # Bounded and seeded (no hypothesis): random bytes, and valid descriptors truncated or
    # with a few bytes mutated, half of them with a repaired checksum so that the field
    # checks behind it are reached. Parsing only: a mutant that parses is never written to.
    rng = np.random.default_rng(20251123)
    valid = pair.descriptor
    for case in range(1500):
        kind = case % 3
        if kind == 0:
            blob = rng.bytes(int(rng.integers(0, 200)))
        else:
            blob = bytearray(valid)
            for _ in range(int(rng.integers(1, 5))):
                blob[int(rng.integers(0, len(blob) - 4))] = int(rng.integers(0, 256))
            if kind == 2 and rng.integers(0, 4) == 0:
                blob = blob[: int(rng.integers(0, len(blob)))]
            if rng.integers(0, 2) and len(blob) >= 4:
                blob[-4:] = fnv1a32(bytes(blob[:-4])).to_bytes(4, "little")
            blob = bytes(blob)
        try:
            assert pair.engine.path_to(blob) in ("fabric", "same_host", "same_host_mapped")
        except DescriptorError:
            pass
        except Exception as e:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"case {case}: {type(e).__name__} for {blob.hex()}") from e
    assert_still_delivers(pair)


# -- the same-host path -----------------------------------------------------------------

only_same_host = pytest.mark.parametrize("provider", list(SAME_HOST_MODES), indirect=True)
# What TransferEngine.path_to says of a peer's region 0 in each same-host mode.
SAME_HOST_PATH = {SAME_HOST: "same_host", SAME_HOST_MAPPED: "same_host_mapped"}


def fnv1a32(data: bytes) -> int:
    h = 2166136261
    for byte in data:
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


def with_region_address(descriptor: bytes, old: int, new: int) -> bytes:
    """The descriptor with its region's virtual address replaced, checksum made valid again:
    a forgery that only the owner's region table can expose."""
    old_bytes, new_bytes = old.to_bytes(8, "little"), new.to_bytes(8, "little")
    body = descriptor[:-4]
    assert body.count(old_bytes) == 1, "cannot locate the region address in the descriptor"
    body = body.replace(old_bytes, new_bytes)
    return body + fnv1a32(body).to_bytes(4, "little")


@only_same_host
def test_same_host_writes_copy_process_to_process_and_only_immediates_use_the_fabric(
    pair: EnginePair, provider: str
) -> None:
    imm, page, count = fresh_imm(), 4 * KIB, 64
    data = seeded_bytes(61, count * page)
    pair.src[: data.size] = data
    fabric_before = [rail["bytes_completed"] for rail in pair.engine.stats()]
    assert pair.engine.path_to(pair.descriptor) == SAME_HOST_PATH[provider]

    pair.engine.write_paged(
        pair.mr, np.arange(count), pair.descriptor, np.arange(count)[::-1] * 2, page, imm=imm
    ).wait(WAIT_S)

    pair.wait_target_count(imm, count)
    landed = pair.target_bytes(0, 2 * count * page)
    for i in range(count):
        d = (count - 1 - i) * 2
        assert_same_bytes(landed[d * page : (d + 1) * page], data[i * page : (i + 1) * page], f"page {i}")
        assert_zero(landed[(d + 1) * page : (d + 2) * page], f"gap after page {i}")
    # The immediates (64 pages as one weighted message) are all the fabric carried.
    assert [rail["bytes_completed"] for rail in pair.engine.stats()] == fabric_before


def same_host_handles() -> tuple[int, int]:
    """(pidfds open here, kvxfer memfds mapped here): what same-host peers cost this process."""
    pidfds = sum(os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
                 for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))
    with open("/proc/self/maps") as maps:
        mapped = sum("/memfd:kvxfer" in line for line in maps)
    return pidfds, mapped


@only_same_host
def test_a_same_host_peer_that_exited_is_let_go_once_a_new_peer_comes(
    provider: str, peers: OwnPeers
) -> None:
    # Workers restart for the life of a service: the engine must not keep a dead peer's
    # pidfd, region table and (mapped mode) KV memory for as long as it runs.
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK) as engine:
        mr = engine.register(np.ones(64 * KIB, dtype=np.uint8))
        before = same_host_handles()
        first = peers.spare()
        engine.write(mr, 0, first.descriptor, 0, 4 * KIB).wait(WAIT_S)
        with_one_peer = same_host_handles()
        assert with_one_peer[0] > before[0]  # its pidfd
        first.exit()

        second = peers.spare()
        engine.write(mr, 0, second.descriptor, 0, 4 * KIB).wait(WAIT_S)
        assert same_host_handles() == with_one_peer  # the first peer's are gone
        landed = bytes.fromhex(second.call("read", offset=0, length=4 * KIB)["data"])
        assert landed == b"\x01" * (4 * KIB)


@only_same_host
def test_same_host_write_into_a_region_its_owner_deregistered_fails_and_lands_nothing(
    pair: EnginePair, provider: str
) -> None:
    imm = fresh_imm()
    region = pair.target.call("register", size=64 * KIB)
    descriptor = bytes.fromhex(region["descriptor"])
    pair.engine.write(pair.mr, 0, descriptor, 0, 8, imm).wait(WAIT_S)  # parsed, path cached
    assert pair.engine.path_to(descriptor) == SAME_HOST_PATH[provider]
    pair.target.call("fill", region=region["region"], seed=None)
    pair.target.call("deregister", region=region["region"])
    pair.src[: 4 * KIB] = seeded_bytes(62, 4 * KIB)

    with pytest.raises(TransferError, match="no longer registered"):
        pair.engine.write(pair.mr, 0, descriptor, 0, 4 * KIB, imm).wait(WAIT_S)

    assert_zero(pair.target_bytes(0, 64 * KIB, region=region["region"]), "deregistered region")
    assert_still_delivers(pair)


@only_same_host
def test_forged_same_host_descriptor_is_not_trusted_for_process_to_process_copies(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    victim = pair.target.call("register", size=64 * KIB)
    decoy = pair.target.call("register", size=64 * KIB)
    # Names the decoy's region id and size, but the victim's memory.
    forged = with_region_address(
        bytes.fromhex(decoy["descriptor"]), decoy["address"], victim["address"]
    )
    pair.target.call("fill", region=victim["region"], seed=None)

    assert pair.engine.path_to(forged) == "fabric"
    pair.src[: 4 * KIB] = seeded_bytes(63, 4 * KIB)
    try:
        pair.engine.write(pair.mr, 0, forged, 0, 4 * KIB, imm).wait(WAIT_S)
    except TransferError:
        pass  # a provider with virtual addressing refuses the forged address: also fine

    time.sleep(STRAY_ARRIVAL_GRACE_S)
    assert_zero(pair.target_bytes(0, 64 * KIB, region=victim["region"]), "the forged target")


@only_same_host
@pytest.mark.parametrize("turned_off_by", ["argument", "environment"])
def test_engine_with_same_host_off_writes_over_the_fabric_to_a_same_host_peer(
    pair: EnginePair, turned_off_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    imm, size = fresh_imm(), 256 * KIB
    data = seeded_bytes(64, size)
    if turned_off_by == "environment":
        monkeypatch.setenv("KVXFER_SAME_HOST", "false")
        options: dict[str, Any] = {}
    else:
        monkeypatch.delenv("KVXFER_SAME_HOST", raising=False)
        options = {"same_host": False}
    with TransferEngine(provider_of(SAME_HOST), bind_host=LOOPBACK, **options) as engine:
        src = np.zeros(size, dtype=np.uint8)
        src[:] = data
        mr = engine.register(src)
        assert engine.path_to(pair.descriptor) == "fabric"

        engine.write(mr, 0, pair.descriptor, 0, size, imm).wait(WAIT_S)

        pair.wait_target_count(imm, 1)
        assert sum(rail["bytes_completed"] for rail in engine.stats()) == size
        assert engine.same_host_stats()["bytes_completed"] == 0
    assert_same_bytes(pair.target_bytes(0, size), data, "fabric write to a same-host peer")


@only_same_host
def test_explicit_same_host_argument_wins_over_kvxfer_same_host_in_the_environment(
    pair: EnginePair, provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    imm, size = fresh_imm(), 64 * KIB
    data = seeded_bytes(65, size)
    monkeypatch.setenv("KVXFER_SAME_HOST", "false")
    with TransferEngine(provider_of(SAME_HOST), bind_host=LOOPBACK, same_host=True) as engine:
        src = np.zeros(size, dtype=np.uint8)
        src[:] = data
        mr = engine.register(src)
        assert engine.path_to(pair.descriptor) == SAME_HOST_PATH[provider]

        engine.write(mr, 0, pair.descriptor, 0, size, imm).wait(WAIT_S)

        pair.wait_target_count(imm, 1)
        assert engine.same_host_stats()["bytes_completed"] == size
    assert_same_bytes(pair.target_bytes(0, size), data, "same-host write despite the variable")


def test_kvxfer_same_host_with_a_value_that_is_not_a_boolean_raises_engine_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVXFER_SAME_HOST", "flase")
    with pytest.raises(EngineError, match="KVXFER_SAME_HOST='flase'"):
        TransferEngine(PROVIDERS[0], bind_host=LOOPBACK)


# -- bounds -----------------------------------------------------------------------------


def test_write_beyond_a_smaller_remote_region_raises_bounds_error_and_lands_nothing(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    small = pair.target.call("register", size=4 * KIB)
    descriptor = bytes.fromhex(small["descriptor"])
    with NothingPosted(pair, imm, watch=(0, 4 * KIB), region=small["region"]):
        for dst_offset, length in [(0, 4 * KIB + 1), (1, 4 * KIB), (4 * KIB, 1), (2**62, 1)]:
            with pytest.raises(BoundsError, match="destination range"):
                pair.engine.write(pair.mr, 0, descriptor, dst_offset, length, imm)
        with pytest.raises(BoundsError, match="destination page 1"):
            pair.engine.write_paged(pair.mr, [0, 1], descriptor, [0, 1], 4 * KIB, imm=imm)
    # The small region itself is writable within its bounds.
    data = seeded_bytes(43, 4 * KIB)
    pair.src[: data.size] = data
    pair.engine.write(pair.mr, 0, descriptor, 0, data.size, imm).wait(WAIT_S)
    pair.wait_target_count(imm, 1)
    assert_same_bytes(pair.target_bytes(0, 4 * KIB, region=small["region"]), data, "small region")


def test_source_range_beyond_the_local_region_raises_bounds_error(pair: EnginePair) -> None:
    imm, size = fresh_imm(), PAIR_BYTES[1]
    with NothingPosted(pair, imm):
        for src_offset, length in [(size - 10, 11), (size, 1), (size + 1, 1), (0, size + 1)]:
            with pytest.raises(BoundsError, match="source range"):
                pair.engine.write(pair.mr, src_offset, pair.descriptor, 0, length, imm)


def test_negative_or_zero_sizes_and_out_of_range_immediates_raise_bounds_error(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    with NothingPosted(pair, imm):
        for kwargs in [
            dict(src_offset=-1, dst_offset=0, length=8, imm=imm),
            dict(src_offset=0, dst_offset=-1, length=8, imm=imm),
            dict(src_offset=0, dst_offset=0, length=-1, imm=imm),
            dict(src_offset=0, dst_offset=0, length=0, imm=imm),
            dict(src_offset=0, dst_offset=0, length=8, imm=-1),
            dict(src_offset=0, dst_offset=0, length=8, imm=2**32),
        ]:
            with pytest.raises(BoundsError):
                pair.engine.write(pair.mr, remote_descriptor=pair.descriptor, **kwargs)
        with pytest.raises(BoundsError):
            pair.engine.write_imm(pair.target.address, 2**32)


def test_bad_page_lists_raise_bounds_error_before_any_page_is_posted(pair: EnginePair) -> None:
    imm, page = fresh_imm(), 4 * KIB
    end = PAIR_BYTES[1] // page  # first page index past either region
    # Valid pages first and the bad entry last: a planner that posted as it validated would
    # already have written something.
    ok = list(range(8))
    huge = 2**63 - 1
    # (what is wrong, src_pages, dst_pages, other arguments, expected message)
    cases: list[tuple[str, Any, Any, dict[str, int], str]] = [
        ("src index one past the end", ok + [end], ok + [8], {}, "source page"),
        ("dst index one past the end", ok + [8], ok + [end], {}, "destination page"),
        ("negative src index", ok + [-1], ok + [8], {}, "negative page index at position 8"),
        ("negative dst index", ok + [8], ok + [-1], {}, "negative page index at position 8"),
        ("huge dst index", ok + [8], ok + [2**62], {}, "destination page"),
        ("longer src list", ok + [8], ok, {}, "src_pages has 9 entries but dst_pages has 8"),
        ("longer dst list", ok, ok + [8], {}, "src_pages has 8 entries but dst_pages has 9"),
        ("two-dimensional", [ok], [ok], {}, "one-dimensional"),
        ("float indices", [0.5], [1.0], {}, "must hold integers"),
        ("no pages", [], [], {}, "no pages"),
        ("zero page size", ok, ok, {"page_size": 0}, "page_size must be > 0"),
        ("stride below page", ok, ok, {"dst_stride": page - 1}, "strides must be >= page_size"),
        ("negative offset", ok, ok, {"dst_offset": -1}, "dst_offset must be >= 0"),
        ("offset past the end", [0], [0], {"dst_offset": PAIR_BYTES[1]}, "destination page 0"),
        # offset + index * stride wraps past 2**64 back into the region: still refused.
        ("wrapping dst geometry", [0], [1],
         {"page_size": 2, "dst_offset": huge, "dst_stride": huge}, "destination page 1"),
        ("wrapping src geometry", [1], [0],
         {"page_size": 2, "src_offset": huge, "src_stride": huge}, "source page 1"),
    ]
    with NothingPosted(pair, imm, watch=(0, 64 * KIB)):
        for wrong, src_pages, dst_pages, other, message in cases:
            args = {"page_size": page, "imm": imm, **other}
            with pytest.raises(BoundsError, match=message):
                pair.engine.write_paged(pair.mr, src_pages, pair.descriptor, dst_pages, **args)
                pytest.fail(f"{wrong}: accepted")


def test_close_from_several_threads_while_others_write_and_read_stats_ends_cleanly(
    pair: EnginePair,
) -> None:
    # closed() is read by every call from any thread while another thread closes: each
    # caller gets a result or EngineError, every close() returns once the engine is shut,
    # and the process survives (two threads joining the worker at once would not).
    for round_ in range(5):
        engine = TransferEngine(**engine_options(pair.target.provider), bind_host=LOOPBACK)
        mr = engine.register(np.ones(64 * KIB, dtype=np.uint8))
        start = threading.Barrier(6)
        errors: list[BaseException] = []

        def closer() -> None:
            start.wait(WAIT_S)
            engine.close()

        def user() -> None:
            start.wait(WAIT_S)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                try:
                    engine.stats()
                    engine.engine_stats()
                    engine.write(mr, 0, pair.descriptor, 32 * KIB, 4 * KIB).wait(WAIT_S)
                except EngineError:
                    if engine.closed:
                        return
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

        threads = [threading.Thread(target=f) for f in [closer] * 3 + [user] * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), f"round {round_}: a thread hung"
        assert not errors, f"round {round_}: {errors!r}"
        assert engine.closed
    assert_still_delivers(pair)


def test_unknown_provider_raises_engine_error_listing_the_available_ones() -> None:
    with pytest.raises(EngineError) as refused:
        TransferEngine("no-such-fabric", bind_host=LOOPBACK)
    message = str(refused.value)
    assert "no-such-fabric" in message
    for name in available_providers():
        assert name in message


@pytest.mark.parametrize("rails", [0, -1, 1.5])
def test_rails_that_are_not_a_positive_integer_raise_engine_error(rails: Any) -> None:
    with pytest.raises(EngineError, match="rails must be a positive integer"):
        TransferEngine(PROVIDERS[0] if PROVIDERS else "auto", rails=rails, bind_host=LOOPBACK)


def test_registering_a_non_contiguous_read_only_or_empty_buffer_raises_bounds_error(
    pair: EnginePair,
) -> None:
    read_only = np.zeros(4 * KIB, dtype=np.uint8)
    read_only.flags.writeable = False
    refused = {
        "strided numpy": (np.zeros(8 * KIB, dtype=np.uint8)[::2], "C-contiguous"),
        "fortran-order numpy": (np.zeros((64, 64), dtype=np.uint8, order="F"), "C-contiguous"),
        "read-only numpy": (read_only, "writable"),
        "bytes": (b"immutable", "cannot register bytes"),
        "read-only memoryview": (memoryview(b"immutable"), "writable"),
        "strided memoryview": (memoryview(bytearray(64))[::2], "contiguous"),
        "empty bytearray": (bytearray(), "empty"),
        "a list": ([1, 2, 3], "cannot register list"),
    }
    registered = len(pair.engine._regions)
    for name, (buf, message) in refused.items():
        with pytest.raises(BoundsError, match=message):
            pair.engine.register(buf)
            pytest.fail(f"{name}: registered")
    assert len(pair.engine._regions) == registered
    assert_still_delivers(pair)


def test_writing_from_a_buffer_this_engine_has_not_registered_raises_engine_error(
    pair: EnginePair, provider: str
) -> None:
    imm = fresh_imm()
    dropped = pair.engine.register(np.zeros(4 * KIB, dtype=np.uint8))
    pair.engine.deregister(dropped)
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK) as other:
        elsewhere = other.register(np.zeros(4 * KIB, dtype=np.uint8))
        with NothingPosted(pair, imm):
            for source, message in [
                (np.zeros(4 * KIB, dtype=np.uint8), "must be a RegisteredMemory"),
                (dropped, "was deregistered"),
                (elsewhere, "registered with another engine"),
            ]:
                with pytest.raises(EngineError, match=message):
                    pair.engine.write(source, 0, pair.descriptor, 0, 64, imm)
                with pytest.raises(EngineError, match=message):
                    pair.engine.write_paged(source, [0], pair.descriptor, [0], 64, imm=imm)
    with pytest.raises(EngineError, match="not registered"):
        pair.engine.deregister(dropped)


# -- dead peers -------------------------------------------------------------------------


def succeeds_within(transfer: Any, timeout_s: float) -> bool:
    try:
        transfer.wait(timeout_s)
        return True
    except TransferError:
        return False


def assert_fails_within(transfer: Any, bound_s: float, started: float) -> None:
    """The engine itself failed `transfer` (TransferError or TransferTimeout) in time."""
    with pytest.raises(TransferError):
        transfer.wait(bound_s)
    assert transfer.done(), "the engine never failed the transfer; only the wait gave up"
    assert time.monotonic() - started <= bound_s


SHM_GONE_PEER_GAPS = {
    "live": "libfabric 1.17 shm: once a non-inject op (> 4 KiB) to a gone peer is outstanding, "
    "no later non-inject op of that endpoint completes, to any peer",
    "small": "libfabric 1.17 shm: an inject-sized op (<= 4 KiB) completes once copied into the "
    "gone peer's queue, so the engine reports success for data nobody received",
}


# -- caller-driven progress ----------------------------------------------------------------


def caller_engine(provider: str, **extra: Any) -> TransferEngine:
    """An engine without a progress thread: this test's thread drives it."""
    return TransferEngine(
        **engine_options(provider), bind_host=LOOPBACK, progress="caller", **extra
    )


def test_caller_driven_engine_writes_land_byte_for_byte_and_are_counted(
    pair: EnginePair, provider: str
) -> None:
    imm, page, count = fresh_imm(), 16 * KIB, 96
    data = seeded_bytes(61, 4 * MIB)
    with caller_engine(provider) as engine:
        mr = engine.register(data.copy())
        single = engine.write(mr, 0, pair.descriptor, 0, 2 * MIB, imm)
        src_pages = np.random.default_rng(62).permutation(4 * MIB // page)[:count]
        dst_pages = np.random.default_rng(63).permutation(count)
        paged = engine.write_paged(
            mr, src_pages, pair.descriptor, dst_pages, page, dst_offset=2 * MIB, imm=imm
        )
        # Many back-to-back small writes: each submit posts at once, waits drive the rest.
        small = [engine.write(mr, i * 4 * KIB, pair.descriptor, 4 * MIB + i * 4 * KIB, 4 * KIB)
                 for i in range(64)]
        for t in [single, paged, *small]:
            t.wait(WAIT_S)

    pair.wait_target_count(imm, 1 + count)
    expected = np.zeros(4 * MIB + 256 * KIB, dtype=np.uint8)
    expected[: 2 * MIB] = data[: 2 * MIB]
    for s_page, d_page in zip(src_pages, dst_pages):
        off = 2 * MIB + d_page * page
        expected[off : off + page] = data[s_page * page : (s_page + 1) * page]
    expected[4 * MIB : 4 * MIB + 256 * KIB] = data[: 256 * KIB]
    assert_same_bytes(pair.target_bytes(0, expected.size), expected, "caller-driven writes")


def test_caller_driven_engine_refuses_other_threads_and_asyncio_with_engine_error(
    pair: EnginePair, provider: str
) -> None:
    with caller_engine(provider) as engine:
        mr = engine.register(np.zeros(64 * KIB, dtype=np.uint8))
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                engine.write(mr, 0, pair.descriptor, 0, 4 * KIB).wait(WAIT_S)
            except BaseException as e:  # noqa: BLE001 - reported to the test thread
                errors.append(e)

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(WAIT_S)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], EngineError)
        assert "thread that created it" in str(errors[0])

        async def awaited() -> None:
            await engine.write(mr, 0, pair.descriptor, 0, 4 * KIB)

        with pytest.raises(EngineError, match="asyncio"):
            asyncio.run(asyncio.wait_for(awaited(), WAIT_S))
        # The owner still works after both refusals.
        engine.write(mr, 0, pair.descriptor, 0, 4 * KIB).wait(WAIT_S)


def test_caller_driven_waits_end_at_their_deadline_with_nothing_arriving(provider: str) -> None:
    with caller_engine(provider) as engine:
        started = time.monotonic()
        assert engine.recv(0.3) is None
        with pytest.raises(TransferTimeout):
            engine.wait_imm(fresh_imm(), 1, 0.3)
        elapsed = time.monotonic() - started
        assert 0.6 <= elapsed <= 0.6 + 5.0


def test_caller_driven_writes_to_a_gone_peer_fail_in_bounded_time(
    provider: str, peers: OwnPeers
) -> None:
    if not freezable(provider):
        pytest.skip("libfabric 1.17 shm wedges senders to dead peers (see the thread-mode test)")
    gone = peers.spare()
    with caller_engine(provider, transfer_timeout_s=DEAD_PEER_TIMEOUT_S) as engine:
        src = np.zeros(1 * MIB, dtype=np.uint8)
        mr = engine.register(src)
        engine.write(mr, 0, gone.descriptor, 0, 4 * KIB).wait(WAIT_S)
        descriptor = gone.descriptor
        gone.exit()
        started = time.monotonic()
        doomed = [engine.write(mr, 0, descriptor, 0, 1 * MIB) for _ in range(4)]
        for transfer in doomed:
            assert_fails_within(transfer, FAIL_BOUND_S, started)


def test_transfers_to_a_peer_that_is_gone_or_frozen_fail_in_bounded_time_and_others_still_work(
    pairs: PairPool, provider: str, peers: OwnPeers
) -> None:
    live = pairs.get(1)
    gone = peers.spare()
    frozen = peers.spare() if freezable(provider) else None
    imm, size = fresh_imm(), 64 * KIB
    quick = {"bind_host": LOOPBACK, "transfer_timeout_s": DEAD_PEER_TIMEOUT_S}
    options = {**engine_options(provider), **quick}
    with TransferEngine(**options) as engine, TransferEngine(**options) as stranger:
        src = np.zeros(1 * MIB, dtype=np.uint8)
        src[:] = seeded_bytes(47, src.size)
        mr = engine.register(src)
        stranger_mr = stranger.register(np.zeros(1 * MIB, dtype=np.uint8))
        # `engine` talks to the peers first; `stranger` tries only once the peer is gone.
        for peer in [gone] + ([frozen] if frozen else []):
            engine.write(mr, 0, peer.descriptor, 0, 4 * KIB, imm).wait(WAIT_S)
            peer.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)
        descriptor, address = gone.descriptor, gone.address
        gone.exit()
        if frozen:
            frozen.proc.send_signal(signal.SIGSTOP)

        started = time.monotonic()
        # Writes the peer must take part in: larger than any provider buffers locally.
        doomed = [
            engine.write(mr, 0, descriptor, 0, size, imm),
            engine.write_paged(mr, [0, 2], descriptor, [1, 3], size, imm=imm),
            stranger.write(stranger_mr, 0, descriptor, 0, size, imm),
        ]
        # Far more than the engine keeps in flight per rail: once socket buffers are full,
        # the frozen peer holds every slot, which the engine must hand back as these expire.
        stalled = [
            engine.write(mr, 0, frozen.descriptor, 0, size, imm)
            for _ in range(3 * MAX_INFLIGHT_PER_RAIL if frozen else 0)
        ]
        small = [
            engine.write(mr, 0, descriptor, 0, 64, imm),
            engine.write_imm(address, imm),
            engine.send(address, b"anyone there?"),
        ]

        async def awaited() -> None:
            with pytest.raises(TransferError):
                await engine.write(mr, 0, descriptor, 0, size, imm)

        asyncio.run(asyncio.wait_for(awaited(), FAIL_BOUND_S + 5))
        for transfer in doomed:
            assert_fails_within(transfer, FAIL_BOUND_S, started)
        # What the kernel buffered before the freeze may have completed; the rest failed.
        failed = sum(not succeeds_within(t, FAIL_BOUND_S) for t in stalled)
        assert all(t.done() for t in stalled) and time.monotonic() - started <= FAIL_BOUND_S
        assert failed >= (MAX_INFLIGHT_PER_RAIL if frozen else 0)

        live_imm = fresh_imm()
        to_live = engine.write(mr, 0, live.descriptor, 5 * KIB, src.size, live_imm)
        gaps = []
        if not succeeds_within(to_live, WAIT_S):
            gaps.append("live")
        if any(succeeds_within(t, FAIL_BOUND_S) for t in small):
            gaps.append("small")
        if provider == "shm" and gaps:
            pytest.xfail("; ".join(SHM_GONE_PEER_GAPS[g] for g in gaps))

        # The same engine still serves a live peer...
        to_live.wait(0)
        live.wait_target_count(live_imm, 1)
        assert_same_bytes(live.target_bytes(5 * KIB, src.size), src, "write to the live peer")
        # ...and even a message or an immediate alone to the gone peer fails.
        for transfer in small:
            assert_fails_within(transfer, FAIL_BOUND_S, started)


def test_peer_killed_mid_stream_fails_pending_writes_in_bounded_time_and_a_new_target_gets_data(
    provider: str, peers: OwnPeers, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if provider == "shm":
        # Passes in most runs; these upstream limits make some runs fail.
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "libfabric 1.17 shm: a peer SIGKILLed while holding its region spinlock makes the "
            "next fi_writemsg to it spin forever in the initiator's progress thread, so no "
            "deadline fires (seen in 2 of 6 probes with 4 MiB writes); and a non-inject op left "
            "outstanding to the dead peer can block every later one of the endpoint"
        )))
    size, seed, imm = SPARE_BYTES, 53, fresh_imm()
    # The initiator is a process too (its transfer_timeout_s is DEAD_PEER_TIMEOUT_S): a
    # wedged engine must not take pytest down with it.
    initiator, doomed = peers.spare(), peers.spare()
    initiator.call("fill", seed=seed)
    # 1 GiB in 1 MiB writes: far more than loopback moves before the kill lands. Only what
    # moved before the kill costs CPU; the rest fails.
    stream = initiator.call(
        "stream", descriptor=doomed.descriptor.hex(), count=1024, length=size, wait_first=2
    )
    assert stream["done"] < stream["submitted"], "the stream finished before the kill"

    doomed.kill()
    killed = time.monotonic()
    successor = peers.start()  # starts while the writes fail
    settled = initiator.call(
        "settle", timeout=FAIL_BOUND_S, reply_timeout=FAIL_BOUND_S + REPLY_TIMEOUT_S
    )
    elapsed = time.monotonic() - killed

    outcomes = settled["outcomes"]
    assert outcomes.get("pending", 0) == 0, f"still pending {FAIL_BOUND_S} s after: {settled}"
    assert set(outcomes) <= {"ok", "TransferError", "TransferTimeout"}, settled
    assert outcomes.get("TransferError", 0) + outcomes.get("TransferTimeout", 0) >= 1, settled
    assert elapsed <= FAIL_BOUND_S + 2.0, settled

    initiator.call(
        "write", descriptor=successor.descriptor.hex(), src_offset=0, dst_offset=0,
        length=size, imm=imm,
    )
    successor.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)
    dump = tmp_path / "successor.bin"
    successor.call("dump", path=str(dump))
    landed = np.fromfile(dump, dtype=np.uint8)
    assert_same_bytes(landed, seeded_bytes(seed, size), "successor's region")
