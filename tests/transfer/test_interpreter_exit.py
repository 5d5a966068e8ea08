"""A process whose daemon threads are still blocked in the engine when the interpreter
exits ends cleanly: exit status 0, no abort.

CPython (before 3.14) ends such a thread with pthread_exit when it re-takes the GIL during
finalization; through a noexcept GIL guard that forced unwind called std::terminate, and a
worker that had drained and logged "stopped" died of SIGABRT (seen in the SIGTERM-drain e2e
test). Each run below re-takes the GIL thousands of times a second from four threads, so
an unsafe guard aborts nearly every run (10 of 10 before the fix).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import threading, time
    from kvxfer.transfer.engine import TransferEngine

    engine = TransferEngine(bind_host="127.0.0.1", same_host=False)

    def keep_receiving() -> None:
        while True:
            engine.recv(0.0002)  # releases and re-takes the GIL each time

    for _ in range(4):
        threading.Thread(target=keep_receiving, daemon=True).start()
    time.sleep(0.2)
    print("main thread returns", flush=True)
""")


@pytest.mark.parametrize("run", range(3))
def test_daemon_threads_blocked_in_the_engine_do_not_abort_interpreter_exit(run: int) -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert "main thread returns" in proc.stdout
