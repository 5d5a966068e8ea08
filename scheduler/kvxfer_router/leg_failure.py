"""How one leg of a request fails: :class:`LegFailure`, raised by every leg type.

A failure names the worker and the stage, and says what the lifecycle needs to decide
between a retry on another pair, a client error and overload (``dispatch``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from .directory import WorkerView

# Only the first bytes of a worker's error body go into our error message: enough for
# FastAPI's {"detail": ...}, and a misbehaving worker cannot blow up our logs.
_MAX_DETAIL_CHARS = 300


class LegFailure(Exception):
    """One leg (a call to one worker) failed. ``stage`` is ``reserve``, ``prefill`` or
    ``generate`` (``kvxfer.metrics.RETRY_STAGES``); ``timed_out`` marks a timeout;
    ``rejected`` marks a worker refusing the request's own content (a client error: no retry);
    ``never_sent`` that the connection was never made, so the worker never saw the call;
    ``status`` is the worker's HTTP status (None without an answer), ``worker_reason`` the
    ``reason`` of its error body and ``retry_after_s`` its Retry-After, when it sent them."""

    def __init__(self, request_id: str, worker: WorkerView, stage: str, reason: str, *, timed_out: bool = False,
                 rejected: bool = False, never_sent: bool = False, status: int | None = None,
                 worker_reason: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(f"request {request_id}: {worker.role} worker {worker.worker_id} failed at {stage}: {reason}")
        self.request_id = request_id
        self.worker = worker
        self.stage = stage
        self.reason = reason
        self.timed_out = timed_out
        self.rejected = rejected
        self.never_sent = never_sent
        self.status = status
        self.worker_reason = worker_reason
        self.retry_after_s = retry_after_s

    @classmethod
    def from_answer(cls, request_id: str, worker: WorkerView, stage: str, path: str, status: int, text: str,
                    headers: Mapping[str, str], *, rejected: bool) -> LegFailure:
        """The failure a worker's error answer (status >= 400) stands for."""
        return cls(request_id, worker, stage, f"POST {path} answered {status}: {short_detail(text)}",
                   rejected=rejected, status=status, worker_reason=_reason(text),
                   retry_after_s=_retry_after(headers))


def short_detail(text: str) -> str:
    """A worker's error body, shortened; FastAPI's ``{"detail": ...}`` is unwrapped."""
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict) and "detail" in parsed:
            text = str(parsed["detail"])
    except ValueError:
        pass
    return text[:_MAX_DETAIL_CHARS]


def _reason(text: str) -> str | None:
    """The ``reason`` of a kvxfer worker's error body, if it has one."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    reason = parsed.get("reason") if isinstance(parsed, dict) else None
    return reason if isinstance(reason, str) else None


def _retry_after(headers: Mapping[str, str]) -> int | None:
    """A worker's Retry-After in whole seconds (None when absent or not a number)."""
    value = headers.get("retry-after")
    return int(value) if value is not None and value.strip().isdigit() else None


__all__ = ["LegFailure", "short_detail"]
