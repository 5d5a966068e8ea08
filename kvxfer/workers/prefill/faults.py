"""Failure drills of the prefill worker: `fault_injection` (env KVXFER_FAULT_INJECTION).

Off when empty, and for tests and drills only: every push of the worker gets the fault.

| spec | what every push does |
|---|---|
| `abort_after_layer:N` | stops before layer N's write and aborts (the decoder fails at once) |
| `skip_page:L` | does not write one page of layer L (the decoder's count never completes) |
| `duplicate_page:L` | writes one page of layer L twice (one count too many) |
| `flip_bit:L` | flips one bit of one page of layer L after checksumming it |
| `swap_pages:L` | swaps two pages of layer L before checksumming (checksums agree; the oracle must not) |
| `write_late:MS` | stands still MS ms before layer 1's write, then goes on (a starved process) |
| `freeze_after_layer:N` | holds before layer N's write, once its earlier writes completed, until it was SIGSTOPped and SIGCONTed from outside (a pod's PID 1 cannot stop itself) |
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.kv.push import PushFault

_LAYER_KINDS = ("abort_after_layer", "freeze_after_layer")
_KINDS = (*_LAYER_KINDS, *PushFault.KINDS, "write_late")


@dataclass(frozen=True)
class FaultPlan:
    """What `fault_injection` asks of every push; all None when off."""

    abort_before_layer: int | None = None
    freeze_before_layer: int | None = None
    write_late_ms: int | None = None
    push_fault: PushFault | None = None

    @property
    def active(self) -> bool:
        return self != FaultPlan()


def parse_fault_injection(spec: str) -> FaultPlan:
    """The plan of a `fault_injection` spec ("" is off); ValueError naming the forms otherwise."""
    if not spec:
        return FaultPlan()
    kind, _, arg = spec.partition(":")
    if kind not in _KINDS or not arg.isdigit():
        raise ValueError(f"fault_injection {spec!r}: expected one of {', '.join(k + ':N' for k in _KINDS)}")
    value = int(arg)
    if kind == "abort_after_layer":
        return FaultPlan(abort_before_layer=value)
    if kind == "freeze_after_layer":
        return FaultPlan(freeze_before_layer=value)
    if kind == "write_late":
        return FaultPlan(write_late_ms=value)
    return FaultPlan(push_fault=PushFault(kind, value))
