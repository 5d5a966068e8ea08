"""The socket a worker's HTTP server listens on (kvxfer.workers.http_server.bind_listener).

uvicorn serves it through asyncio's `loop.create_server(sock=...)`, as here. What is
checked is what the server side of each accepted connection looks like: Nagle's algorithm
off. With it on, every call to a worker waited 40 ms for the client's delayed ACK between
the response's head and body (benchmarks/README.md, "Worker HTTP round trips").
"""

from __future__ import annotations

import asyncio
import socket

from kvxfer.workers.http_server import bind_listener

ACCEPT_WAIT_S = 5.0


async def server_side_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY of the server's end of one connection accepted on `listener`."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[int] = loop.create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await loop.create_server(Probe, sock=listener)
    try:
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        try:
            return await asyncio.wait_for(accepted, ACCEPT_WAIT_S)
        finally:
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_connections_a_worker_accepts_send_without_waiting_for_acks() -> None:
    listener = bind_listener("127.0.0.1", 0)
    assert listener.getsockname()[1] != 0
    assert asyncio.run(server_side_nodelay(listener)) != 0


def test_a_listener_without_its_protocol_named_would_keep_nagle_on() -> None:
    # The cause, kept as a guard on the test above: asyncio leaves Nagle on for sockets
    # made with protocol 0, which is how the worker's listener used to be made.
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    plain.bind(("127.0.0.1", 0))
    assert asyncio.run(server_side_nodelay(plain)) == 0
