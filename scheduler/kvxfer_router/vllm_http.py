"""The outgoing HTTP client of the vLLM legs: aiohttp, with kept-alive connections.

The two legs of every request through vLLM instances are on the way to the client's first
token, so the client's own cost counts: with stub instances that answer at once, httpx
(httpcore, h11, anyio) was most of the router's cost per request (benchmarks/README.md,
"The router's cost to a vLLM user"). aiohttp (installed with vLLM) parses HTTP
in C (llhttp) and keeps one connection pool for all instances; its connections stay open
between requests (keep-alive), so a leg pays no TCP connect. The kvxfer workers' control
calls keep their httpx client (`Dispatcher.client`): they are not on a vLLM user's path.

A response whose body was not read to its end is closed, never reused: cancelling a
leg closes its connection, which is how vLLM learns that the request was aborted.
"""

from __future__ import annotations

import asyncio

import aiohttp


class VllmLegClient:
    """One aiohttp session for the legs sent to vLLM instances, opened on first use (inside
    the event loop that serves the router) and closed with the router; at most
    ``max_connections`` connections to all instances together, each kept alive between
    requests."""

    def __init__(self, max_connections: int, connect_timeout_s: float) -> None:
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """The open session (a new one after :meth:`aclose`, so a restarted app works)."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0,
                # Instances are found by the registry and reached by address: no DNS to cache.
                use_dns_cache=False, enable_cleanup_closed=False)
            self._session = aiohttp.ClientSession(
                connector=connector,
                # Each call sets its own read deadline; the connect one is common to all.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s),
                # Instances are reached directly: an HTTP(S)_PROXY in the environment must not
                # reroute loopback or pod-to-pod calls.
                trust_env=False,
                # Answers are relayed as their bytes: no cookie jar, no decompression.
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    async def aclose(self) -> None:
        """Close every connection; later calls open a new session."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()
            # aiohttp closes the transports on the next loop turns.
            await asyncio.sleep(0)


__all__ = ["VllmLegClient"]
