"""The same-host path: process-to-process copies, its safety checks and the settings that turn it off.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any, Iterator

import numpy as np
import pytest
from support.engine_pairs import (
    FAIL_BOUND_S,
    KIB,
    LOOPBACK,
    MIB,
    PROVIDERS,
    STRAY_ARRIVAL_GRACE_S,
    WAIT_S,
    EnginePair,
    OwnPeers,
    assert_same_bytes,
    assert_still_delivers,
    assert_zero,
    fnv1a32,
    fresh_imm,
    wait_for_stat,
)
from support.engine_peer import (
    SAME_HOST,
    SAME_HOST_MAPPED,
    SAME_HOST_MODES,
    engine_options,
    provider_of,
    seeded_bytes,
)

from kvxfer import _native
from kvxfer.errors import EngineError, TransferError
from kvxfer.transfer.engine import RegisteredMemory, TransferEngine

# -- the same-host path -----------------------------------------------------------------

only_same_host = pytest.mark.parametrize("provider", list(SAME_HOST_MODES), indirect=True)
# What TransferEngine.path_to says of a peer's region 0 in each same-host mode.
SAME_HOST_PATH = {SAME_HOST: "same_host", SAME_HOST_MAPPED: "same_host_mapped"}



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


def switched_off(by: str, variable: str, argument: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """TransferEngine options that turn a switch off `by` its "argument" (the variable unset)
    or its environment "variable" (the argument left out)."""
    if by == "environment":
        monkeypatch.setenv(variable, "off")
        return {}
    monkeypatch.delenv(variable, raising=False)
    return {argument: False}


def ring_counts(engine: TransferEngine) -> tuple[int, int, int]:
    """(imm_ring_sent, imm_ring_received, imm_ring_fallbacks) of an engine."""
    stats = engine.engine_stats()
    return stats["imm_ring_sent"], stats["imm_ring_received"], stats["imm_ring_fallbacks"]


@only_same_host
def test_same_host_immediates_go_through_the_receivers_ring_and_nothing_through_the_fabric(
    pair: EnginePair, provider: str
) -> None:
    # 4 KiB is copied on the calling thread, 1 MiB by the progress worker: both hand their
    # immediate to the ring. The rails carry no op at all, and the bytes are whole.
    data = seeded_bytes(67, 1 * MIB)
    pair.src[: data.size] = data
    rail_ops = [rail["ops_completed"] for rail in pair.engine.stats()]
    sent, received_here, fallbacks = ring_counts(pair.engine)  # this engine is a target in other tests
    received = pair.target.call("engine_stats")["stats"]["imm_ring_received"]
    for size in (4 * KIB, 1 * MIB):
        imm = fresh_imm()
        pair.engine.write(pair.mr, 0, pair.descriptor, 0, size, imm=imm).wait(WAIT_S)
        pair.wait_target_count(imm, 1)
        assert_same_bytes(pair.target_bytes(0, size), data[:size], f"{size} bytes")
    assert ring_counts(pair.engine) == (sent + 2, received_here, fallbacks)
    assert pair.target.call("engine_stats")["stats"]["imm_ring_received"] == received + 2
    assert [rail["ops_completed"] for rail in pair.engine.stats()] == rail_ops


@only_same_host
@pytest.mark.parametrize("turned_off_by", ["argument", "environment"])
def test_with_the_ring_off_a_same_host_writes_immediate_takes_the_fabric(
    pair: EnginePair, provider: str, turned_off_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = switched_off(turned_off_by, "KVXFER_SAME_HOST_IMM_RING", "same_host_imm_ring", monkeypatch)
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK, **options) as engine:
        mr = engine.register(np.ones(64 * KIB, dtype=np.uint8))
        assert engine.path_to(pair.descriptor) == SAME_HOST_PATH[provider]
        imm = fresh_imm()
        engine.write(mr, 0, pair.descriptor, 0, 64 * KIB, imm=imm).wait(WAIT_S)
        pair.wait_target_count(imm, 1)
        assert ring_counts(engine) == (0, 0, 0)
        assert sum(rail["ops_completed"] for rail in engine.stats()) == 1


@only_same_host
def test_a_ring_immediate_bound_to_another_engine_is_dropped_and_counted_and_a_closed_receiver_takes_none(
    provider: str, peers: OwnPeers
) -> None:
    # bind_imm_source holds for the ring too: each entry names its writer engine. An
    # outsider on this host that writes the bound immediate is dropped, the bound peer
    # counts. Once the receiver closed, writers find its ring closed and use the fabric.
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK) as decoder:
        if not decoder.capabilities["source"]:
            pytest.skip(f"{provider} cannot name an immediate's sender")
        region = decoder.register(np.zeros(1 * MIB, dtype=np.uint8))
        prefiller, outsider = peers.spare(), peers.spare()
        imm = fresh_imm()
        assert decoder.bind_imm_source(imm, prefiller.address)
        write = {"descriptor": region.descriptor.hex(), "src_offset": 0, "dst_offset": 0, "length": 4 * KIB}
        outsider.call("write", **write, imm=imm)
        prefiller.call("write", **write, imm=imm)
        decoder.wait_imm(imm, 1, WAIT_S)
        wait_for_stat(decoder, "imm_foreign_dropped", 1)
        time.sleep(STRAY_ARRIVAL_GRACE_S)
        assert decoder.imm_count(imm) == 1
        assert decoder.engine_stats()["imm_ring_received"] == 2
        for peer in (prefiller, outsider):
            assert peer.call("engine_stats")["stats"]["imm_ring_sent"] == 1
    failed = prefiller.request("write", **write, imm=imm, timeout=WAIT_S)
    assert not failed["ok"], "a write to a closed engine succeeded"
    assert prefiller.call("engine_stats")["stats"]["imm_ring_fallbacks"] == 1


FROZEN_TIMEOUT_S = 1.0  # the writer's transfer_timeout_s: how soon the fallbacks fail


@only_same_host
def test_a_frozen_receivers_ring_takes_immediates_until_its_lane_is_full_then_writes_fail_in_bounded_time(
    provider: str, peers: OwnPeers
) -> None:
    # As an RDMA NIC writes into a stopped process, the ring takes a frozen receiver's
    # immediates, but only as many as its lane holds: the rest fall back to the fabric,
    # which fails them at the writer's deadline. Nothing hangs, and once the receiver
    # runs again it counts every write that was reported done.
    frozen = peers.spare()
    lane, extra = _native.IMM_RING_LANE_ENTRIES, 16
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK, transfer_timeout_s=FROZEN_TIMEOUT_S) as engine:
        mr = engine.register(np.ones(4 * KIB, dtype=np.uint8))
        imm = fresh_imm()
        engine.write(mr, 0, frozen.descriptor, 0, 4 * KIB, imm=imm).wait(WAIT_S)
        frozen.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)  # the lane is empty again
        frozen.freeze()  # stopped before the burst: it must not drain any of it
        try:
            started = time.monotonic()
            writes = [engine.write(mr, 0, frozen.descriptor, 0, 4 * KIB, imm=imm) for _ in range(lane + extra)]
            outcomes = []
            for w in writes:
                try:
                    w.wait(max(0.0, started + FAIL_BOUND_S - time.monotonic()))
                    outcomes.append("done")
                except TransferError:
                    outcomes.append("failed" if w.done() else "pending")
            assert outcomes == ["done"] * lane + ["failed"] * extra
            assert ring_counts(engine)[2] == extra  # the fallbacks
        finally:
            frozen.thaw()
        frozen.call("wait_imm", imm=imm, count=1 + lane, timeout=WAIT_S)


@contextlib.contextmanager
def own_writer(provider: str) -> Iterator[tuple[TransferEngine, RegisteredMemory]]:
    """An engine of this test's own with 64 KiB of ones registered, for tests that count
    what this process holds of its peers. The counts are the whole process's: engines of
    earlier tests that are garbage now must let go of theirs before, not during, the test."""
    gc.collect()
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK) as engine:
        yield engine, engine.register(np.ones(64 * KIB, dtype=np.uint8))


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
    with own_writer(provider) as (engine, mr):
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


@pytest.mark.parametrize("provider", [SAME_HOST_MAPPED], indirect=True)
def test_every_reservations_windows_of_one_shared_region_write_through_one_mapping(
    pair: EnginePair, provider: str
) -> None:
    # A decoder hands out a fresh windows descriptor per reservation, all naming its one
    # KV cache. Mapping (and populating) the whole cache again per descriptor would cost
    # every request that, and keep page tables for each descriptor the sender caches.
    page, reservations = 4 * KIB, 6
    for r in range(reservations):
        reply = pair.target.call("register_windows", ranges=[[r * page, page]])
        windows = bytes.fromhex(reply["descriptor"])
        assert pair.engine.path_to(windows) == "same_host_mapped"
        data = seeded_bytes(70 + r, page)
        pair.src[:page] = data
        pair.engine.write(pair.mr, 0, windows, r * page, page).wait(WAIT_S)
        assert_same_bytes(pair.target_bytes(r * page, page), data, f"reservation {r}")
        assert most_mappings_of_one_memfd() == 1, f"reservation {r}: the peer's region mapped again"


@pytest.mark.parametrize("provider", [SAME_HOST_MAPPED], indirect=True)
def test_a_region_its_owner_withdrew_is_unmapped_here_once_the_owner_registers_another(
    provider: str, peers: OwnPeers
) -> None:
    # A writer caches what it parsed of a descriptor, and the cached descriptor of a
    # mapped region keeps that memory mapped here. A peer that registers its KV cache
    # anew (a resize, its engine rebuilt in a live process) must not leave the old cache
    # mapped in every writer for as long as they run: a new region of a same-host peer
    # makes the cache drop what its owner withdrew.
    with own_writer(provider) as (engine, mr):
        peer = peers.spare()
        before = mapped_shared_buffers()
        old = bytes.fromhex(peer.call("register", size=1 << 20)["descriptor"])
        engine.write(mr, 0, old, 0, 4 * KIB).wait(WAIT_S)
        old_mapping = mapped_shared_buffers() - before
        assert len(old_mapping) == 1, "the peer's region was not mapped for the write"

        peer.call("deregister", region=1)
        new = bytes.fromhex(peer.call("register", size=1 << 20)["descriptor"])
        engine.write(mr, 0, new, 0, 4 * KIB).wait(WAIT_S)
        assert engine.path_to(new) == "same_host_mapped"
        assert not mapped_shared_buffers() & old_mapping, "the withdrawn region is still mapped here"
        landed = bytes.fromhex(peer.call("read", offset=0, length=4 * KIB, region=2)["data"])
        assert landed == b"\x01" * (4 * KIB)


def mapped_shared_buffers() -> set[str]:
    """Inodes of the SharedBuffers (not region tables) of any process mapped into this one."""
    with open("/proc/self/maps") as maps:
        return {line.split()[4] for line in maps if "/memfd:kvxfer-region " in line}


def most_mappings_of_one_memfd() -> int:
    """The most times any one kvxfer memfd (by inode) is mapped into this process."""
    with open("/proc/self/maps") as maps:
        inodes = [line.split()[4] for line in maps if "/memfd:kvxfer" in line]
    return max((inodes.count(inode) for inode in inodes), default=0)


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
    options = switched_off(turned_off_by, "KVXFER_SAME_HOST", "same_host", monkeypatch)
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
