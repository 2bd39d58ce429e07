"""`CoalescingTransport` over a real asyncio socket transport (a connected socket pair):
what one loop iteration writes leaves in one write, closing sends what is held first,
and nothing is written after the connection closes. The proxy's own tests run every
response and stream through it (`agents.serve` serves with it)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from agents.serving.http_protocol import CoalescingHttpProtocol, CoalescingTransport, http_protocol
from envs.connections import TimedHttpProtocol


async def _transport_pair() -> tuple[asyncio.Transport, socket.socket, list[bytes]]:
    """A real transport on one end of a socket pair, the other end, and the writes that
    reach the real transport."""
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    writes: list[bytes] = []
    real_write = transport.write

    def spy(data: Any) -> None:
        writes.append(bytes(data))
        real_write(data)

    transport.write = spy  # type: ignore[method-assign]
    theirs.setblocking(False)
    return transport, theirs, writes


async def _received(peer: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        chunk = await loop.sock_recv(peer, size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_writes_of_one_iteration_leave_as_one_write():
    async def run() -> None:
        real, peer, writes = await _transport_pair()
        coalescing = CoalescingTransport(real)
        coalescing.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        coalescing.write(b"hi")
        assert writes == [] and coalescing.get_write_buffer_size() == 40
        await asyncio.sleep(0)
        assert writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"]
        assert await _received(peer, 40) == writes[0]
        coalescing.write(b"data: 1\n\n")
        await asyncio.sleep(0)
        coalescing.write(b"data: 2\n\n")
        await asyncio.sleep(0)
        assert writes[1:] == [b"data: 1\n\n", b"data: 2\n\n"]  # later iterations, own writes
        coalescing.close()
        peer.close()

    asyncio.run(run())


def test_close_sends_what_is_held_then_closes():
    async def run() -> None:
        real, peer, writes = await _transport_pair()
        coalescing = CoalescingTransport(real)
        coalescing.write(b"last words")
        coalescing.close()
        assert writes == [b"last words"] and coalescing.is_closing()
        assert await _received(peer, 100) == b"last words"  # then the end of the stream
        await asyncio.sleep(0)  # the flush scheduled by the write finds nothing to send
        assert writes == [b"last words"]
        peer.close()

    asyncio.run(run())


def test_nothing_is_written_once_the_connection_is_closing():
    async def run() -> None:
        real, peer, writes = await _transport_pair()
        coalescing = CoalescingTransport(real)
        coalescing.write(b"too late")
        real.close()
        await asyncio.sleep(0)
        assert writes == []
        coalescing.write(b"later still")
        coalescing.abort()
        await asyncio.sleep(0)
        assert writes == []
        peer.close()

    asyncio.run(run())


def test_the_proxys_protocol_is_the_timed_one_with_writes_coalesced():
    proxy = http_protocol(3.0, 4.0)
    assert issubclass(proxy, CoalescingHttpProtocol) and issubclass(proxy, TimedHttpProtocol)
    assert (proxy.idle_timeout_s, proxy.request_timeout_s) == (3.0, 4.0)
