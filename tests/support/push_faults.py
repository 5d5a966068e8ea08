"""Failure drills of the prefill worker, injected from outside through its push hooks.

A worker process runs them when its environment says so (`fault_env(spec)`):
`KVXFER_PUSH_HOOKS=support.push_faults:from_environment` makes the worker load this
module (tests/ on its PYTHONPATH), and `KVXFER_DRILL_FAULT` names the fault. Every push of
that worker gets it. The production modules know nothing of it (tests/structure checks).

| spec | what every push does |
|---|---|
| `abort_after_layer:N` | stops before layer N's write and aborts (the decoder fails at once) |
| `skip_page:L` | does not write one page of layer L (the decoder's count never completes) |
| `duplicate_page:L` | writes one page of layer L twice (one count too many) |
| `flip_bit:L` | flips one bit of one page of layer L after checksumming it |
| `swap_pages:L` | swaps two pages of layer L before checksumming (checksums agree; the oracle must not) |
| `write_late:MS` | stands still MS ms before layer 1's write, then goes on (a starved process) |
| `freeze_after_layer:N` | holds before layer N's write, once its earlier writes completed, until it was SIGSTOPped and SIGCONTed from outside (a pod's PID 1 cannot stop itself) |

The page faults (skip, duplicate, flip, swap) hit the first chunk of layer L that has two
pages or more, once per push.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvxfer.errors import TransferError
from kvxfer.handoff.push_session import PushSession
from kvxfer.handoff.push_hooks import PageWrite, PushHooks

log = logging.getLogger("kvxfer.drill")

#: The environment variable naming the fault of a worker started with `fault_env`.
FAULT_ENV = "KVXFER_DRILL_FAULT"
#: The faults that change one chunk's pages or writes.
PAGE_KINDS = ("skip_page", "duplicate_page", "flip_bit", "swap_pages")
#: Every fault this module makes (tests/structure: no production module names one).
KINDS = ("abort_after_layer", "freeze_after_layer", "write_late", *PAGE_KINDS)
#: How long the freeze drill waits at its point for the outside SIGSTOP and SIGCONT.
FREEZE_WAIT_S = 120.0
#: A pause between two short sleeps at least this long means the process was stopped.
STOPPED_GAP_S = 0.5
#: How long the freeze drill waits for the push's earlier writes before it holds.
DRAIN_WAIT_S = 30.0
TESTS_DIR = str(Path(__file__).resolve().parents[1])


def fault_env(spec: str) -> dict[str, str]:
    """The environment that makes a worker process run fault `spec` on every push."""
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p)
    return {"KVXFER_PUSH_HOOKS": "support.push_faults:from_environment", FAULT_ENV: spec, "PYTHONPATH": path}


class InjectedFault(TransferError):
    """A push failure made on purpose by a drill."""


def wait_until_stopped_and_continued(timeout_s: float) -> bool:
    """Holds the calling thread until the process was stopped and continued (seen as a gap in
    CLOCK_MONOTONIC, which runs on while a process is stopped), or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = time.monotonic()
        time.sleep(0.01)
        if time.monotonic() - before >= STOPPED_GAP_S:
            return True
    return False


class PushFault(PushHooks):
    """One fault (`kind`, see the module's table) at layer or time `value`, on every push."""

    def __init__(self, kind: str, value: int) -> None:
        if kind not in KINDS or value < 0:
            raise ValueError(f"push fault {kind}:{value}: expected one of {', '.join(k + ':N' for k in KINDS)}")
        self.kind = kind
        self.value = value
        # Pushes whose page fault was made (once per push).
        self._hit: weakref.WeakSet[PushSession] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"PushFault({self.kind}:{self.value})"

    def before_layer(self, push: PushSession, layer: int, first_block: int) -> None:
        rid = push.reservation.request_id
        if self.kind == "abort_after_layer" and layer >= self.value:
            raise InjectedFault(rid, f"fault injection: abort_after_layer:{self.value}")
        if self.kind == "freeze_after_layer" and layer == self.value and first_block == push.first_page:
            # Frozen between writes, none in flight: what a SIGSTOP'd process looks like to
            # its decoder. The stop comes from outside (a pod's PID 1 ignores a SIGSTOP it
            # sends itself): this thread holds here until it has been stopped and continued,
            # so no write of this push is posted before the SIGCONT.
            push.wait(DRAIN_WAIT_S)
            log.warning("fault injection: request %s: frozen point before layer %d (pid %d): waiting for "
                        "SIGSTOP and SIGCONT", rid, layer, os.getpid())
            wait_until_stopped_and_continued(FREEZE_WAIT_S)
        if self.kind == "write_late" and layer == 1 and first_block == push.first_page:
            time.sleep(self.value / 1e3)

    def _hits(self, push: PushSession, layer: int, pages: int) -> bool:
        """True once per push: at the first chunk of the fault's layer with two pages or more."""
        if self.kind not in PAGE_KINDS or layer != self.value or pages < 2 or push in self._hit:
            return False
        self._hit.add(push)
        return True

    def before_checksum(self, push: PushSession, layer: int, local: np.ndarray) -> None:
        if self.kind == "swap_pages" and self._hits(push, layer, len(local)):
            a, b = (push.cache.page_view(layer, int(p)) for p in local[:2])
            a_copy = a.clone()
            a.copy_(b)
            b.copy_(a_copy)

    def layer_writes(self, push: PushSession, layer: int, local: np.ndarray, remote: np.ndarray) -> Sequence[PageWrite]:
        if self.kind == "swap_pages" or not self._hits(push, layer, len(local)):
            return ((local, remote),)
        if self.kind == "flip_bit":
            cache = push.cache
            cache.as_bytes()[cache.page_offset_bytes(layer, int(local[0])) + cache.page_bytes // 2] ^= 0x04
            return ((local, remote),)
        if self.kind == "skip_page":
            return ((np.delete(local, 1), np.delete(remote, 1)),)
        return ((local, remote), (local[:1], remote[:1]))  # duplicate_page


def parse_fault(spec: str) -> PushFault:
    """The fault of a spec such as "skip_page:0"; ValueError naming the forms otherwise."""
    kind, _, arg = spec.partition(":")
    if not arg.isdigit():
        raise ValueError(f"push fault {spec!r}: expected one of {', '.join(k + ':N' for k in KINDS)}")
    return PushFault(kind, int(arg))


def from_environment() -> PushHooks:
    """The push hooks of a worker started with `fault_env` (the `push_hooks` factory)."""
    return parse_fault(os.environ[FAULT_ENV])
