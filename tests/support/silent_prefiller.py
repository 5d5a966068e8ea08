"""A prefiller process for the dead-prefiller tests of the connector's decode half.

It holds a real engine that takes messages (the reservation, probes, cancels) and never
pushes, and optionally the liveness listener a vLLM prefill worker runs
(`kvxfer.integrations.vllm.prefiller_liveness`), in a process group of its own (with the
listener's keeper), as a vLLM instance is. It prints its addresses on stdout and never
outlives the test process that started it. With `same_host` its engine may write through
the same-host path, and `copy_into` has it copy a buffer into a descriptor over and over
(a same-host writer always mid-copy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

#: The process: argv[1] is the provider, argv[2] the liveness listener's bound (0: none),
#: argv[3] "1" for a same-host engine. A line on stdin, once read: "DESCRIPTOR_HEX BYTES" to
#: copy BYTES of a buffer of 0xAB into that descriptor from then on, again and again.
_SCRIPT = """
import os, sys, threading
from kvxfer.transfer.engine import TransferEngine
engine = TransferEngine(sys.argv[1], same_host=sys.argv[3] == "1", bind_host="127.0.0.1", imm_admission="claimed")
liveness, keeper = "-", 0
if int(sys.argv[2]):
    from kvxfer.integrations.vllm.prefiller_liveness import LivenessListener
    listener = LivenessListener("127.0.0.1", int(sys.argv[2]))
    liveness, keeper = listener.address, listener.keeper_pid
print(engine.address.hex(), liveness, keeper, flush=True)

def copy_forever():
    line = sys.stdin.readline().split()
    if not line:
        return
    import numpy
    source = numpy.full(int(line[1]), 0xAB, dtype=numpy.uint8)
    mr = engine.register(source)
    print("copying", flush=True)
    while True:
        engine.write(mr, 0, bytes.fromhex(line[0]), 0, source.size).wait(60)

threading.Thread(target=copy_forever, daemon=True).start()
parent = os.getppid()
while os.getppid() == parent:  # never outlives the test process
    engine.recv(0.2)
"""


class SilentPrefiller:
    """The prefiller process (`proc`), its engine `address`, and with a liveness listener
    its `liveness` address ("" without) and keeper's pid (0 without). `cpus` pins it (and
    what it starts) to those CPUs from its start."""

    def __init__(self, provider: str, liveness_max_held: int = 0, cpus: set[int] | None = None,
                 wait_s: float = 30.0, same_host: bool = False) -> None:
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None
        self.wait_s = wait_s
        self.proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, provider, str(liveness_max_held),
                                      "1" if same_host else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True, preexec_fn=pin)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: the process prints or dies (then EOF)
        assert line, "the prefiller process died before printing its addresses"
        engine_hex, liveness, keeper = line.split()
        self.address = bytes.fromhex(engine_hex)
        self.liveness = "" if liveness == "-" else liveness
        self.keeper_pid = int(keeper)

    def copy_into(self, descriptor: bytes, length: int) -> None:
        """Has the process copy `length` bytes of 0xAB into `descriptor`, again and again,
        from when this returns (once it said it started)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{descriptor.hex()} {length}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # bounded: the process prints or dies (then EOF)
        assert line.strip() == "copying", f"the prefiller process did not start copying: {line!r}"

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
