"""One desktop socket: an outbound queue drained by its own writer task, so a slow client never
blocks the broker consumer or other clients; events that arrive before the hello + replay are
held back and sent right after them, so the client sees hello first and loses nothing.

The writer task runs only while there is something to send: an idle socket holds an empty deque (0.6 KB), not
an `asyncio.Queue` (3.3 KB) and a parked task (1.1 KB), ~38 MB less on a hub of 10,000 sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from aiohttp import web

from libs.telemetry import metrics
from services.dispatch_hub.auth import ClientPrincipal

log = logging.getLogger("hub.ws")

# Live events queued for one socket at most; a client this far behind is closed (1013) and reconnects for a
# replay from the database. The hello and replay go out whatever this says (the replay has its own limit).
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
        self._outbound: deque[str] = deque()
        self._max_outbound = max_outbound
        self._writer: asyncio.Task[None] | None = None
        self._stopped = False
        self.overflowed = False
        # Set once the hub decided to close it (replaced, revoked, silent): it no longer counts against the
        # client's socket limit and is not closed twice.
        self.closing = False
        self._closer: asyncio.Task[bool] | None = None

    @property
    def client_id(self) -> str:
        return str(self.principal.client_id)

    @property
    def writing(self) -> bool:
        """Is a writer task sending the queue (it starts with the first message to send, ends when it is empty)?"""
        return self._writer is not None

    def start(self) -> None:
        """Sending may begin (the writer task itself starts with the first message to send)."""
        self._stopped = False

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
        self._outbound.extend(first)
        for text in self._held:
            self._put(text)
        self._held.clear()
        self.live = True
        self._kick()

    def _put(self, text: str) -> None:
        if len(self._outbound) >= self._max_outbound:
            # A client this far behind reconnects and gets a replay from the database instead.
            if not self.overflowed:
                self.overflowed = True
                log.warning("outbound queue full; closing the socket", extra={"client_id": self.client_id})
                self._closer = asyncio.create_task(self.ws.close(code=1013, message=b"too slow; reconnect"))
            return
        self._outbound.append(text)
        self._kick()

    def _kick(self) -> None:
        if self._writer is None and self._outbound and not self._stopped:
            self._writer = asyncio.create_task(self._write_loop(), name=f"ws-writer-{self.client_id}")

    async def _write_loop(self) -> None:
        """Until the queue is empty (one writer at a time, so the order is the queue's)."""
        try:
            while self._outbound:
                text = self._outbound.popleft()
                try:
                    await self.ws.send_str(text)
                    metrics.websocket_messages_total.inc(direction="out", kind="text")
                except (ConnectionError, RuntimeError):
                    self._outbound.clear()
                    return  # closing or closed: the handler's receive loop ends and cleans up
        finally:
            self._writer = None

    async def stop(self) -> None:
        """No new sends; what is queued goes out within 2 s, or is dropped."""
        self._stopped = True
        writer = self._writer
        if writer is None or writer.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(writer), timeout=2.0)
        except TimeoutError:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
