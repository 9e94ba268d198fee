"""The one direct publish of the system (contract 7): result callbacks to `monitor.result` with confirms."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

import aio_pika
import msgspec
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection

from libs.contracts.amqp import MonitorResult, message_type
from libs.mq.topology import Topology, declare_ingest
from libs.telemetry import tracing


class BrokerUnavailable(Exception):
    """No confirm (broker down, nack, unroutable or timeout): the client must retry."""


class ResultPublisher(Protocol):
    async def publish(self, message: MonitorResult, *, routing_key: str) -> None: ...


class AmqpResultPublisher:
    """Publishes on a confirm channel; returns only once the broker confirmed (mandatory: an unroutable
    result is an error, not a silent drop)."""

    def __init__(self, connection: AbstractRobustConnection, topology: Topology, *, timeout: float = 5.0) -> None:
        self._connection = connection
        self._topology = topology
        self._timeout = timeout
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self._open()

    async def _open(self) -> None:
        self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        # The shard queues exist before the first result even if ingest has not started yet.
        await declare_ingest(self._channel, self._topology)
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
            except Exception as exc:  # nack, return, timeout, closed channel: not confirmed
                raise BrokerUnavailable(f"{type(exc).__name__}: {exc}"[:200]) from exc

    async def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
