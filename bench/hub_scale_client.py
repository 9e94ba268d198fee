"""A lean desktop fleet for `bench hub_scale`: thousands of WebSocket clients in one process, each only
authenticating, reading its hello and replay, heartbeating at the hub's announced interval, answering pings and
recording when events arrive. No leases, no tasks: what a hub holds for an idle desktop.

Each client is an `asyncio.Protocol` speaking just enough RFC 6455 (the upgrade request, unmasked server frames,
masked client frames), not an aiohttp session: with 2,000 aiohttp clients a process, the fleet took more CPU than
the hub it measured on the benchmark's two cores (the handshakes, and a heartbeat loop over every client).

    python -m bench.hub_scale_client CONFIG.json

CONFIG: {"hubs": ["http://127.0.0.1:PORT", ...], "tokens": [...], "offset": N}. A simulated load balancer: desktop i
of the process goes to hub (offset + i) % len(hubs) first, and after a refused connection or handshake, or a drain,
to one of the other hubs picked at random, as a Kubernetes Service picks one of its ready endpoints for each new
connection (always the next hub would pile every drained hub's clients onto one replica during a rolling restart,
20,000 on the last of four, which no load balancer does). A hub that drains (close code 4503) names the delay after
which its desktop reconnects; others are reconnected with the simulator's backoff. Commands arrive on stdin as JSON
lines, answers go to stdout as JSON lines; clocks are `time.time()`, so the benchmark compares them across processes
on one machine. Commands: connect, status, arrivals, arrived, lag (how late this process's event loop ran since the
last `lag`), stop.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import random
import resource
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import msgspec
import uvloop

from libs.contracts.wire import HUB_DRAINING_CLOSE, reconnect_delay_ms
from tools.desktop_sim.rules import backoff_delay

# The desktop simulator's reconnect policy (tools/desktop_sim/client.py): exponential, jittered, 0.1 s to 5 s.
RECONNECT_BASE_S = 0.1
RECONNECT_MAX_S = 5.0
HANDSHAKE_TIMEOUT_S = 30.0
# The `lag` command's probe: a timer every LAG_EVERY_S; how late it fires is the process's event-loop lag (a
# starved fleet process stamps its arrivals late, which would read as a slow service).
LAG_EVERY_S = 0.05
LAG_SAMPLES = 20_000
TEXT, CLOSE, PING, PONG = 0x1, 0x8, 0x9, 0xA


class Event(msgspec.Struct):
    """The fields of a hub message this fleet looks at."""

    type: str = ""
    task_id: str | None = None
    replayed_available: int = 0
    replayed_controls: int = 0
    heartbeat_interval_s: float = 10.0


_decode = msgspec.json.Decoder(Event).decode


def client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (RFC 6455, section 5.3); payloads here are short (< 126 bytes)."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return struct.pack("!BB", 0x80 | opcode, 0x80 | len(payload)) + mask + masked


HEARTBEAT = client_frame(TEXT, b'{"type":"heartbeat"}')


@dataclass(slots=True)
class Desktop:
    token: str
    home: int = 0  # the hub the load balancer sends it to first
    # When the current socket's hello and its whole replay had arrived (0: not ready).
    ready_at: float = 0.0
    hellos: int = 0
    connected: bool = False
    # task_id -> first arrival (wall clock) of a task_available / task_control.
    arrivals: dict[str, float] = field(default_factory=dict)


class Socket(asyncio.Protocol):
    """One desktop's WebSocket: the upgrade, then frames; `done` resolves with how it ended."""

    def __init__(self, fleet: Fleet, desktop: Desktop, host: str) -> None:
        self.fleet, self.desktop, self.host = fleet, desktop, host
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.upgraded = False
        self.expected = -1  # replay messages still to come after the hello
        self.handshake_timer: asyncio.TimerHandle | None = None
        self.beat_timer: asyncio.TimerHandle | None = None
        self.reconnect_after_s: float | None = None  # what a draining hub's close named

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        key = base64.b64encode(os.urandom(16)).decode()
        self.transport.write((f"GET /api/desktop/ws HTTP/1.1\r\nHost: {self.host}\r\nUpgrade: websocket\r\n"
                         f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                         f"Authorization: Bearer {self.desktop.token}\r\n\r\n").encode())
        self.handshake_timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._timeout)

    def _timeout(self) -> None:
        if not self.upgraded:
            self._end("TimeoutError")

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.upgraded:
            head, sep, _ = bytes(self.buffer).partition(b"\r\n\r\n")
            if not sep:
                return
            status = head.split(b" ", 2)[1].decode() if b" " in head else "?"
            if status != "101":
                self._end(f"http_{status}")
                return
            del self.buffer[:len(head) + 4]
            self.upgraded = True
            self.desktop.connected = True
        self._frames()

    def _frames(self) -> None:
        buffer = self.buffer
        while len(buffer) >= 2:
            opcode, length, start = buffer[0] & 0x0F, buffer[1] & 0x7F, 2
            if length == 126:
                if len(buffer) < 4:
                    return
                length, start = struct.unpack_from("!H", buffer, 2)[0], 4
            elif length == 127:
                if len(buffer) < 10:
                    return
                length, start = struct.unpack_from("!Q", buffer, 2)[0], 10
            if len(buffer) < start + length:
                return
            payload = bytes(buffer[start:start + length])
            del buffer[:start + length]
            if opcode == TEXT:
                self._message(payload)
            elif opcode == PING and self.transport is not None:
                self.transport.write(client_frame(PONG, payload))
            elif opcode == CLOSE:
                if len(payload) >= 2 and struct.unpack_from("!H", payload)[0] == HUB_DRAINING_CLOSE:
                    delay_ms = reconnect_delay_ms(payload[2:].decode(errors="replace"))
                    self.reconnect_after_s = None if delay_ms is None else delay_ms / 1000
                    self.fleet.drained += 1
                self._end("closed")
                return

    def _message(self, payload: bytes) -> None:
        now = time.time()
        event = _decode(payload)
        desktop = self.desktop
        if event.type == "hello":
            desktop.hellos += 1
            self.expected = event.replayed_available + event.replayed_controls
            # spread the fleet's heartbeats over the interval
            self._beat_in(self.fleet.rng.uniform(0, event.heartbeat_interval_s), event.heartbeat_interval_s)
        elif event.type in ("task_available", "task_control") and event.task_id:
            desktop.arrivals.setdefault(event.task_id, now)
            if self.expected > 0:
                self.expected -= 1
        if self.expected == 0 and desktop.ready_at == 0.0:
            desktop.ready_at = now

    def _beat_in(self, delay: float, interval: float) -> None:
        def beat() -> None:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(HEARTBEAT)
                self._beat_in(interval, interval)

        self.beat_timer = asyncio.get_running_loop().call_later(delay, beat)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end("closed" if self.upgraded else type(exc).__name__ if exc else "closed")

    def _end(self, why: str) -> None:
        if self.done.done():
            # Ended already (a close frame, then the transport's connection_lost): by now the desktop may have its
            # next socket, ready, whose state this one must not clear (it left desktops "not ready" for good).
            return
        for timer in (self.handshake_timer, self.beat_timer):
            if timer is not None:
                timer.cancel()
        self.desktop.connected, self.desktop.ready_at = False, 0.0
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        if not self.done.done():
            self.done.set_result(why)


class Fleet:
    def __init__(self, hubs: list[str], tokens: list[str], offset: int = 0) -> None:
        urls = [urlsplit(hub) for hub in hubs]
        self.hubs = [(url.netloc, (url.hostname or "127.0.0.1", url.port or 80)) for url in urls]
        self.desktops = [Desktop(token, home=(offset + i) % len(hubs)) for i, token in enumerate(tokens)]
        self.handshake_errors: dict[str, int] = {}
        self.drained = 0  # sockets a draining hub closed with a reconnect delay
        self.stopping = asyncio.Event()
        self.sockets: set[Socket] = set()
        self.rng = random.Random()

    async def run_one(self, desktop: Desktop) -> None:
        loop = asyncio.get_running_loop()
        attempt = 0
        hub = desktop.home
        while not self.stopping.is_set():
            host, address = self.hubs[hub]
            delay: float | None = None
            try:
                _, socket = await loop.create_connection(functools.partial(Socket, self, desktop, host), *address)
            except OSError as exc:
                self._count(type(exc).__name__)
                hub = self.other_hub(hub)
            else:
                self.sockets.add(socket)
                why = await socket.done
                self.sockets.discard(socket)
                if socket.upgraded:
                    attempt = 0
                    delay = socket.reconnect_after_s
                    if delay is not None:  # drained: the load balancer's next pick is another hub
                        hub = self.other_hub(hub)
                else:
                    self._count(why)
                    hub = self.other_hub(hub)
            if delay is None:
                delay = backoff_delay(attempt, base_s=RECONNECT_BASE_S, max_s=RECONNECT_MAX_S, rng=self.rng)
                attempt += 1
            try:
                await asyncio.wait_for(self.stopping.wait(), delay)
            except TimeoutError:
                pass

    def other_hub(self, hub: int) -> int:
        """The load balancer's pick for a new connection that `hub` refused or drained: any other hub, at random (the
        same hub when there is only one)."""
        if len(self.hubs) < 2:
            return hub
        pick = self.rng.randrange(len(self.hubs) - 1)
        return pick if pick < hub else pick + 1

    def _count(self, what: str) -> None:
        self.handshake_errors[what] = self.handshake_errors.get(what, 0) + 1

    def status(self, since: float) -> dict[str, Any]:
        ready = [d.ready_at for d in self.desktops if d.ready_at and d.ready_at >= since]
        return {"clients": len(self.desktops), "ready": len(ready), "last_ready": max(ready, default=0.0),
                "open": sum(1 for d in self.desktops if d.connected),
                "hellos": sum(d.hellos for d in self.desktops), "errors": self.handshake_errors,
                "drained": self.drained}

    def arrivals(self, task_id: str) -> list[float]:
        return [d.arrivals[task_id] for d in self.desktops if task_id in d.arrivals]

    def close_all(self) -> None:
        for socket in tuple(self.sockets):
            if socket.transport is not None and socket.upgraded:
                socket.transport.write(client_frame(CLOSE, struct.pack("!H", 1000)))
            socket._end("stopped")


class LagProbe:
    """How late a timer of this process fires (ms), sampled every LAG_EVERY_S: the fleet's own starvation, apart
    from the service's latency (under `nice`, or with the box's cores busy, the fleet's loop runs late)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_EVERY_S
            await asyncio.sleep(LAG_EVERY_S)
            self.samples.append(max(0.0, (loop.time() - due) * 1000))
            if len(self.samples) > LAG_SAMPLES:
                del self.samples[:LAG_SAMPLES // 2]

    def take(self) -> list[float]:
        """The samples since the last take."""
        samples, self.samples = self.samples, []
        return samples


def _raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


async def main(config_path: str) -> None:
    with open(config_path) as f:  # noqa: ASYNC230 - read once, before any socket opens
        config = json.load(f)
    fd_limit = _raise_fd_limit()
    fleet = Fleet(config["hubs"], config["tokens"], int(config.get("offset", 0)))
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    tasks: list[asyncio.Task[None]] = []
    lag = LagProbe()
    lagging = asyncio.create_task(lag.run())
    _answer({"started": len(fleet.desktops), "fd_limit": fd_limit})
    while line := await commands.readline():
        command = json.loads(line)
        if command["cmd"] == "connect" and not tasks:  # every desktop at once, as after a hub restart
            tasks = [asyncio.create_task(fleet.run_one(d)) for d in fleet.desktops]
            _answer({"connecting": len(fleet.desktops)})
        elif command["cmd"] == "status":
            _answer(fleet.status(float(command.get("since", 0.0))))
        elif command["cmd"] == "arrivals":
            _answer({"times": fleet.arrivals(command["task_id"])})
        elif command["cmd"] == "arrived":  # which of these tasks reached a desktop of this process
            wanted = set(command["task_ids"])
            _answer({"arrived": sorted({t for d in fleet.desktops for t in d.arrivals if t in wanted})})
        elif command["cmd"] == "lag":  # the event loop's lag samples since the last `lag` (ms)
            _answer({"lag_ms": lag.take()})
        elif command["cmd"] == "stop":
            break
    lagging.cancel()
    fleet.stopping.set()
    fleet.close_all()
    await asyncio.gather(*tasks, return_exceptions=True)
    _answer({"stopped": True})


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
