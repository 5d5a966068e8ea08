"""Bounded waiting for tests: every wait has a deadline and says what it waited for."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable


def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0, what: str = "condition",
               interval_s: float = 0.02) -> Any:
    """Polls `predicate` until it returns something truthy and returns that value.

    Raises AssertionError naming `what` and the last value after `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last value: {value!r})")
        time.sleep(interval_s)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of process `pid` ("T": stopped), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def wait_until_stopped(pid: int, what: str, timeout_s: float = 5.0) -> None:
    """Waits until the kernel shows process `pid` stopped: a SIGSTOP returns before the
    process has stopped running, and it may still take work meanwhile."""
    wait_until(lambda: process_state(pid) == "T", timeout_s, f"{what} ({pid}) to stop")
