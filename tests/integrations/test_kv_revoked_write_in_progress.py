"""A fabric write already under way when the decoder revokes its registration keeps landing:
what `dead_prefiller_fence_s` has to cover before a dead prefiller's blocks are freed.

The decoder's dead-prefiller path revokes a load's registration (`MemoryWindows.close`, on
the engine's progress thread) and frees its blocks `dead_prefiller_fence_s` later. The
net provider checks a write's key once, when the op's header arrives, and then copies the
op's payload into the target as it comes off the socket: closing the registration, or
forgetting the writer (fi_av_remove; net 1.17 tears no connection down for it), does not
stop the op in progress. The next op's header is refused and the connection is cut, so
what can land after the revoke is the rest of one op (at most the engine's 4 MiB coalesced
op), and only as fast as the link delivers it: from a killed writer, the bytes its kernel
still holds, sent by the kernel after the process is gone.

Severing the writer's connection after the revoke (`TransferEngine.sever_peer`, on the
progress thread) stops that op too: nothing lands after the sever returns, from a killed
writer or a frozen one woken after it. The sever proves that only over a connection the
receiver opened (the connector's decoder opens it with its reservation); one the writer
opened cannot be told from another process's on its host, and is left alone.

Both processes run in a network namespace of this module's own whose loopback is cut to
LINK_RATE (tc tbf), as a real link between two hosts is slower than loopback: the receiver
is this test process (its engine made inside the namespace), the writer a subprocess that
posts one paged write. Needs root and iproute2 (tc).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from support.pod_namespaces import IP, NS_PREFIX, can_run_pods, sweep_leftover_namespaces

from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.transfer.engine import TransferEngine, available_providers

PROVIDER = "net"
#: A link much slower than loopback, still faster than the 1 Gbit/s the fence is sized for
#: at its slowest (settings.py, dead_prefiller_fence_s).
LINK_RATE = "200mbit"
MIB = 1 << 20
#: The engine's largest fabric op (PlannerSettings.max_coalesce_bytes): a paged write with
#: an immediate coalesces contiguous pages up to it.
OP_BYTES = 4 * MIB
PAGE = 64 * 1024
REGION_BYTES = 8 * OP_BYTES
#: Byte the writer's source holds everywhere (the receiver's region starts zeroed), so the
#: landed prefix is the count of non-zero bytes: one rail, one connection, ops in order.
FILL = 0xA5
IMM = 7
STARTUP_DEADLINE_S = 30.0
#: The writer's bytes are taken as over once the count stayed put this long...
QUIET_S = 0.5
#: ...looked for at most this long after the revoke.
SETTLE_DEADLINE_S = 10.0
#: How long a stopped writer's kernel is given to hand over what it holds before the revoke.
STOPPED_DRAIN_QUIET_S = 0.3
STOP_TRIES = 5
TC = shutil.which("tc") or "/usr/sbin/tc"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_NAMESPACES = can_run_pods()

pytestmark = [
    pytest.mark.skipif(PROVIDER not in available_providers(), reason="libfabric net provider missing"),
    pytest.mark.skipif(_NAMESPACES is not None, reason=f"network namespaces: {_NAMESPACES}"),
    pytest.mark.skipif(not os.path.exists(TC), reason=f"missing tool {TC} (iproute2)"),
]

_WRITER = f"""
import sys
import numpy as np
from kvxfer.transfer.engine import TransferEngine
engine = TransferEngine({PROVIDER!r}, same_host=False, bind_host="127.0.0.1", transfer_timeout_s=60)
source = np.full({REGION_BYTES}, {FILL}, np.uint8)
memory = engine.register(source)
print(engine.address.hex(), flush=True)
line = sys.stdin.readline().strip()
# "message": the descriptor comes as the receiver's first message, over a connection the
# receiver opens (the connector's reservation); otherwise it is the line itself.
descriptor = engine.recv({STARTUP_DEADLINE_S}) if line == "message" else bytes.fromhex(line)
assert descriptor, "no reservation message"
pages = list(range({REGION_BYTES // PAGE}))
engine.write_paged(memory, pages, descriptor, pages, {PAGE}, imm={IMM}).wait(60)
"""


def _ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, timeout=STARTUP_DEADLINE_S)


def _enter(ns_path: str) -> None:
    fd = os.open(ns_path, os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {ns_path}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def _inside(ns: str) -> Iterator[None]:
    """The calling thread (and threads and processes it starts meanwhile) in `ns`."""
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _enter(f"/run/netns/{ns}")
        try:
            yield
        finally:
            if _libc.setns(back, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(back)


@pytest.fixture(scope="module")
def slow_link() -> Iterator[str]:
    """A network namespace whose loopback carries LINK_RATE (named for the pod sweep)."""
    sweep_leftover_namespaces()
    ns = f"{NS_PREFIX}{os.getpid()}-slowlink"
    _ip("netns", "add", ns)
    try:
        _ip("netns", "exec", ns, IP, "link", "set", "lo", "up", "mtu", "9000")
        # burst above the MTU (tbf drops a packet larger than it); latency bounds its queue.
        _ip("netns", "exec", ns, TC, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", LINK_RATE,
            "burst", "1mb", "latency", "100ms")
        yield ns
    finally:
        subprocess.run([IP, "netns", "del", ns], check=False, capture_output=True, timeout=STARTUP_DEADLINE_S)


@pytest.fixture(scope="module")
def receiver(slow_link: str) -> Iterator[TransferEngine]:
    """The decoder's engine, its sockets in the slow namespace."""
    with _inside(slow_link):
        engine = TransferEngine(PROVIDER, same_host=False, bind_host="127.0.0.1")
    try:
        yield engine
    finally:
        engine.close()


class WriteUnderWay:
    """A writer process posting one paged write over the slow link into a fresh zeroed
    region of `receiver`, registered as one MemoryWindows (per_reservation style). With
    `receiver_opens` the receiver sends the descriptor as its first message, so the one
    connection between the two is the receiver's, as the connector's decoder opens it with
    its reservation; otherwise the writer opens it with its first op."""

    def __init__(self, receiver: TransferEngine, ns: str, receiver_opens: bool = False) -> None:
        self.target = np.zeros(REGION_BYTES, np.uint8)
        self.region = receiver.register(self.target)
        self.windows = receiver.register_windows(self.region, [(0, REGION_BYTES)])
        with _inside(ns):
            self.proc = subprocess.Popen([sys.executable, "-c", _WRITER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: it prints or dies (then EOF)
        assert line, "the writer process died before printing its address"
        self.address = bytes.fromhex(line.strip())
        self.proc.stdin.write("message\n" if receiver_opens else self.windows.descriptor.hex() + "\n")
        self.proc.stdin.flush()
        if receiver_opens:
            receiver.send(self.address, self.windows.descriptor).wait(STARTUP_DEADLINE_S)

    def landed(self) -> int:
        return int(np.count_nonzero(self.target))

    def wait_first_bytes(self) -> None:
        end = time.monotonic() + STARTUP_DEADLINE_S
        while not self.target[:4096].any():
            assert time.monotonic() < end, "no byte of the write landed"
            time.sleep(0.0005)

    def settle(self, quiet_s: float) -> int:
        """The landed count once it stayed put for `quiet_s` (bounded by SETTLE_DEADLINE_S)."""
        end = time.monotonic() + SETTLE_DEADLINE_S
        last, since = self.landed(), time.monotonic()
        while time.monotonic() - since < quiet_s and time.monotonic() < end:
            time.sleep(0.005)
            now = self.landed()
            if now != last:
                last, since = now, time.monotonic()
        return last

    def close(self, receiver: TransferEngine) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=STARTUP_DEADLINE_S)
        self.windows.close()
        receiver.deregister(self.region)


@pytest.fixture
def write(receiver: TransferEngine, slow_link: str) -> Iterator[WriteUnderWay]:
    """A write under way from a writer process of this test's own (killed at the end)."""
    under_way = WriteUnderWay(receiver, slow_link)
    try:
        yield under_way
    finally:
        under_way.close(receiver)


@pytest.fixture
def reserved_write(receiver: TransferEngine, slow_link: str) -> Iterator[WriteUnderWay]:
    """A write under way over the connection the receiver opened (its reservation message),
    from a writer process of this test's own (killed at the end)."""
    under_way = WriteUnderWay(receiver, slow_link, receiver_opens=True)
    try:
        yield under_way
    finally:
        under_way.close(receiver)


def test_a_killed_writers_bytes_stop_landing_within_the_dead_prefiller_fence(
        write: WriteUnderWay, record_property: pytest.RecordProperty) -> None:
    # The decoder's dead-prefiller path at its fastest: the writer is SIGKILLed mid-op and
    # the registration revoked at once; the blocks are free dead_prefiller_fence_s later.
    fence_s = ConnectorSettings().dead_prefiller_fence_s
    write.wait_first_bytes()
    write.proc.kill()
    at_revoke = write.landed()
    write.windows.close()
    time.sleep(fence_s)
    at_free = write.landed()
    final = write.settle(QUIET_S)
    record_property("bytes_after_revoke", final - at_revoke)
    assert final == at_free, (
        f"{final - at_free} bytes of the killed writer's op landed after the blocks were freed "
        f"(dead_prefiller_fence_s={fence_s}; {final - at_revoke} after the revoke, over {LINK_RATE})")
    assert final < REGION_BYTES, "the write finished before the kill: nothing was checked"


def _stopped_mid_op(write: WriteUnderWay) -> int:
    """SIGSTOPs the writer, lets its kernel hand over what it holds, and returns the landed
    count, retried (SIGCONT, a moment, SIGSTOP) while that falls on an op boundary."""
    for _ in range(STOP_TRIES):
        write.proc.send_signal(signal.SIGSTOP)
        landed = write.settle(STOPPED_DRAIN_QUIET_S)
        if landed % OP_BYTES:
            return landed
        write.proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    pytest.fail(f"the writer stopped on an op boundary {STOP_TRIES} times")


def test_the_op_in_progress_at_the_revoke_lands_in_full_even_after_forget_and_no_other(
        receiver: TransferEngine, write: WriteUnderWay, record_property: pytest.RecordProperty) -> None:
    # A frozen writer woken after the revoke: the header of the op it was sending had been
    # checked, so the op's remaining bytes land (revoke and forget do not stop it); the next
    # op's header is refused and the connection cut, so nothing after that op lands.
    write.wait_first_bytes()
    at_revoke = _stopped_mid_op(write)
    write.windows.close()
    receiver.forget(write.address)
    write.proc.send_signal(signal.SIGCONT)
    final = write.settle(QUIET_S)
    record_property("bytes_after_revoke", final - at_revoke)
    op_end = (at_revoke // OP_BYTES + 1) * OP_BYTES
    assert final == op_end, (f"landed {at_revoke} at the revoke, {final} in the end: expected the op in "
                             f"progress to finish at {op_end} and nothing after it")
    assert write.proc.wait(timeout=STARTUP_DEADLINE_S) != 0, "the refused op did not fail at the writer"


def test_a_killed_writers_op_lands_no_byte_after_revoke_and_sever(
        reserved_write: WriteUnderWay, receiver: TransferEngine, record_property: pytest.RecordProperty) -> None:
    # The decoder's dead-prefiller path: the writer is SIGKILLed mid-op (its kernel still
    # sends what it held), the registration revoked, then its connection severed on the
    # progress thread. What landed when the sever returned is all that ever lands.
    write = reserved_write
    write.wait_first_bytes()
    write.proc.kill()
    write.windows.close()
    proven = receiver.sever_peer(write.address)
    at_sever = write.landed()
    final = write.settle(QUIET_S)
    record_property("bytes_after_sever", final - at_sever)
    assert proven, "the receiver's connection to the writer was not found"
    assert final == at_sever, f"{final - at_sever} bytes of the killed writer's op landed after the sever"
    assert final < REGION_BYTES, "the write finished before the kill: nothing was checked"


def test_a_stopped_writer_woken_after_revoke_and_sever_lands_nothing_more_and_fails(
        reserved_write: WriteUnderWay, receiver: TransferEngine) -> None:
    # A writer frozen mid-op (declared gone) that wakes after the sever: the rest of the op
    # it was sending does not land (without the sever it lands in full, test above), and
    # its transfer fails.
    write = reserved_write
    write.wait_first_bytes()
    _stopped_mid_op(write)
    write.windows.close()
    assert receiver.sever_peer(write.address)
    at_sever = write.landed()
    write.proc.send_signal(signal.SIGCONT)
    final = write.settle(QUIET_S)
    assert final == at_sever, f"{final - at_sever} bytes landed after the sever, from the woken writer"
    assert write.proc.wait(timeout=STARTUP_DEADLINE_S) != 0, "the writer's transfer did not fail"


def test_severing_a_peer_without_a_connection_of_ours_proves_nothing_and_cuts_no_other(
        write: WriteUnderWay, receiver: TransferEngine, slow_link: str) -> None:
    # `write`'s writer opened its connection (an ephemeral port on its side, not its
    # address), and a stranger engine never talked to the receiver: neither sever finds a
    # connection, and the write under way keeps landing over its connection to the end.
    with _inside(slow_link):
        stranger = TransferEngine(PROVIDER, same_host=False, bind_host="127.0.0.1")
    try:
        write.wait_first_bytes()
        assert not receiver.sever_peer(stranger.address)
        assert not receiver.sever_peer(write.address)
        assert write.proc.wait(timeout=STARTUP_DEADLINE_S) == 0, "the live writer's transfer failed"
        assert write.landed() == REGION_BYTES
    finally:
        stranger.close()
