"""The lifecycle consumers (reconciler, coordinator) dead-letter an undecodable event with its reason, acking
the original only once the broker confirmed the copy; while the dead-letter path cannot take it, the original is
given back, never lost."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.mq.dead_letter import REASON_HEADER
from libs.mq.topology import Topology, declare_lifecycle
from services.reconciler.config import ReconcilerConfig
from services.reconciler.lifecycle import CONSUMER, consume_lifecycle
from services.reconciler.runner import JobScheduler
from tests.support.wait import eventually


async def _publish_garbage(amqp: AbstractRobustConnection, topology: Topology) -> None:
    async with amqp.channel() as channel:
        exchange = await channel.get_exchange(topology.lifecycle_exchange, ensure=False)
        await exchange.publish(aio_pika.Message(b'{"type": "lifecycle", "event": 42}', message_id="bad-1"),
                               routing_key="task.completed")


async def _count(amqp: AbstractRobustConnection, queue: str) -> int:
    async with amqp.channel() as channel:
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count)


async def test_an_undecodable_event_is_dead_lettered_only_once_confirmed(
        pool: AsyncConnectionPool[Conn], amqp: AbstractRobustConnection, topology: Topology,
        caplog: pytest.LogCaptureFixture) -> None:
    async with amqp.channel() as channel:
        await declare_lifecycle(channel, topology, CONSUMER)
    stop = asyncio.Event()
    consumer = asyncio.create_task(consume_lifecycle(amqp, topology, JobScheduler(pool, ReconcilerConfig(), []),
                                                     stop))
    try:
        async def subscribed() -> bool | None:
            async with amqp.channel() as channel:
                declared = await channel.declare_queue(topology.lifecycle_queue(CONSUMER), passive=True)
                return True if declared.declaration_result.consumer_count >= 1 else None

        await eventually(subscribed, timeout=10, message="the reconciler's lifecycle consumer subscribed")
        async with amqp.channel() as channel:  # (the consumer declared, and so bound, the DLQ on its way up)
            dlq = await channel.get_queue(topology.lifecycle_dlq(CONSUMER), ensure=False)
            await dlq.unbind(topology.dlx_exchange, routing_key=topology.lifecycle_dlq(CONSUMER))
        await _publish_garbage(amqp, topology)
        # The dead-letter exchange cannot route the copy: the consumer is told so and gives the event back.
        await eventually(lambda: any("given back" in r.getMessage() for r in caplog.records) or None, timeout=10,
                         message="the unroutable dead letter refused and the event given back")
        assert await _count(amqp, topology.lifecycle_dlq(CONSUMER)) == 0
        async with amqp.channel() as channel:
            dlq = await channel.get_queue(topology.lifecycle_dlq(CONSUMER), ensure=False)
            await dlq.bind(topology.dlx_exchange, routing_key=topology.lifecycle_dlq(CONSUMER))

        async def dead_lettered() -> bool | None:
            return True if await _count(amqp, topology.lifecycle_dlq(CONSUMER)) == 1 else None

        await eventually(dead_lettered, timeout=15, message="dead-lettered once the path is back")
    finally:
        stop.set()
        await asyncio.wait_for(consumer, 10)
    async with amqp.channel() as channel:
        dlq = await channel.get_queue(topology.lifecycle_dlq(CONSUMER), ensure=False)
        letter = await dlq.get(timeout=5)
        assert letter is not None and letter.message_id == "bad-1"
        assert "event" in str((letter.headers or {}).get(REASON_HEADER))
        await letter.ack()
    assert await _count(amqp, topology.lifecycle_queue(CONSUMER)) == 0
