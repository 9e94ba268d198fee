"""A TCP proxy that a test can cut and restore, to take a real broker "down" for one client."""

from __future__ import annotations

import asyncio
import contextlib
import socket


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._held: socket.socket | None = None
        self._cuts = 0

    async def start(self, port: int = 0) -> None:
        # SO_REUSEPORT: while cut, the port is held by a socket bound to it (not listening, so connections are
        # refused); a restore listens beside it, then lets it go. Closed and bound again, the port was free for a
        # few seconds, and another test's service or outgoing connection on the box could take it meanwhile.
        # Each connection carries the cut count of the server that accepted it: one accepted just before a cut whose
        # handler only ran after it (during the cut's wait for the listener to close) is dropped like the others.
        cuts = self._cuts
        self._server = await asyncio.start_server(lambda r, w: self._handle(r, w, cuts), "127.0.0.1",
                                                  port or self.port, reuse_port=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._release_port()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cuts: int) -> None:
        # A connection accepted before a cut is dropped by it, also while its upstream connection is still being
        # opened, or when its handler starts only after the cut: one that slipped through stayed up for the whole
        # "outage" (an HTTP client kept it alive and reused it, e.g. for a WebSocket upgrade through a proxy that
        # was cut).
        if self._cuts != cuts:
            writer.transport.abort()
            return
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        if self._cuts != cuts:
            up_writer.transport.abort()
            writer.transport.abort()
            return
        self._writers.add(up_writer)
        a = asyncio.create_task(self._pipe(reader, up_writer))
        b = asyncio.create_task(self._pipe(up_reader, writer))
        self._pipes.update({a, b})
        a.add_done_callback(self._pipes.discard)
        b.add_done_callback(self._pipes.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _hold_port(self) -> None:
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", self.port))
        self._held = held

    def _release_port(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    async def cut(self) -> None:
        """Stop accepting (new connections are refused) and drop every open connection; the port stays this proxy's."""
        self._cuts += 1
        if self._server is not None:
            self._hold_port()
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()
        for task in list(self._pipes):
            task.cancel()

    async def restore(self) -> None:
        await self.start(self.port)

    async def close(self) -> None:
        await self.cut()
        self._release_port()
