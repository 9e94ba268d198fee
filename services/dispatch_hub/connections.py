"""One desktop socket: an outbound queue drained by its own writer task, so a slow client never
blocks the broker consumer or other clients; events that arrive before the hello + replay are
held back and sent right after them, so the client sees hello first and loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import web

from libs.telemetry import metrics
from services.dispatch_hub.auth import ClientPrincipal

log = logging.getLogger("hub.ws")

MAX_OUTBOUND = 2000


class Connection:
    def __init__(self, ws: web.WebSocketResponse, principal: ClientPrincipal, *,
                 max_outbound: int = MAX_OUTBOUND) -> None:
        self.ws = ws
        self.principal = principal
        self.live = False
        self.last_seen = time.monotonic()
        self.opened_at = self.last_seen
        self._held: list[str] = []
        self._outbound: asyncio.Queue[str | None] = asyncio.Queue(maxsize=max_outbound)
        self._writer: asyncio.Task[None] | None = None
        self.overflowed = False
        # Set once the hub decided to close it (replaced, revoked, silent): it no longer counts against the
        # client's socket limit and is not closed twice.
        self.closing = False
        self._closer: asyncio.Task[bool] | None = None

    @property
    def client_id(self) -> str:
        return str(self.principal.client_id)

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name=f"ws-writer-{self.client_id}")

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def deliver(self, text: str) -> None:
        """Queue an event for the socket (held back until the hello and replay went out)."""
        if not self.live:
            self._held.append(text)
            return
        self._put(text)

    def go_live(self, first: list[str]) -> None:
        """Send `first` (hello, replay), then everything held back, then live events, in that order."""
        for text in [*first, *self._held]:
            self._put(text)
        self._held.clear()
        self.live = True

    def _put(self, text: str) -> None:
        try:
            self._outbound.put_nowait(text)
        except asyncio.QueueFull:
            # A client this far behind reconnects and gets a replay from the database instead.
            if not self.overflowed:
                self.overflowed = True
                log.warning("outbound queue full; closing the socket", extra={"client_id": self.client_id})
                self._closer = asyncio.create_task(self.ws.close(code=1013, message=b"too slow; reconnect"))

    async def _write_loop(self) -> None:
        while True:
            text = await self._outbound.get()
            if text is None:
                return
            try:
                await self.ws.send_str(text)
                metrics.websocket_messages_total.inc(direction="out", kind="text")
            except (ConnectionError, RuntimeError):
                return  # closing or closed: the handler's receive loop ends and cleans up

    async def stop(self) -> None:
        if self._writer is None:
            return
        if not self._writer.done():
            with contextlib.suppress(asyncio.QueueFull):
                self._outbound.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(self._writer), timeout=2.0)
            except TimeoutError:
                self._writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._writer
