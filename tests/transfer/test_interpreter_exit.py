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


SIGNALS_PROGRAM = textwrap.dedent("""
    import os, signal, time
    def caught() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
        raise RuntimeError("no SigCgt")
    before = caught()
    from kvxfer.transfer.engine import TransferEngine  # loads libfabric and what it links
    added = caught() & ~before
    print("added", [signal.Signals(n).name for n in range(1, 32) if added >> (n - 1) & 1], flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
""")


def test_loading_the_engine_leaves_crash_and_sigterm_handling_to_the_process() -> None:
    # libinfinipath (linked by Debian's libfabric) installs SIGSEGV/SIGBUS/SIGILL/SIGABRT/
    # SIGTERM handlers that call exit() from the handler; one suite run hung in them after a
    # crash. Loading the engine must add no handler, and SIGTERM must still end the process.
    proc = subprocess.run([sys.executable, "-c", SIGNALS_PROGRAM], capture_output=True, text=True, timeout=60,
                          check=False)
    assert "added []" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == -15, (proc.returncode, proc.stderr[-2000:])
