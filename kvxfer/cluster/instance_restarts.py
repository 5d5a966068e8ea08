"""When `kvxfer up` restarts a worker or vLLM instance that died, and when it gives up.

A dead instance is restarted under its own name after `restart_backoff_s`, doubled for each
further restart of the same instance (a checkpoint that cannot load, or a machine out of
memory, would otherwise be restarted in a tight loop), at most `max_restarts` times; after
that, or with `max_restarts` 0, it stays down and `kvxfer up` says so. The book only
decides; `LocalCluster.supervise` reaps, reports and starts the processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class RestartSettings(BaseModel):
    """How `kvxfer up` restarts an instance that died (`--max-restarts`, `--restart-backoff-s`)."""

    model_config = ConfigDict(extra="forbid")

    max_restarts: int = Field(3, ge=0, description="restarts of one instance before it is left down; 0: never")
    restart_backoff_s: float = Field(
        5.0, ge=0, description="wait before an instance's first restart, seconds; doubled for each further one")


@dataclass(frozen=True)
class RestartDecision:
    """What happens to an instance that just died: restarted after `delay_s` as restart
    number `restart` (of `max_restarts`), or (`delay_s` None) left down."""

    name: str
    restart: int
    max_restarts: int
    delay_s: float | None

    def describe(self) -> str:
        """One line for the console."""
        if self.delay_s is not None:
            return f"{self.name}: restarting in {self.delay_s:g} s (restart {self.restart} of {self.max_restarts})"
        if self.max_restarts == 0:
            return f"{self.name}: not restarted (restarts are off: --max-restarts 0); the others keep serving"
        return (f"{self.name}: not restarted again: it died after all {self.max_restarts} restarts "
                "(--max-restarts); the others keep serving")


class RestartBook:
    """Counts each instance's restarts and holds the ones that are due later."""

    def __init__(self, settings: RestartSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._restarts: dict[str, int] = {}
        self._due_at: dict[str, float] = {}

    def died(self, name: str) -> RestartDecision:
        """Instance `name` died: schedule its restart, or leave it down when none is left."""
        done = self._restarts.get(name, 0)
        limit = self.settings.max_restarts
        if done >= limit:
            return RestartDecision(name, done, limit, None)
        delay_s = self.settings.restart_backoff_s * (2 ** done)
        self._restarts[name] = done + 1
        self._due_at[name] = self._clock() + delay_s
        return RestartDecision(name, done + 1, limit, delay_s)

    def due(self) -> list[str]:
        """Instances whose restart time has come (each returned once)."""
        now = self._clock()
        names = [name for name, at in self._due_at.items() if at <= now]
        for name in names:
            del self._due_at[name]
        return names

    def restarts(self, name: str) -> int:
        """How many times `name` was restarted so far."""
        return self._restarts.get(name, 0)

    @property
    def pending(self) -> bool:
        """Whether a restart is scheduled and not yet due."""
        return bool(self._due_at)
