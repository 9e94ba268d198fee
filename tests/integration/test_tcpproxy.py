"""The tests' TCP proxy (tests/support/tcpproxy.py): a cut drops every connection, also one whose upstream side is
still being opened, and refuses new ones until the restore; the port stays the proxy's in between."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from tests.support import tcpproxy
from tests.support.tcpproxy import TcpProxy


async def _echo_hi(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"hi")
    await writer.drain()
    writer.close()


async def test_a_cut_drops_a_connection_accepted_while_its_upstream_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    target = await asyncio.start_server(_echo_hi, "127.0.0.1", 0)
    proxy = TcpProxy("127.0.0.1", target.sockets[0].getsockname()[1])
    await proxy.start()
    opening = asyncio.Event()
    open_connection = asyncio.open_connection

    async def slow_open(*args: object, **kwargs: object) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        opening.set()
        await asyncio.sleep(0.3)  # the upstream connect of a loaded box, a duration not a wait
        return await open_connection(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tcpproxy.asyncio, "open_connection", slow_open)
    try:
        reader, writer = await open_connection("127.0.0.1", proxy.port)
        await asyncio.wait_for(opening.wait(), 5)
        await proxy.cut()  # while the proxy still opens this connection's upstream side
        monkeypatch.undo()
        assert await asyncio.wait_for(reader.read(2), 5) == b""  # dropped, not carried through the cut
        writer.transport.abort()
        with pytest.raises(ConnectionRefusedError):
            await open_connection("127.0.0.1", proxy.port)
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", proxy.port))
        assert taken.value.errno == errno.EADDRINUSE  # the port is held for the restore
        await proxy.restore()
        reader, writer = await open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(2), 5) == b"hi"
        writer.transport.abort()
    finally:
        await proxy.close()
        target.close()
        await target.wait_closed()
        await asyncio.sleep(0)  # the aborted transports close on the loop's next turn


async def test_a_cut_drops_a_connection_accepted_before_it_whose_handler_starts_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener accepted the connection before the cut, but its handler ran only after the cut had aborted every
    connection it knew (collect-now e2e (d) once got the event it must only get on reconnect this way)."""
    target = await asyncio.start_server(_echo_hi, "127.0.0.1", 0)
    cut_done = asyncio.Event()
    handle = TcpProxy._handle

    async def late(self: TcpProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cuts: int) -> None:
        await cut_done.wait()
        await handle(self, reader, writer, cuts)

    monkeypatch.setattr(TcpProxy, "_handle", late)
    proxy = TcpProxy("127.0.0.1", target.sockets[0].getsockname()[1])
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        await proxy.cut()
        cut_done.set()
        assert await asyncio.wait_for(reader.read(2), 5) == b""  # dropped, not carried through the cut
        writer.transport.abort()
    finally:
        await proxy.close()
        target.close()
        await target.wait_closed()
        await asyncio.sleep(0)  # the aborted transports close on the loop's next turn
