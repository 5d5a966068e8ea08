"""A prefiller process for the dead-prefiller tests of the connector's decode half.

It holds a real engine that takes messages (the reservation, probes, cancels) and never
pushes, and optionally the liveness listener a vLLM prefill worker runs
(`kvxfer.integrations.vllm.prefiller_liveness`), in a process group of its own (with the
listener's keeper), as a vLLM instance is. It prints its addresses on stdout and never
outlives the test process that started it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

#: The process: argv[1] is the provider, argv[2] the liveness listener's bound (0: none).
_SCRIPT = """
import os, sys
from kvxfer.transfer.engine import TransferEngine
engine = TransferEngine(sys.argv[1], same_host=False, bind_host="127.0.0.1", imm_admission="claimed")
liveness, keeper = "-", 0
if int(sys.argv[2]):
    from kvxfer.integrations.vllm.prefiller_liveness import LivenessListener
    listener = LivenessListener("127.0.0.1", int(sys.argv[2]))
    liveness, keeper = listener.address, listener.keeper_pid
print(engine.address.hex(), liveness, keeper, flush=True)
parent = os.getppid()
while os.getppid() == parent:  # never outlives the test process
    engine.recv(0.2)
"""


class SilentPrefiller:
    """The prefiller process (`proc`), its engine `address`, and with a liveness listener
    its `liveness` address ("" without) and keeper's pid (0 without). `cpus` pins it (and
    what it starts) to those CPUs from its start."""

    def __init__(self, provider: str, liveness_max_held: int = 0, cpus: set[int] | None = None,
                 wait_s: float = 30.0) -> None:
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None
        self.wait_s = wait_s
        self.proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, provider, str(liveness_max_held)],
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True, preexec_fn=pin)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: the process prints or dies (then EOF)
        assert line, "the prefiller process died before printing its addresses"
        engine_hex, liveness, keeper = line.split()
        self.address = bytes.fromhex(engine_hex)
        self.liveness = "" if liveness == "-" else liveness
        self.keeper_pid = int(keeper)

    def signal_group(self, sig: int) -> None:
        """`sig` to the process and everything it started (its keeper)."""
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """Kills the group (woken first, were it stopped) and reaps the process."""
        try:
            self.signal_group(signal.SIGCONT)
            self.signal_group(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=self.wait_s)
