"""libfabric's registration caches are off in every process that loads kvxfer, so a
registration kvxfer closes (a per-reservation window) is revoked, never kept for reuse.

The caches matter on providers that pin memory (verbs, efa), which this machine lacks; what
is checked here is that libfabric itself, at its first call, reads the settings that turn
them off (its info log names each variable it read), and that a user's own value is kept
with a warning."""

from __future__ import annotations

import os
import subprocess
import sys

from kvxfer.transfer.native_library import REGISTRATION_CACHE_OFF, registration_caches_off

# A fresh interpreter: libfabric reads its variables once per process.
_OPEN_ENGINE = """
import logging
logging.basicConfig(level=logging.WARNING)
from kvxfer.transfer.engine import TransferEngine
with TransferEngine("tcp", bind_host="127.0.0.1"):
    pass
"""
_START_TIMEOUT_S = 60.0


def run_engine_process(**extra_env: str) -> str:
    """stderr of a process that opens a tcp engine with libfabric's info log on."""
    env = {k: v for k, v in os.environ.items() if k not in REGISTRATION_CACHE_OFF}
    env.update(FI_LOG_LEVEL="info", **extra_env)
    proc = subprocess.run([sys.executable, "-c", _OPEN_ENGINE], env=env, capture_output=True, text=True,
                          timeout=_START_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_libfabric_reads_the_registration_cache_off_at_its_first_call() -> None:
    log = run_engine_process()
    assert "read string var mr_cache_monitor=disabled" in log, "libfabric's MR cache monitor was left on"
    assert "read long var mr_cache_max_count=0" in log, "libfabric's MR cache size was left at its default"


def test_a_cache_the_user_turns_on_is_kept_with_a_warning() -> None:
    log = run_engine_process(FI_MR_CACHE_MONITOR="userfaultfd")
    assert "read string var mr_cache_monitor=userfaultfd" in log
    assert "registration cache left on by FI_MR_CACHE_MONITOR=userfaultfd" in log


def test_registration_caches_off_sets_only_what_is_unset() -> None:
    environ = {"FI_MR_CACHE_MAX_COUNT": "0", "FI_EFA_MR_CACHE_ENABLE": "1"}
    assert registration_caches_off(environ) == ["FI_EFA_MR_CACHE_ENABLE=1"]
    assert environ == {"FI_MR_CACHE_MAX_COUNT": "0", "FI_EFA_MR_CACHE_ENABLE": "1",
                       "FI_MR_CACHE_MONITOR": "disabled"}
