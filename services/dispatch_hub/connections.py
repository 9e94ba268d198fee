"""One desktop socket: an outbound queue drained by its own writer (started eagerly: a task only while a send
waits for a slow socket), so a slow client never blocks the broker consumer or other clients; events that arrive
before the hello + replay are held back and sent right after them, so the client sees hello first and loses nothing.

The writer task runs only while there is something to send: an idle socket holds an empty deque (0.6 KB), not
an `asyncio.Queue` (3.3 KB) and a parked task (1.1 KB), ~38 MB less on a hub of 10,000 sockets.

WebSocket RED: each queued frame carries the monotonic time its dispatch event reached the hub's consumer (0 for
frames the hub makes itself: hello, replay, acks), so the writer observes the delivery latency with one histogram
observe a frame; the hello's own latency is measured from the upgrade; failed sends and abnormal closes are
counted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque

from aiohttp import web

from libs.contracts.wire import HUB_DRAINING_CLOSE
from libs.eager import start_eagerly
from libs.telemetry import metrics
from services.dispatch_hub.auth import ClientPrincipal

log = logging.getLogger("hub.ws")

# Live events queued for one socket at most; a client this far behind is closed (1013) and reconnects for a
# replay from the database. The hello and replay go out whatever this says (the replay has its own limit).
MAX_OUTBOUND = 2000
TOO_SLOW_CLOSE = 1013
# How a socket may end without an error: closed normally (1000), going away (1001: a client quitting, a hub
# shutting down) or deliberately by the hub (gateway.py: 4401 token rotated, 4403 client disabled, 4409 replaced,
# 4503 the hub is draining).
# Any other code is an abnormal close, counted by code; a code outside ABNORMAL_CODES is counted as "other" (a
# client chooses its own close code: it must not make a new series each).
NORMAL_CLOSES = frozenset({1000, 1001, 4401, 4403, 4409, HUB_DRAINING_CLOSE})
ABNORMAL_CODES = frozenset({1002, 1003, 1006, 1007, 1008, 1009, 1010, 1011, TOO_SLOW_CLOSE, 4408})
DROPPED = 1006  # no close frame: the connection was lost
_SENT_TEXT = metrics.websocket_messages_total.bound(direction="out", kind="text")  # counted a frame sent


class Connection:
    def __init__(self, ws: web.WebSocketResponse, principal: ClientPrincipal, *,
                 max_outbound: int = MAX_OUTBOUND, capabilities: frozenset[str] = frozenset()) -> None:
        self.ws = ws
        self.capabilities = capabilities  # what the hub granted of what the upgrade asked (hello.capabilities)
        self.principal = principal
        self.socket_id = uuid.uuid4()  # its row in hub_sockets (the fleet-wide socket cap)
        self.live = False
        self.last_seen = time.monotonic()
        self.opened_at = self.last_seen
        self._held: list[tuple[str, float]] = []
        self._outbound: deque[tuple[str, float]] = deque()
        self._hello_pending = True
        self._max_outbound = max_outbound
        # The writer task while a send waits for the socket to drain; `_writing` while the write loop runs at all
        # (eagerly, in the caller's turn, or in that task).
        self._writer: asyncio.Task[None] | None = None
        self._writing = False
        self._send_failed = False  # a send failed: the socket is closing, nothing more is sent to it
        self._stopped = False
        self.overflowed = False
        # Set once the hub decided to close it (replaced, revoked, silent): it no longer counts against the
        # client's socket limit and is not closed twice.
        self.closing = False
        self._closer: asyncio.Task[bool] | None = None
        # The code the hub closed it with, if the hub did (the socket's own close_code is then the client's reply).
        self.closed_with: int | None = None
        self._close_counted = False

    @property
    def client_id(self) -> str:
        return str(self.principal.client_id)

    @property
    def writing(self) -> bool:
        """Is a writer sending the queue (it starts with the first message to send, ends when it is empty)?"""
        return self._writing

    def start(self) -> None:
        """Sending may begin (the writer task itself starts with the first message to send)."""
        self._stopped = False

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def deliver(self, text: str, arrived: float = 0.0) -> None:
        """Queue an event for the socket (held back until the hello and replay went out); `arrived`: the monotonic
        time a dispatch event reached the hub (its frame's delivery latency is measured from it)."""
        if not self.live:
            self._held.append((text, arrived))
            return
        self._put(text, arrived)

    def go_live(self, first: list[str]) -> None:
        """Send `first` (hello, replay), then everything held back, then live events, in that order."""
        self._outbound.extend((text, 0.0) for text in first)
        for text, arrived in self._held:
            self._put(text, arrived)
        self._held.clear()
        self.live = True
        self._kick()

    def _put(self, text: str, arrived: float) -> None:
        if self._send_failed:
            return  # the socket is gone (its handler cleans up); the client's replay on reconnect has it
        if len(self._outbound) >= self._max_outbound:
            # A client this far behind reconnects and gets a replay from the database instead.
            if not self.overflowed:
                self.overflowed = True
                log.warning("outbound queue full; closing the socket", extra={"client_id": self.client_id})
                self.closed_with = TOO_SLOW_CLOSE
                self._closer = asyncio.create_task(self.ws.close(code=TOO_SLOW_CLOSE, message=b"too slow; reconnect"))
            return
        self._outbound.append((text, arrived))
        self._kick()

    def _kick(self) -> None:
        if not self._writing and self._outbound and not self._stopped:
            # Started eagerly: the queue goes out now, and a writer task exists only while a send waits for the
            # socket to drain (a fan-out's frame fits the send buffer: no task a socket; libs/eager.py).
            self._writer = start_eagerly(self._write_loop(), name="ws-writer")

    async def _write_loop(self) -> None:
        """Until the queue is empty (one writer at a time, so the order is the queue's)."""
        self._writing = True
        try:
            while self._outbound:
                text, arrived = self._outbound.popleft()
                try:
                    await self.ws.send_str(text)
                except (ConnectionError, RuntimeError):
                    metrics.desktop_ws_send_failures_total.inc()
                    self._outbound.clear()
                    self._send_failed = True
                    return  # closing or closed: the handler's receive loop ends and cleans up
                _SENT_TEXT.inc()
                if arrived:
                    metrics.desktop_ws_delivery_seconds.observe(time.monotonic() - arrived)
                elif self._hello_pending:  # the first frame of a socket is its hello
                    self._hello_pending = False
                    metrics.desktop_ws_hello_seconds.observe(time.monotonic() - self.opened_at)
        finally:
            self._writer = None
            self._writing = False

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

    def count_close(self) -> int:
        """Once the socket is closed: how it ended (the hub's code if the hub closed it, else the socket's; a socket
        without one was dropped), counted in desktop_ws_abnormal_closes_total unless normal. Counts once."""
        code = self.closed_with if self.closed_with is not None else self.ws.close_code
        if code is None:
            code = DROPPED
        if not self._close_counted and code not in NORMAL_CLOSES:
            metrics.desktop_ws_abnormal_closes_total.inc(code=str(code) if code in ABNORMAL_CODES else "other")
        self._close_counted = True
        return code

