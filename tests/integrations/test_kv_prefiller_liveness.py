"""A decode worker half notices its prefiller's death through the prefiller's liveness port
(prefiller_liveness.py), not through the probes: the kernel closes a killed process's
connection at once. A frozen prefiller keeps it open, so it is not declared gone that way;
an address that gives no signal leaves the probes in charge; a flood of connections to the
port is bounded and the port keeps serving. The prefiller is a real process holding a real
engine and a liveness listener; the decoder is the connector's `KVReceiver` over a
vLLM-laid-out cache, polled as vLLM's worker would.

Once gone, a prefiller's loads are freed at once where the decoder severed its connections
after revoking their registrations (TransferEngine.sever_peer) and that proves no byte of it
can land any more, and keep `dead_prefiller_fence_s` where the sever proves nothing. What a
sever stops on the wire is measured in test_kv_revoked_write_in_progress.py.

A same-host prefiller writes by memcpy, with no socket to sever: its loads are freed at once
only once every thread of its process is exiting or gone (TransferEngine.
same_host_writes_ended); alive, or frozen mid-copy, it keeps the fence, and once proven
nothing of its copy lands any more."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.connector_halves import decode_half  # noqa: E402
from support.late_probes import hold_back_probes, watch_severs  # noqa: E402
from support.silent_prefiller import SilentPrefiller  # noqa: E402
from support.vllm_kv_caches import attention_spec, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer import SharedBuffer  # noqa: E402
from kvxfer.handoff.decode_ledger import DeadlineSetting  # noqa: E402
from kvxfer.handoff.reservation_state import ReservationState as Res  # noqa: E402
from kvxfer.integrations.vllm.kv_receiver import DecodeLoad, KVReceiver  # noqa: E402
from kvxfer.integrations.vllm.metadata import LoadSpec  # noqa: E402
from kvxfer.integrations.vllm.prefiller_liveness import HELD, LivenessWatch  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
#: Probes so late that within a test only the liveness connection can free a load.
PROBES_OUT_OF_REACH_S = 60.0
#: A fence far beyond REPORTED_WITHIN_S: a load reported within it was not freed by the timer.
FENCE_OUT_OF_REACH_S = 60.0
#: A fence the unproven-sever test does not see end: shorter than fence_timeout_s
#: (writer_gone only shortens a fence), far beyond the few polls that test makes after the death.
UNPROVEN_FENCE_S = 5.0
#: Bounds of the waits below (generous: the machine is shared); none is a speed assertion.
REPORTED_WITHIN_S = 10.0
FROZEN_WATCH_S = 2.0
#: How long a load is watched while its probes are held back: several probe timeouts.
LATE_PROBES_WATCH_S = 1.0
STARTUP_DEADLINE_S = 30.0
#: An idle wait no test sees end on its own, and the kill during it; and one watched whole.
IDLE_WAIT_OUT_OF_REACH_MS, KILL_DURING_WAIT_AFTER_S = 30_000.0, 0.3
IDLE_WAIT_WATCHED_MS = 300.0
#: The flooded listener's bound, and the connections the flood opens.
MAX_HELD, FLOOD = 8, 200

@pytest.fixture
def prefiller() -> Iterator[SilentPrefiller]:
    pf = SilentPrefiller(PROVIDER, liveness_max_held=MAX_HELD, wait_s=STARTUP_DEADLINE_S)
    try:
        yield pf
    finally:
        pf.stop()


def _poll_until_writer_gone(receiver: KVReceiver, request: str, not_freed_because: str) -> DecodeLoad:
    """Polls `receiver` until its load `request` notes its writer gone or REPORTED_WITHIN_S
    passes, asserting on every poll that the load was not freed (`not_freed_because` says
    why it must not be); the load, for the caller's assertions."""
    load = receiver._loads[request][0]
    end = time.monotonic() + REPORTED_WITHIN_S
    while not (load.entry is not None and load.entry.writer_gone) and time.monotonic() < end:
        finished, _ = receiver.poll(set())
        assert request not in finished, not_freed_because
        time.sleep(0.002)
    return load


def _reserve(engine: TransferEngine, address: bytes, liveness: str, settings: ConnectorSettings,
             tid: str) -> KVReceiver:
    """A receiver with one load reserved at `address`, once the reservation was delivered
    and the liveness watch settled (held, or no signal)."""
    cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), 8, seed=7)
    receiver = decode_half(engine, cache.region, settings, staged=False)
    receiver.start(LoadSpec(f"d-{tid}", tid, address, [1, 2, 3], 0, prefill_liveness=liveness))
    end = time.monotonic() + STARTUP_DEADLINE_S
    load = receiver._loads[f"d-{tid}"][0]
    while (load.sent is not None or receiver._liveness.phase(liveness) in ("connecting", "awaiting_held")) \
            and time.monotonic() < end:
        receiver.poll(set())
        time.sleep(0.005)
    assert load.sent is None and not receiver.failure(f"d-{tid}"), "the reservation was not delivered"
    return receiver


def _poll_until_finished(receiver: KVReceiver, request: str, within_s: float) -> set[str]:
    """Polls as vLLM's worker does until `request` is reported or `within_s` passes: the
    failed set it was reported with plus "finished", empty if it was not reported."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        finished, failed = receiver.poll(set())
        if request in finished:
            return failed | {"finished"}
        time.sleep(0.002)
    return set()


def _fenced_because(caplog: pytest.LogCaptureFixture, transfer_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if f"transfer {transfer_id} " in r.getMessage() and "prefiller process is gone" in r.getMessage()]


@pytest.mark.parametrize("killed", ["group", "process"])
def test_a_killed_prefillers_load_is_freed_by_its_liveness_connection(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture, killed: str) -> None:
    # "group": the keeper dies with it; "process": the keeper outlives it until its pipe closes.
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S)
    receiver = _reserve(decoder_engine, prefiller.address, prefiller.liveness, settings, killed)
    assert receiver._liveness.phase(prefiller.liveness) == "held"
    caplog.set_level(logging.INFO, logger="kvxfer")
    if killed == "group":
        prefiller.signal_group(signal.SIGKILL)
    else:
        prefiller.proc.kill()
    prefiller.proc.wait(timeout=STARTUP_DEADLINE_S)
    reported = _poll_until_finished(receiver, f"d-{killed}", REPORTED_WITHIN_S)
    assert reported == {"finished", f"d-{killed}"}, "not reported failed (the probes were out of reach)"
    assert receiver.pending == 0  # reported, so vLLM frees its blocks
    why = _fenced_because(caplog, killed)
    assert why and "its liveness connection was" in why[0], why
    assert any("dead_prefiller_fence_s" in r.getMessage() for r in caplog.records)  # the short fence, not 15 s


def test_a_killed_prefillers_load_is_freed_without_the_fence_once_no_connection_of_it_is_left(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture) -> None:
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 dead_prefiller_fence_s=FENCE_OUT_OF_REACH_S)
    # The reservation is the first message between the two: the connection is ours to sever.
    receiver = _reserve(decoder_engine, prefiller.address, prefiller.liveness, settings, "severed")
    assert receiver._liveness.phase(prefiller.liveness) == "held"
    caplog.set_level(logging.INFO, logger="kvxfer")
    prefiller.signal_group(signal.SIGKILL)
    prefiller.proc.wait(timeout=STARTUP_DEADLINE_S)
    reported = _poll_until_finished(receiver, "d-severed", REPORTED_WITHIN_S)
    assert reported, "not freed: the fence timer was kept"
    freed = [r.getMessage() for r in caplog.records
             if "(request d-severed)" in r.getMessage() and "prefiller process is gone" in r.getMessage()]
    assert freed and "no connection of it is left open after the revoke" in freed[-1], freed
    assert receiver.pending == 0


def _idle_wait(engine: TransferEngine, prefiller: SilentPrefiller, idle_wait_ms: float, tid: str,
               before: Callable[[], None]) -> tuple[KVReceiver, float]:
    """A receiver with one load reserved at `prefiller` (its liveness connection held), and
    how long one idle wait of `idle_wait_ms` lasted, `before` called right before it."""
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 idle_wait_ms=idle_wait_ms)
    receiver = _reserve(engine, prefiller.address, prefiller.liveness, settings, tid)
    assert receiver._liveness.phase(prefiller.liveness) == "held"
    before()
    started = time.monotonic()
    receiver.wait_briefly()
    return receiver, time.monotonic() - started


def test_a_killed_prefillers_close_ends_the_idle_wait_and_its_load_fails_in_the_poll_after(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller) -> None:
    # vLLM calls wait_briefly, then poll, on every empty step: a close noticed only at the
    # end of the wait would hold the killed prefiller's blocks that long and a step more.
    killer = threading.Timer(KILL_DURING_WAIT_AFTER_S, prefiller.signal_group, (signal.SIGKILL,))
    receiver, waited_s = _idle_wait(decoder_engine, prefiller, IDLE_WAIT_OUT_OF_REACH_MS, "waiting", killer.start)
    killer.join()
    assert waited_s < IDLE_WAIT_OUT_OF_REACH_MS / 1000 / 2, f"the wait ran {waited_s:.1f} s: the close did not end it"
    finished, failed = receiver.poll(set())
    assert "d-waiting" in finished and "d-waiting" in failed
    prefiller.proc.wait(timeout=STARTUP_DEADLINE_S)


def test_a_held_liveness_connection_does_not_cut_the_idle_wait_short(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, monkeypatch: pytest.MonkeyPatch) -> None:
    # Watching the connection must not end the wait: a live prefiller's decoder still waits
    # idle_wait_ms for its load (no busy empty steps), and in one blocking wait, not woken
    # up now and then to look (each wake-up costs a shared core a context switch).
    waits: list[float] = []
    wait_imm_any = decoder_engine.wait_imm_any

    def counted(wanted: Any, timeout: float, watched_fds: Any = ()) -> int | None:
        waits.append(timeout)
        return wait_imm_any(wanted, timeout, watched_fds)

    monkeypatch.setattr(decoder_engine, "wait_imm_any", counted)
    receiver, waited_s = _idle_wait(decoder_engine, prefiller, IDLE_WAIT_WATCHED_MS, "alive", lambda: None)
    assert waited_s >= IDLE_WAIT_WATCHED_MS / 1000 * 0.95
    assert len(waits) == 1, f"{len(waits)} waits in one idle wait"
    assert "d-alive" not in receiver.poll(set())[0]


def test_a_prefiller_whose_sever_proves_nothing_keeps_the_fence(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The sever proves nothing (a connection the prefiller opened, a reset one with unread
    # bytes, a same-host peer: test_kv_revoked_write_in_progress.py and the C++ tests): the
    # load is fenced for dead_prefiller_fence_s, not freed.
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 dead_prefiller_fence_s=UNPROVEN_FENCE_S)
    receiver = _reserve(decoder_engine, prefiller.address, prefiller.liveness, settings, "unproven")
    assert receiver._liveness.phase(prefiller.liveness) == "held"
    monkeypatch.setattr(decoder_engine, "sever_peer", lambda address: False)
    caplog.set_level(logging.INFO, logger="kvxfer")
    prefiller.signal_group(signal.SIGKILL)
    prefiller.proc.wait(timeout=STARTUP_DEADLINE_S)
    load = _poll_until_writer_gone(receiver, "d-unproven", "freed although the sever proved nothing")
    assert load.entry is not None and load.entry.writer_gone, "the prefiller's death was not noticed"
    assert (load.state, load.entry.deadline_setting, load.writer_severed) == \
        (Res.FENCED, DeadlineSetting.WRITER_GONE, False)
    finished, _ = receiver.poll(set())
    assert "d-unproven" not in finished


def test_a_frozen_prefiller_is_not_declared_gone_by_its_liveness_connection(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture) -> None:
    address, liveness = prefiller.address, prefiller.liveness
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 load_stall_timeout_s=0.5)
    receiver = _reserve(decoder_engine, address, liveness, settings, "frozen")
    caplog.set_level(logging.INFO, logger="kvxfer")
    prefiller.signal_group(signal.SIGSTOP)  # its keeper too
    reported = _poll_until_finished(receiver, "d-frozen", FROZEN_WATCH_S)
    assert not reported, "a frozen (live) prefiller's load was freed before fence_timeout_s"
    assert "load_stall_timeout_s" in receiver.failure("d-frozen")  # fencing for its stall, nothing else
    assert receiver._liveness.phase(liveness) == "held"
    assert not _fenced_because(caplog, "frozen")


def test_a_late_probe_of_a_prefiller_whose_liveness_connection_is_held_fails_nothing_and_its_kill_frees_at_once(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Probes soon, every one held back (a starved host): the held liveness connection says
    # the prefiller is alive, so no late probe fails its silent load, and none severs.
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=0.1, prefiller_probe_timeout_s=0.2,
                                 dead_prefiller_fence_s=FENCE_OUT_OF_REACH_S)
    receiver = _reserve(decoder_engine, prefiller.address, prefiller.liveness, settings, "late")
    assert receiver._liveness.phase(prefiller.liveness) == "held"
    probes_held = hold_back_probes(decoder_engine, monkeypatch)
    severed = watch_severs(decoder_engine, monkeypatch)
    reported = _poll_until_finished(receiver, "d-late", LATE_PROBES_WATCH_S)
    assert not reported and not receiver.failure("d-late"), receiver.failure("d-late")
    assert probes_held and time.monotonic() - probes_held[0] > 2 * settings.prefiller_probe_timeout_s
    assert severed == []
    # Killed, it is still gone in milliseconds (its liveness connection), and freed at once (severed).
    caplog.set_level(logging.INFO, logger="kvxfer")
    prefiller.signal_group(signal.SIGKILL)
    prefiller.proc.wait(timeout=STARTUP_DEADLINE_S)
    reported = _poll_until_finished(receiver, "d-late", REPORTED_WITHIN_S)
    assert reported == {"finished", "d-late"}
    assert severed == [prefiller.address]
    freed = [r.getMessage() for r in caplog.records if "(request d-late)" in r.getMessage()]
    assert freed and "its liveness connection was" in freed[-1] and "no byte of it can land" in freed[-1], freed


def test_a_liveness_address_without_a_signal_leaves_the_probes_in_charge(
        decoder_engine: TransferEngine, prefiller: SilentPrefiller, caplog: pytest.LogCaptureFixture) -> None:
    proc, address = prefiller.proc, prefiller.address
    # A port whose connections the kernel completes but nobody accepts: no HELD byte comes.
    mute = socket.create_server(("127.0.0.1", 0), backlog=4)
    try:
        mute_address = f"127.0.0.1:{mute.getsockname()[1]}"
        # The probe's timeout without a proof fails the load with the regular fence (short here).
        settings = ConnectorSettings(provider=PROVIDER, liveness_connect_timeout_s=0.2,
                                     prefiller_probe_after_s=0.2, prefiller_probe_timeout_s=0.5,
                                     transfer_timeout_s=0.5, fence_timeout_s=1.5)
        receiver = _reserve(decoder_engine, address, mute_address, settings, "mute")
        assert receiver._liveness.phase(mute_address) == "no_signal"
        caplog.set_level(logging.INFO, logger="kvxfer")
        proc.kill()
        proc.wait(timeout=STARTUP_DEADLINE_S)
        reported = _poll_until_finished(receiver, "d-mute", REPORTED_WITHIN_S)
    finally:
        mute.close()
    assert reported == {"finished", "d-mute"}
    why = [r.getMessage() for r in caplog.records if "transfer mute " in r.getMessage()]
    assert why and "prefiller_probe_timeout_s" in why[0], why


def test_a_malformed_liveness_address_gives_no_signal() -> None:
    watch = LivenessWatch(connect_timeout_s=0.2)
    for address in ("not-an-address", "127.0.0.1:0", "example.invalid:80", "127.0.0.1:99999"):
        watch.watch(address)
        assert watch.phase(address) == "no_signal", address
    assert watch.poll() == {}


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _held_byte(sock: socket.socket, within_s: float) -> bytes | None:
    """The first byte the listener sent (b"": closed without one; None: nothing yet)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1)
    except TimeoutError:
        return None
    except OSError:
        return b""


def test_a_flood_of_connections_to_the_liveness_port_is_bounded_and_the_port_keeps_serving(
        prefiller: SilentPrefiller) -> None:
    proc, liveness, keeper = prefiller.proc, prefiller.liveness, prefiller.keeper_pid
    host, port = liveness.rsplit(":", 1)
    assert _held_again(liveness)  # the keeper serves: its descriptors are all open
    fds_before = _open_fds(keeper)
    flood = [socket.create_connection((host, int(port)), timeout=STARTUP_DEADLINE_S) for _ in range(FLOOD)]
    try:
        first = [_held_byte(s, STARTUP_DEADLINE_S) for s in flood]
        assert first.count(HELD) == MAX_HELD  # the rest were closed at once, without it
        assert first.count(b"") == FLOOD - MAX_HELD
        assert _open_fds(keeper) <= fds_before + MAX_HELD
        for sock in flood[:MAX_HELD]:
            sock.sendall(b"x" * 65536)  # input is never read beyond noticing a close
    finally:
        for sock in flood:
            sock.close()
    # Their closes free the slots: a decoder's watch is held again.
    assert _held_again(liveness)
    assert proc.poll() is None


def _held_again(liveness: str) -> bool:
    """Whether a new watch of `liveness` is held within REPORTED_WITHIN_S (watching again
    while the port is full or has no keeper)."""
    watch = LivenessWatch(connect_timeout_s=0.5)
    end = time.monotonic() + REPORTED_WITHIN_S
    watch.watch(liveness)
    while watch.phase(liveness) != "held" and time.monotonic() < end:
        if watch.phase(liveness) == "no_signal":
            watch.keep(set())
            watch.watch(liveness)
        watch.poll()
        time.sleep(0.01)
    held = watch.phase(liveness) == "held"
    watch.close()
    return held


def test_a_keeper_killed_alone_is_started_again_on_the_same_port(prefiller: SilentPrefiller) -> None:
    os.kill(prefiller.keeper_pid, signal.SIGKILL)
    assert _held_again(prefiller.liveness)
    assert prefiller.proc.poll() is None


def test_the_keeper_runs_the_standard_library_only_one_thread_no_package_library(prefiller: SilentPrefiller) -> None:
    """Killed, the keeper closes its connections once its threads exited and its address
    space is gone: the kvxfer package (numpy's BLAS threads, the engine's libraries) made
    that a median 6 ms instead of under 1 ms."""
    assert _held_again(prefiller.liveness)  # the keeper serves: everything it imports is loaded
    with open(f"/proc/{prefiller.keeper_pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    with open(f"/proc/{prefiller.keeper_pid}/maps") as f:
        libraries = {line.split()[-1] for line in f if ".so" in line}
    assert threads == 1
    assert not [lib for lib in libraries if "numpy" in lib or "kvxfer" in lib or "fabric" in lib], libraries


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin the prefiller to one of them")
def test_the_keeper_of_a_prefiller_pinned_to_one_cpu_runs_on_the_others() -> None:
    """An instance pinned to its cores keeps them busy, most of all while the kernel tears it
    down after a kill: its keeper runs elsewhere, not merely may (the kernel wakes a task
    where it last ran)."""
    allowed = os.sched_getaffinity(0)
    pf = SilentPrefiller(PROVIDER, liveness_max_held=MAX_HELD, cpus={min(allowed)}, wait_s=STARTUP_DEADLINE_S)
    try:
        assert os.sched_getaffinity(pf.proc.pid) == {min(allowed)}
        assert os.sched_getaffinity(pf.keeper_pid) == (allowed - {min(allowed)} or allowed)
    finally:
        pf.stop()


# ---- a same-host prefiller: no socket carries its writes, its threads' exit is the proof ----

#: Bytes the same-host writer copies again and again (several 4 MiB slices: always mid-copy).
COPY_BYTES = 32 << 20
#: How long the decoder watches for a byte landing after it proved the writer gone.
NOTHING_LANDS_WATCH_S = 0.3


@pytest.fixture
def same_host_prefiller() -> Iterator[SilentPrefiller]:
    pf = SilentPrefiller(PROVIDER, liveness_max_held=MAX_HELD, wait_s=STARTUP_DEADLINE_S, same_host=True)
    try:
        yield pf
    finally:
        pf.stop()


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_a_same_host_prefiller_alive_when_declared_gone_keeps_the_fence_and_once_killed_is_freed_at_once(
        same_host_decoder: TransferEngine, same_host_prefiller: SilentPrefiller,
        caplog: pytest.LogCaptureFixture) -> None:
    pf = same_host_prefiller
    settings = ConnectorSettings(provider=PROVIDER, prefiller_probe_after_s=PROBES_OUT_OF_REACH_S,
                                 dead_prefiller_fence_s=FENCE_OUT_OF_REACH_S)
    receiver = _reserve(same_host_decoder, pf.address, pf.liveness, settings, "same-host")
    assert receiver._liveness.phase(pf.liveness) == "held"
    assert same_host_decoder.same_host_writes_ended(pf.address), "a same-host prefiller that runs was not pinned"
    caplog.set_level(logging.INFO, logger="kvxfer")
    os.kill(pf.keeper_pid, signal.SIGKILL)  # its liveness connection closes; the prefiller runs on
    load = _poll_until_writer_gone(receiver, "d-same-host", "freed while the same-host prefiller could still write")
    assert load.entry is not None and load.entry.writer_gone, "the closed liveness connection was not noticed"
    # Rechecked every dead_writer_recheck_s: a live writer never proves anything.
    watch_end = time.monotonic() + 20 * settings.dead_writer_recheck_s
    while time.monotonic() < watch_end:
        finished, _ = receiver.poll(set())
        assert "d-same-host" not in finished, "freed while the same-host prefiller could still write"
        time.sleep(0.002)
    assert (load.state, load.writer_severed) == (Res.FENCED, False)
    pf.signal_group(signal.SIGKILL)
    reported = _poll_until_finished(receiver, "d-same-host", REPORTED_WITHIN_S)
    assert reported == {"finished", "d-same-host"}, "not freed once every thread of it was exiting"
    freed = [r.getMessage() for r in caplog.records
             if "(request d-same-host)" in r.getMessage() and "prefiller process is gone" in r.getMessage()]
    assert freed and "no byte of it can land" in freed[-1], freed


def test_a_same_host_writer_killed_mid_copy_lands_nothing_once_proven_unable_to_write(
        same_host_decoder: TransferEngine, same_host_prefiller: SilentPrefiller) -> None:
    pf = same_host_prefiller
    cache = SharedBuffer(COPY_BYTES).array  # a memfd, as the connector's KV cache: the writer memcpys into it
    cache[:] = 0
    mr = same_host_decoder.register(cache)
    assert same_host_decoder.watch_same_host_writer(pf.address)
    pf.copy_into(mr.descriptor, COPY_BYTES)
    end = time.monotonic() + STARTUP_DEADLINE_S
    while not cache[-1] and time.monotonic() < end:
        time.sleep(0.002)
    assert cache[-1] == 0xAB, "no copy landed"
    assert "is not exiting" in same_host_decoder.same_host_writes_ended(pf.address), "a copying writer proved gone"
    pf.signal_group(signal.SIGSTOP)  # frozen mid-copy: it would copy on when woken
    end = time.monotonic() + STARTUP_DEADLINE_S
    while _process_state(pf.proc.pid) != "T" and time.monotonic() < end:
        time.sleep(0.002)
    assert "is not exiting" in same_host_decoder.same_host_writes_ended(pf.address), "a frozen writer proved gone"
    pf.signal_group(signal.SIGKILL)
    end = time.monotonic() + REPORTED_WITHIN_S
    while same_host_decoder.same_host_writes_ended(pf.address) and time.monotonic() < end:
        time.sleep(0.001)
    assert same_host_decoder.same_host_writes_ended(pf.address) == "", "a killed writer not proven unable to write"
    cache[:] = 0  # the decoder frees the blocks; the next request's KV goes here
    time.sleep(NOTHING_LANDS_WATCH_S)
    assert not cache.any(), f"{int((cache != 0).sum())} bytes landed after the writer was proven gone"
    same_host_decoder.deregister(mr)
