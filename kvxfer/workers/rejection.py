"""Why a worker refused or failed one request, in terms the service layer knows.

Services raise `RequestRejected` with a `Rejection`; only the HTTP layer
(`http_server.STATUS_OF`) turns a rejection into a status code, so the services stay
usable without HTTP (tests drive them directly, and another front end could too).
"""

from __future__ import annotations

from enum import Enum

from kvxfer.errors import KvxferError


class Rejection(str, Enum):
    """The reasons a worker turns a request down or fails it."""

    DRAINING = "draining"  # the worker is shutting down; try another
    BAD_REQUEST = "bad_request"  # a value the caller chose is out of range (empty prompt...)
    INVALID = "invalid"  # the request does not parse: wrong type, foreign descriptor
    CONFLICT = "conflict"  # the request id or its state does not allow this (taken, cancelled)
    OVERLOADED = "overloaded"  # no page, slot or queue room now; retry later
    UNKNOWN_REQUEST = "unknown_request"  # no such request id on this worker
    PUSH_FAILED = "push_failed"  # the KV push to the decoder failed
    DESTINATION_DOWN = "destination_down"  # the decoder stopped taking writes: the push failed at once
    KV_TIMEOUT = "kv_timeout"  # the KV did not arrive before its deadline
    INTEGRITY = "integrity"  # the landed KV failed its end-to-end check (kv.integrity)
    FAILED = "failed"  # the request failed on this worker (model error)


class RequestRejected(KvxferError):
    """A worker refused or failed a request; `reason` says why, the message says what;
    `retry_after_s`, when set, goes to the client as Retry-After."""

    def __init__(self, reason: Rejection, message: str, request_id: str | None = None,
                 retry_after_s: int | None = None) -> None:
        self.reason = reason
        self.request_id = request_id
        self.retry_after_s = retry_after_s
        super().__init__(message)
