"""Admission control: whether a request may start, and how long it may run.

A request is admitted only when (in this order) some compatible worker pair exists for its
model (else 503: waiting would not help until a worker registers), its id is not already in
flight (else 409: two answers under one id would be ambiguous to the client), and fewer than
``max_in_flight`` requests are running (else 429 with ``Retry-After``). Rejection is
immediate rather than queued: the client or its load balancer is better placed to back off
than a router holding sockets.

An id is in flight until its answer is delivered (:meth:`AdmissionTicket.release_id`), not
until the request's clean-up ends: a client reusing the id of a completed request at once
was answered 409 while the router still waited for a prefill reply. Workers never see the
client's id (the router mints one per attempt), so nothing else needs it unique.
"""

from __future__ import annotations

import time
from typing import Callable

from .directory import WorkerDirectory
from .openai_api import RouterError
from .policies import has_pair
from .settings import RouterSettings
from .telemetry import RouterTelemetry


class Deadline:
    """A point in monotonic time by which a request must be finished."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seconds = seconds
        self.started_at = clock()
        self.expires_at = self.started_at + seconds

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.expires_at - self._clock())

    def elapsed(self) -> float:
        """Seconds since the deadline was set."""
        return self._clock() - self.started_at

    @property
    def expired(self) -> bool:
        """Whether no time is left."""
        return self.remaining() <= 0.0


class AdmissionTicket:
    """An admitted request's slot; :meth:`release` frees it (idempotent)."""

    def __init__(self, controller: "AdmissionController", request_id: str, deadline: Deadline) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self._controller = controller
        self._released = False
        self._id_released = False

    @property
    def released(self) -> bool:
        """Whether the slot was given back."""
        return self._released

    def release_id(self) -> None:
        """The answer was delivered: the id may be used again, the slot stays taken."""
        if not self._id_released:
            self._id_released = True
            self._controller._release_id(self.request_id)

    def release(self) -> None:
        """Give the slot (and the id) back; later calls do nothing."""
        self.release_id()
        if not self._released:
            self._released = True
            self._controller._release_slot()


class AdmissionController:
    """Bounded in-flight admission with a per-request deadline.

    Used from the router's event loop only, so the bookkeeping needs no lock.
    """

    def __init__(self, settings: RouterSettings, directory: WorkerDirectory, telemetry: RouterTelemetry) -> None:
        self._settings = settings
        self._directory = directory
        self._telemetry = telemetry
        self._ids: set[str] = set()  # ids whose answer is not delivered yet
        self._slots_taken = 0  # admitted requests whose task has not ended
        #: The event loop's latest sample of its own lag in seconds (set by the lag
        #: sampler: time the loop's thread spent running, not time the host kept it waiting).
        self.loop_lag_s = 0.0

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return self._slots_taken

    @property
    def capacity(self) -> int:
        """``max_in_flight``."""
        return self._settings.max_in_flight

    def is_in_flight(self, request_id: str) -> bool:
        """Whether ``request_id`` is held by a request whose answer is not delivered yet."""
        return request_id in self._ids

    def _shed(self, request_id: str, message: str) -> RouterError:
        """A 429 with Retry-After for a request turned away because the router is full, counted."""
        self._telemetry.rejected(429)
        return RouterError(429, message, request_id=request_id, type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self._settings.retry_after_s)})

    def admit(self, request_id: str, model: str, *, needs_prefill: bool) -> AdmissionTicket:
        """Admit ``request_id`` or raise :class:`RouterError` (503, 409 or 429)."""
        # With the colocated fallback a decode worker alone can serve any request.
        needs_prefill = needs_prefill and not self._settings.colocated_fallback
        if not has_pair(self._directory, model, needs_prefill=needs_prefill):
            self._telemetry.rejected(503)
            what = "prefill+decode worker pair" if needs_prefill else "decode worker"
            raise RouterError(
                503,
                f"no compatible {what} available for model {model!r}",
                request_id=request_id,
                type="service_unavailable",
                code="no_worker_pair",
            )
        if request_id in self._ids:
            raise RouterError(
                409,
                "a request with this request_id is already in flight",
                request_id=request_id,
                param="request_id",
                code="duplicate_request_id",
            )
        if self._slots_taken >= self._settings.max_in_flight:
            raise self._shed(
                request_id, f"router is at its limit of {self._settings.max_in_flight} requests in flight; retry later")
        if self._slots_taken and self.loop_lag_s > self._settings.admission_max_loop_lag_s:
            # The loop is starved by the work in flight: a request admitted now would wait
            # on it past its own deadlines (connects, control tokens) and fail for the
            # router's own lag. With nothing in flight the lag is not ours to shed.
            raise self._shed(request_id,
                             f"router is overloaded (event loop {self.loop_lag_s:.2f} s behind); retry later")
        self._ids.add(request_id)
        self._slots_taken += 1
        self._telemetry.request_admitted()
        return AdmissionTicket(self, request_id, Deadline(self._settings.request_deadline_s))

    def _release_id(self, request_id: str) -> None:
        self._ids.discard(request_id)

    def _release_slot(self) -> None:
        self._slots_taken -= 1
