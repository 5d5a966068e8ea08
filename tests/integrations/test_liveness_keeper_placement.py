"""The liveness keeper pins itself to the CPUs its worker names (liveness_keeper.py), so
that it is off the worker's CPUs when the worker is killed, whatever moved it after the
worker placed it from outside (seen with perf sched in a vLLM worker: a keeper placed from
outside was back on the worker's CPU 7 ms later, and after a kill waited there 6.5 ms
behind the killed worker's threads). Real processes: the keeper is started by path, as
LivenessListener starts it, without the listener's own placement.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from kvxfer.integrations.vllm import liveness_keeper
from kvxfer.integrations.vllm.liveness_keeper import HELD

#: How long the keeper may take to start and serve.
SERVING_WITHIN_S = 30.0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to name one of them")
def test_a_keeper_started_with_cpus_runs_on_them() -> None:
    wanted = {max(os.sched_getaffinity(0))}
    server = socket.create_server(("127.0.0.1", 0))
    alive_r, alive_w = os.pipe()
    keeper = subprocess.Popen(
        [sys.executable, "-I", "-S", liveness_keeper.__file__, str(server.fileno()), str(alive_r), "4",
         ",".join(map(str, sorted(wanted)))],
        pass_fds=(server.fileno(), alive_r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        # Once it holds a connection it has started, its pin included.
        with socket.create_connection(server.getsockname(), timeout=SERVING_WITHIN_S) as conn:
            conn.settimeout(SERVING_WITHIN_S)
            assert conn.recv(1) == HELD
            assert os.sched_getaffinity(keeper.pid) == wanted
    finally:
        os.close(alive_w)  # its worker is gone: it exits
        keeper.wait(timeout=SERVING_WITHIN_S)
        os.close(alive_r)
        server.close()


def test_a_keeper_started_without_cpus_stays_where_it_was_started() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    alive_r, alive_w = os.pipe()
    keeper = subprocess.Popen(
        [sys.executable, "-I", "-S", liveness_keeper.__file__, str(server.fileno()), str(alive_r), "4"],
        pass_fds=(server.fileno(), alive_r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        with socket.create_connection(server.getsockname(), timeout=SERVING_WITHIN_S) as conn:
            conn.settimeout(SERVING_WITHIN_S)
            assert conn.recv(1) == HELD
            assert os.sched_getaffinity(keeper.pid) == os.sched_getaffinity(0)
    finally:
        os.close(alive_w)
        started = time.monotonic()
        keeper.wait(timeout=SERVING_WITHIN_S)
        assert time.monotonic() - started < SERVING_WITHIN_S
        os.close(alive_r)
        server.close()
