"""What an idle engine with a live connection costs: its progress worker's wake-ups
(engine_stats()["worker_wakeups"]), here and in a separate peer process, on every loopback
provider.

Before, net's worker blocked on a CQ wait fd whose signal libfabric 1.17 never clears, so
it woke every millisecond for good (3-3.6% of a core per idle engine), and shm's, with no
wait fd at all, looked every 20 us (half a core). Now net's sleeps on the provider's socket
poll set (native/src/provider_poll_set.hpp) and shm's pauses grow once the engine is quiet
(sleep_policy::pause_without_wait_fd_us). Both must still wake for the next write.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from support.engine_pairs import KIB, LOOPBACK, PROVIDERS, SPARE_BYTES, WAIT_S, PeerProcess, fresh_imm

from kvxfer.transfer.engine import TransferEngine

# After the last transfer the worker is busy for its quiet spell (2 ms) and, without a wait
# fd, pauses 100 us for the first second of silence; past that it is in its idle state.
SETTLE_S = 1.2
MEASURE_S = 1.0
# Wake-ups a second an idle engine may have. With a wait fd the worker blocks until an fd
# speaks or its idle sleep (50 ms) ends: about 20 a second, against about 1,000 while net's
# never-cleared signal kept it up. Without one (shm) it looks every 1 ms once quiet for a
# second: about 1,000, against 20,000-50,000 at a 20 us pause.
MAX_WAKEUPS_PER_S = {"net": 100, "tcp": 100, "shm": 2500}


def wakeups_per_s(before: int, after: int, seconds: float) -> float:
    return (after - before) / seconds


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_idle_engine_with_a_connection_sleeps_on_both_sides_and_still_takes_the_next_write(
    provider: str, tmp_path: Path
) -> None:
    peer = PeerProcess(provider, 1, SPARE_BYTES, tmp_path)
    try:
        with TransferEngine(provider, bind_host=LOOPBACK, same_host=False) as engine:
            source = np.arange(64 * KIB, dtype=np.uint8)
            mr = engine.register(source)
            imm = fresh_imm()
            engine.write(mr, 0, peer.descriptor, 0, 64 * KIB, imm=imm).wait(WAIT_S)
            peer.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)

            time.sleep(SETTLE_S)
            ours_before = engine.engine_stats()["worker_wakeups"]
            theirs_before = peer.call("engine_stats")["stats"]["worker_wakeups"]
            start = time.monotonic()
            time.sleep(MEASURE_S)
            ours_after = engine.engine_stats()["worker_wakeups"]
            theirs_after = peer.call("engine_stats")["stats"]["worker_wakeups"]
            elapsed = time.monotonic() - start

            bound = MAX_WAKEUPS_PER_S[provider]
            ours = wakeups_per_s(ours_before, ours_after, elapsed)
            # The peer's reading was taken a request round trip later: the same span, give or take.
            theirs = wakeups_per_s(theirs_before, theirs_after, elapsed)
            sleeps_on = engine.capabilities["sleeps_on"]
            assert ours <= bound, f"initiator woke {ours:.0f} times/s idle (sleeps on {sleeps_on})"
            assert theirs <= bound, f"target woke {theirs:.0f} times/s idle"

            # Asleep, both still hear the next write: its bytes land and its immediate is counted.
            imm = fresh_imm()
            engine.write(mr, 4 * KIB, peer.descriptor, 0, 4 * KIB, imm=imm).wait(WAIT_S)
            peer.call("wait_imm", imm=imm, count=1, timeout=WAIT_S)
            landed = bytes.fromhex(peer.call("read", region=0, offset=0, length=4 * KIB)["data"])
            assert landed == source[4 * KIB : 8 * KIB].tobytes()
    finally:
        peer.close()


def test_net_sleeps_on_its_socket_poll_set_and_tcp_on_its_cq_wait_fd() -> None:
    # The shape check of provider_poll_set.hpp applied to the real providers: net's wait fd
    # holds the never-cleared signal beside the poll set, tcp;ofi_rxm's is used as it is.
    expected = {"net": "provider poll set", "tcp": "cq wait fd", "shm": "none"}
    for provider in PROVIDERS:
        with TransferEngine(provider, bind_host=LOOPBACK, same_host=False) as engine:
            sleeps_on = engine.capabilities["sleeps_on"]
            assert sleeps_on.startswith(expected[provider]), f"{provider}: {sleeps_on}"
