"""A time limit on request headers for the router's public port.

uvicorn bounds an idle kept-alive connection (`timeout_keep_alive`) but not a request whose
headers trickle in: a probe held 6 connections for 60 s by sending a header byte now and
then, and enough of them exhaust file descriptors. `header_timeout_protocol` wraps
uvicorn's own HTTP protocol class: a timer starts when a connection opens, or when the first
bytes of a later request arrive on a kept-alive connection, and unless that request's
headers are complete when it fires, the connection gets a 408 and is closed. Both of
uvicorn's parsers (httptools and h11) start a new request cycle (`cycle`) exactly when a
request's headers are complete, which is what the timer checks; the body has its own limit
(`request_body_timeout_s`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

_408_BODY = b"request headers not received in time"
_RESPONSE_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                 b"content-length: " + str(len(_408_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + _408_BODY)


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a `header_timeout_s` limit on request headers
    (pass it as `uvicorn.Config(http=...)`)."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be positive, got {header_timeout_s}")
    base: Any = AutoHTTPProtocol

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        """uvicorn's protocol, closing connections whose request headers are late."""

        _header_timer: asyncio.TimerHandle | None = None
        _header_cycle: Any = None  # the cycle the armed timer waits to see replaced

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            # Bytes after a finished response begin the next request: its headers are timed too.
            idle = self.cycle is None or self.cycle.response_complete
            if idle and (self._header_timer is None or self._header_cycle is not self.cycle):
                self._arm_header_timer()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_cycle = self.cycle  # a new request replaces it once its headers are in
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_due, self.cycle)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_due(self, waiting_for: Any) -> None:
            self._header_timer = None
            if self.cycle is not waiting_for or self.transport.is_closing():
                return  # the headers came in time
            self.transport.write(_RESPONSE_408)
            self.transport.close()

    return HeaderTimeoutProtocol
