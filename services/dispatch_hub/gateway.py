"""The WebSocket side of the hub: which clients are connected here, their broker bindings, the
replay on (re)connect, online/offline, and forwarding of dispatch events to the right sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

import msgspec
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.contracts.wire import Hello, TaskAvailable
from libs.db.pool import Conn
from libs.mq.topology import Topology, declare_hub_queue
from libs.tasks.transitions import emit_lifecycle
from libs.telemetry import metrics
from services.dispatch_hub import queries as q
from services.dispatch_hub.auth import ClientPrincipal
from services.dispatch_hub.connections import Connection
from services.dispatch_hub.heartbeats import HeartbeatWriter
from services.dispatch_hub.leases import current_interrupt
from services.dispatch_hub.logic import (
    announced_heartbeat_interval,
    client_id_from_routing_key,
    routing_keys_for_client,
)

log = logging.getLogger("hub.gateway")

REPLAY_LIMIT = 500
GOING_AWAY = 1001
HEARTBEAT_TIMEOUT_CLOSE = 4408


def task_available_from_row(row: dict[str, Any]) -> TaskAvailable:
    return TaskAvailable(kind=row["kind"], task_id=row["id"], target_client_id=row["target_client_id"],
                         priority=int(row["priority"]), lane=row["lane"],
                         scheduler_group_key=row["scheduler_group_key"],
                         business_date=row["business_date"], interrupt_generation=int(row["interrupt_generation"]),
                         updated_at=row["updated_at"], monitor_task_id=row["monitor_task_id"],
                         collect_request_id=row["collect_request_id"])


class Gateway:
    def __init__(self, pool: AsyncConnectionPool[Conn], amqp: AbstractRobustConnection, topology: Topology, *,
                 hub_id: str, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 heartbeat_flush_s: float) -> None:
        self._pool = pool
        self._amqp = amqp
        self._topology = topology
        self.hub_id = hub_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._sockets: dict[uuid.UUID, set[Connection]] = {}
        self._client_locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self.heartbeats = HeartbeatWriter(pool, hub=hub_id, interval_s=heartbeat_flush_s,
                                          is_connected=lambda c: c in self._sockets)
        self.forwarded = 0
        self.closing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def spawn_cleanup(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        return self._spawn(coro, name="ws-cleanup")

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait for socket clean-ups (unbind, offline) still running, before resources close."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    # ---- broker ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._channel = await self._amqp.channel()
        await self._channel.set_qos(prefetch_count=1000)
        self._queue = await declare_hub_queue(self._channel, self._topology, self.hub_id)
        await self._queue.consume(self._on_message, no_ack=True)
        self._amqp.reconnect_callbacks.add(self._on_reconnect)

    def ready(self) -> bool:
        return (self._amqp.connected.is_set() and self._channel is not None and not self._channel.is_closed)

    async def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        client_id = client_id_from_routing_key(message.routing_key or "")
        if client_id is None:
            log.warning("dispatch event with an unexpected routing key", extra={"routing_key": message.routing_key})
            return
        text = message.body.decode()
        for conn in tuple(self._sockets.get(client_id, ())):
            conn.deliver(text)
            self.forwarded += 1

    def _on_reconnect(self, *_: Any) -> None:
        # Events published while the broker link was down never reached this queue: replay from the
        # database for every connected client (the robust channel restored queue and bindings).
        log.warning("broker connection restored; replaying to connected clients")
        for client_id, conns in list(self._sockets.items()):
            for conn in tuple(conns):
                self._spawn(self._replay_into(conn), name=f"replay-{client_id}")

    async def _replay_into(self, conn: Connection) -> None:
        try:
            for text in await self.replay(conn.principal):
                conn.deliver(text)
        except Exception:
            log.exception("replay after broker reconnect failed", extra={"client_id": conn.client_id})

    # ---- sockets -----------------------------------------------------------------------------
    def is_connected(self, client_id: uuid.UUID) -> bool:
        return client_id in self._sockets

    def connection_count(self) -> int:
        return sum(len(c) for c in self._sockets.values())

    def all_connections(self) -> list[Connection]:
        return [c for conns in self._sockets.values() for c in conns]

    def _lock(self, client_id: uuid.UUID) -> asyncio.Lock:
        lock = self._client_locks.get(client_id)
        if lock is None:
            lock = self._client_locks[client_id] = asyncio.Lock()
        return lock

    async def attach(self, conn: Connection) -> list[str]:
        """Bind (first socket of the client), register, mark online, and build hello + replay.

        Bind before reading the replay: an event published in between arrives twice at worst
        (clients treat task_available as a hint and lease by pull), never not at all."""
        principal = conn.principal
        client_id = principal.client_id
        async with self._lock(client_id):
            if client_id not in self._sockets:
                assert self._queue is not None
                for key in routing_keys_for_client(client_id):
                    await self._queue.bind(self._topology.dispatch_exchange, routing_key=key)
                self._sockets[client_id] = set()
            self._sockets[client_id].add(conn)
            metrics.desktop_websocket_connections.inc()
            # Under the client's lock, so a concurrent last-socket close cannot mark it offline after this.
            async with self._pool.connection() as db, db.transaction():
                cur = await db.execute(q.CLIENT_ONLINE, {"client_id": client_id, "hub": self.hub_id})
                row = await cur.fetchone()
                generation = int(row["interrupt_generation"]) if row else 0
                if row is not None and not row["was_online"]:
                    await emit_lifecycle(db, "client.online", tenant_id=principal.tenant_id, client_id=client_id)
        replay = await self.replay(principal)
        available = sum(1 for t in replay if '"task_available"' in t)
        hello = Hello(client_id=client_id, tenant_id=principal.tenant_id, hub_instance=self.hub_id,
                      server_time=datetime.now(UTC),
                      heartbeat_interval_s=announced_heartbeat_interval(self.heartbeat_interval_s),
                      interrupt_generation=generation, replayed_available=available,
                      replayed_controls=len(replay) - available)
        log.info("client connected", extra={"client_id": str(client_id), "tenant_id": principal.tenant_id,
                                            "replayed": len(replay)})
        return [msgspec.json.encode(hello).decode(), *replay]

    async def replay(self, principal: ClientPrincipal) -> list[str]:
        params = {"client_id": principal.client_id, "tenant_id": principal.tenant_id, "limit": REPLAY_LIMIT}
        async with self._pool.connection() as db:
            cur = await db.execute(q.REPLAY_QUEUED, params)
            queued = await cur.fetchall()
            cur = await db.execute(q.REPLAY_INTERRUPTS, params)
            interrupts = await cur.fetchall()
        now = datetime.now(UTC)
        events: list[str] = [msgspec.json.encode(task_available_from_row(r)).decode() for r in queued]
        events += [msgspec.json.encode(current_interrupt(r, now=now)).decode() for r in interrupts]
        return events

    async def detach(self, conn: Connection) -> None:
        principal = conn.principal
        client_id = principal.client_id
        async with self._lock(client_id):
            conns = self._sockets.get(client_id)
            if conns is None or conn not in conns:
                return
            conns.discard(conn)
            metrics.desktop_websocket_connections.dec()
            if conns:
                return
            del self._sockets[client_id]
            if self._queue is not None and self._amqp.connected.is_set():
                for key in routing_keys_for_client(client_id):
                    with contextlib.suppress(Exception):
                        await self._queue.unbind(self._topology.dispatch_exchange, routing_key=key)
            try:
                async with self._pool.connection() as db, db.transaction():
                    cur = await db.execute(q.CLIENT_OFFLINE, {"client_id": client_id, "hub": self.hub_id})
                    if await cur.fetchone() is not None:
                        await emit_lifecycle(db, "client.offline", tenant_id=principal.tenant_id,
                                             client_id=client_id)
            except Exception:
                log.exception("could not mark the client offline", extra={"client_id": str(client_id)})
        log.info("client disconnected", extra={"client_id": str(client_id), "tenant_id": principal.tenant_id})

    # ---- liveness ----------------------------------------------------------------------------
    async def run_pinger(self, stop: asyncio.Event) -> None:
        """One task for all sockets: ping each, close the ones silent for longer than the timeout."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.heartbeat_interval_s)
            if stop.is_set():
                return
            now = time.monotonic()
            for conn in self.all_connections():
                if now - conn.last_seen > self.heartbeat_timeout_s:
                    log.info("closing a silent socket", extra={"client_id": conn.client_id})
                    self._spawn(conn.ws.close(code=HEARTBEAT_TIMEOUT_CLOSE, message=b"heartbeat timeout"),
                                name=f"close-{conn.client_id}")
                elif not conn.ws.closed:
                    with contextlib.suppress(Exception):
                        await conn.ws.ping()

    async def close_all(self) -> None:
        """SIGTERM: tell every client to go elsewhere (1001 going away); handlers then clean up."""
        self.closing = True
        conns = self.all_connections()
        await asyncio.gather(*(c.ws.close(code=GOING_AWAY, message=b"server shutting down") for c in conns),
                             return_exceptions=True)
