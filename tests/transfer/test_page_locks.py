"""Registered memory is locked where the process may (lock_on_register), and given back
whole when its registration or its engine goes, even with another registration over the
same pages (native/src/page_locks.hpp; the C++ test covers the overlap arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.transfer.engine import TransferEngine

MIB = 1 << 20


def vm_locked_bytes() -> int:
    """VmLck of this process, as the kernel counts it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def test_registration_locks_its_pages_and_deregistration_and_close_give_them_back() -> None:
    before = vm_locked_bytes()
    buf = np.zeros(8 * MIB, dtype=np.uint8)
    with TransferEngine(provider="net", bind_host="127.0.0.1") as engine, \
            TransferEngine(provider="net", bind_host="127.0.0.1") as other:
        mr = engine.register(buf)
        if engine.engine_stats()["lock_refused"]:
            pytest.skip("this process may not lock pages (RLIMIT_MEMLOCK without CAP_IPC_LOCK)")
        assert vm_locked_bytes() - before >= buf.nbytes
        # Another engine of this process over the same pages: one munlock would free both.
        other_mr = other.register(buf[MIB:])
        engine.deregister(mr)
        assert vm_locked_bytes() - before >= buf.nbytes - MIB, "the other registration's pages were unlocked"
        other.deregister(other_mr)
        assert vm_locked_bytes() == before
        engine.register(buf)  # left registered: close() must give it back
    assert vm_locked_bytes() == before
    assert buf.sum() == 0  # the buffer outlives its engines, untouched


def test_lock_on_register_off_locks_nothing() -> None:
    before = vm_locked_bytes()
    buf = np.zeros(4 * MIB, dtype=np.uint8)
    with TransferEngine(provider="net", bind_host="127.0.0.1", lock_on_register=False) as engine:
        engine.register(buf)
        assert vm_locked_bytes() == before
        assert engine.engine_stats()["lock_refused"] == 0
