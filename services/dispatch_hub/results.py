"""The one direct publish of the system (contract 7): result callbacks to `monitor.result` with confirms."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

import aio_pika
import msgspec
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection
from aiormq.exceptions import PublishError
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import MonitorResult, message_type
from libs.db.pool import Conn
from libs.ingest.routing import Routing, RoutingStore, routed
from libs.mq.topology import Topology, declare_ingest
from libs.telemetry import tracing


class BrokerUnavailable(Exception):
    """No confirm (broker down, nack, unroutable or timeout): the client must retry."""


class Unroutable(BrokerUnavailable):
    """The broker returned the result (mandatory): no queue is bound to its routing key, e.g. a routing epoch that
    a reshard retired since this replica read it."""


class ResultRouter(Protocol):
    async def current(self) -> Routing: ...

    def forget(self) -> None: ...


class StaticRouter:
    """Epoch 0 with a fixed shard count (tests, and a hub without a routing table)."""

    def __init__(self, shards: int) -> None:
        self._routing = Routing(0, shards)

    async def current(self) -> Routing:
        return self._routing

    def forget(self) -> None:
        return None


class RoutingTableRouter:
    """The active routing epoch from Postgres (libs/ingest/routing.py), read again after `max_age_s` or `forget()`.

    A stale epoch is safe: the reshard unbinds the old epoch's queues, so a result routed by it comes back
    (mandatory) and `publish_routed` reads the table again and re-routes it."""

    def __init__(self, pool: AsyncConnectionPool[Conn], default_shards: int, *, max_age_s: float = 1.0) -> None:
        self._pool = pool
        self._store = RoutingStore(default_shards)
        self._max_age_s = max_age_s
        self._routing: Routing | None = None
        self._read_at = 0.0

    async def current(self) -> Routing:
        routing = self._routing
        if routing is None or time.monotonic() - self._read_at > self._max_age_s:
            async with self._pool.connection() as conn:
                routing = (await self._store.state(conn)).active
            self._routing, self._read_at = routing, time.monotonic()
        return routing

    def forget(self) -> None:
        self._routing = None


async def publish_routed(publisher: ResultPublisher, router: ResultRouter, message: MonitorResult) -> MonitorResult:
    """Route `message` by the active epoch and publish it (confirmed); returned as unroutable, read the epoch again
    and, if a reshard moved it, publish once more by the new one. The message as published."""
    routing = await router.current()
    message = routed(message, routing)
    try:
        await publisher.publish(message, routing_key=routing.routing_key(message.shard))
    except Unroutable:
        router.forget()
        fresh = await router.current()
        if fresh == routing:
            raise
        message = routed(message, fresh)
        await publisher.publish(message, routing_key=fresh.routing_key(message.shard))
    return message


class ResultPublisher(Protocol):
    async def publish(self, message: MonitorResult, *, routing_key: str) -> None: ...


class AmqpResultPublisher:
    """Publishes on a confirm channel; returns only once the broker confirmed (mandatory: an unroutable
    result is an error, not a silent drop)."""

    def __init__(self, connection: AbstractRobustConnection, topology: Topology, *, timeout: float = 5.0,
                 router: ResultRouter | None = None) -> None:
        self._connection = connection
        self._topology = topology
        self._router = router or StaticRouter(topology.ingest_shards)
        self._timeout = timeout
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self._open()

    async def _open(self) -> None:
        self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        # The shard queues exist before the first result even if ingest has not started yet: the active epoch's only,
        # so a hub never binds a retired epoch's queues again.
        await declare_ingest(self._channel, self._topology, [await self._router.current()])
        self._exchange = await self._channel.get_exchange(self._topology.result_exchange)

    def ready(self) -> bool:
        return (self._connection.connected.is_set() and self._channel is not None
                and not self._channel.is_closed and self._exchange is not None)

    async def publish(self, message: MonitorResult, *, routing_key: str) -> None:
        if not self._connection.connected.is_set():
            raise BrokerUnavailable("broker connection is down")
        if self._channel is None or self._channel.is_closed:
            async with self._lock:
                if self._channel is None or self._channel.is_closed:
                    try:
                        await asyncio.wait_for(self._open(), self._timeout)
                    except Exception as exc:
                        raise BrokerUnavailable(f"cannot open a channel: {type(exc).__name__}") from exc
        assert self._exchange is not None
        # A producer span (a child of the result call's), whose traceparent goes in the headers for ingest.
        with tracing.span("hub.result.publish", kind=tracing.SpanKind.PRODUCER, attributes={
                "messaging.system": "rabbitmq", "messaging.destination.name": self._exchange.name,
                "messaging.rabbitmq.destination.routing_key": routing_key,
                "messaging.message.id": str(message.result_id), tracing.TENANT_ID: message.tenant_id,
                tracing.TASK_ID: str(message.task_id), tracing.SHARD: message.shard}):
            headers: dict[str, Any] = {"tenant_id": message.tenant_id}
            tracing.inject(headers)
            amqp_message = aio_pika.Message(
                body=msgspec.json.encode(message), content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(message.result_id),
                type=message_type(message), headers=headers)
            try:
                await self._exchange.publish(amqp_message, routing_key=routing_key, mandatory=True,
                                             timeout=self._timeout)
            except asyncio.CancelledError:
                raise
            except PublishError as exc:
                raise Unroutable(f"no queue bound to {routing_key}") from exc
            except Exception as exc:  # nack, timeout, closed channel: not confirmed
                raise BrokerUnavailable(f"{type(exc).__name__}: {exc}"[:200]) from exc

    async def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
