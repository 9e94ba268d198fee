"""The WebSocket side of the hub: which clients are connected here, their broker bindings, the
replay on (re)connect, online/offline, and forwarding of dispatch events to the right sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

import msgspec
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.contracts.wire import Hello, TaskAvailable, dispatch_decoder
from libs.db.pool import Conn
from libs.db.write_health import WriterHealth
from libs.mq.topology import Topology, declare_hub_queue
from libs.tasks.transitions import emit_lifecycle
from libs.telemetry import metrics, tracing
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
# Application close codes (4000-4999) a desktop client can act on: 4401 authenticate again (the token was
# rotated: get the new one), 4403 do not reconnect (the client was disabled), 4409 this socket was replaced
# by a newer one of the same client (HUB_MAX_SOCKETS_PER_CLIENT).
TOKEN_ROTATED_CLOSE = 4401
CLIENT_DISABLED_CLOSE = 4403
REPLACED_CLOSE = 4409
REVOCATION_CHUNK = 5000


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
                 heartbeat_flush_s: float, max_sockets_per_client: int = 2, revocation_check_s: float = 2.0,
                 on_revoked: Callable[[uuid.UUID], None] | None = None,
                 write_health: WriterHealth | None = None) -> None:
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
                                          is_connected=lambda c: c in self._sockets, write_health=write_health)
        self.max_sockets_per_client = max_sockets_per_client
        self.revocation_check_s = revocation_check_s
        self._on_revoked = on_revoked
        self.forwarded = 0
        self.revoked = 0
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
        conns = tuple(self._sockets.get(client_id, ()))
        if tracing.enabled():
            self._deliver_traced(message, client_id, conns)
            return
        text = message.body.decode()
        for conn in conns:
            conn.deliver(text)
            self.forwarded += 1

    def _deliver_traced(self, message: AbstractIncomingMessage, client_id: uuid.UUID,
                        conns: tuple[Connection, ...]) -> None:
        """Deliver in a span that is a child of the publisher's (AMQP headers); the event goes out with that
        span's `traceparent`, which the client sends back on its calls for the task."""
        with tracing.span("hub.deliver", kind=tracing.SpanKind.CONSUMER,
                          parent=tracing.context_from_headers(message.headers), attributes={
                              "messaging.system": "rabbitmq", "messaging.message.id": message.message_id,
                              "monitoring.message_type": message.type, tracing.CLIENT_ID: str(client_id),
                              "monitoring.sockets": len(conns)}) as span:
            text = message.body.decode()
            with contextlib.suppress(msgspec.MsgspecError):  # not ours to judge: forwarded unchanged
                event = dispatch_decoder.decode(message.body)
                span.set_attribute(tracing.TASK_ID, str(event.task_id))
                text = msgspec.json.encode(msgspec.structs.replace(
                    event, traceparent=tracing.traceparent_of(span))).decode()
            for conn in conns:
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
            self._close_oldest_beyond_limit(client_id)
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

    def _close_oldest_beyond_limit(self, client_id: uuid.UUID) -> None:
        """A client holds at most `max_sockets_per_client` sockets here: the oldest beyond that are closed
        (a reconnecting client's old socket that has not noticed it is dead yet, or a copied token)."""
        conns = sorted((c for c in self._sockets[client_id] if not c.closing), key=lambda c: c.opened_at)
        for old in conns[:max(0, len(conns) - self.max_sockets_per_client)]:
            log.info("closing a client's oldest socket: a newer one replaced it",
                     extra={"client_id": str(client_id), "limit": self.max_sockets_per_client})
            self._close(old, REPLACED_CLOSE, b"replaced by a newer connection of this client")

    def _close(self, conn: Connection, code: int, message: bytes) -> None:
        conn.closing = True
        self._spawn(conn.ws.close(code=code, message=message), name=f"close-{conn.client_id}")

    # ---- revocation --------------------------------------------------------------------------
    async def revoke_sweep(self) -> int:
        """Close the sockets of clients that were disabled (4403) or whose token was rotated (4401), and of
        clients that no longer exist; the number of sockets closed."""
        ids = list(self._sockets)
        found: dict[uuid.UUID, dict[str, Any]] = {}
        for start in range(0, len(ids), REVOCATION_CHUNK):
            async with self._pool.connection() as db:
                cur = await db.execute(q.REVOKED_CLIENTS, {"ids": ids[start:start + REVOCATION_CHUNK]})
                found.update({row["id"]: row for row in await cur.fetchall()})
        closed = 0
        for client_id in ids:
            row = found.get(client_id)
            for conn in tuple(self._sockets.get(client_id, ())):
                if conn.closing:
                    continue
                if row is None or row["disabled"]:
                    self._close(conn, CLIENT_DISABLED_CLOSE, b"client disabled")
                elif row["token_hash"] != conn.principal.token_hash:
                    self._close(conn, TOKEN_ROTATED_CLOSE, b"token rotated; authenticate again")
                else:
                    continue
                closed += 1
                if self._on_revoked is not None:
                    self._on_revoked(client_id)
                log.warning("closing a revoked client's socket", extra={
                    "client_id": str(client_id), "reason": "token_rotated" if row and not row["disabled"]
                    else "disabled"})
        self.revoked += closed
        return closed

    async def run_revocation_sweep(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.revocation_check_s)
            if stop.is_set() or not self._sockets:
                continue
            try:
                await self.revoke_sweep()
            except Exception:
                log.exception("revocation sweep failed; will retry at the next interval")

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
                if conn.closing:
                    continue
                if now - conn.last_seen > self.heartbeat_timeout_s:
                    log.info("closing a silent socket", extra={"client_id": conn.client_id})
                    self._close(conn, HEARTBEAT_TIMEOUT_CLOSE, b"heartbeat timeout")
                elif not conn.ws.closed:
                    with contextlib.suppress(Exception):
                        await conn.ws.ping()

    async def close_all(self) -> None:
        """SIGTERM: tell every client to go elsewhere (1001 going away); handlers then clean up."""
        self.closing = True
        conns = self.all_connections()
        await asyncio.gather(*(c.ws.close(code=GOING_AWAY, message=b"server shutting down") for c in conns),
                             return_exceptions=True)
