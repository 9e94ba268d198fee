"""Trace context through the outbox: the writer stores the current span's traceparent (a fresh one without a
span; an event's own when it has one), and a publish is a producer span, a child of the row's context, whose
traceparent goes in the AMQP headers."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime

import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import LifecycleEvent, message_type
from libs.db.pool import Conn
from libs.mq.topology import LIFECYCLE, Topology
from libs.outbox import OutboxEvent, enqueue, enqueue_many
from libs.outbox.pump import AmqpPublisher, ClaimedEvent
from libs.telemetry import tracing
from tests.support.capture import capture
from tests.support.tracing import finished, hex_ids, memory_tracing

TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]$")
OTHER = "00-11111111111111111111111111111111-2222222222222222-01"


def event(n: int = 0) -> LifecycleEvent:
    return LifecycleEvent(event="client.online", tenant_id=1, occurred_at=datetime.now(UTC), reason=f"seq:{n}")


async def traceparents(pool: AsyncConnectionPool[Conn]) -> list[str]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT traceparent FROM outbox ORDER BY id")
        return [r["traceparent"] for r in await cur.fetchall()]


async def test_rows_carry_the_current_span_or_their_own_context(pool: AsyncConnectionPool[Conn],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    async with pool.connection() as conn, conn.transaction():  # tracing off: a fresh context per write
        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=event())
    with memory_tracing(monkeypatch) as spans:
        with tracing.span("click") as click:
            expected = tracing.traceparent_of(click)
            async with pool.connection() as conn, conn.transaction():
                await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=event(1))
                await enqueue_many(conn, [
                    OutboxEvent(exchange=LIFECYCLE, routing_key="client.online", message=event(2), traceparent=OTHER),
                    OutboxEvent(exchange=LIFECYCLE, routing_key="client.online", message=event(3))])
                await enqueue_many(conn, [OutboxEvent(exchange=LIFECYCLE, routing_key="client.online",
                                                      message=event(4))])
        assert finished(spans, "click")
    fresh, in_span, own, defaulted, batch = await traceparents(pool)
    assert TRACEPARENT.match(fresh) and fresh != expected
    assert in_span == defaulted == batch == expected
    assert own == OTHER


async def test_a_publish_is_a_child_of_its_row_and_hands_its_context_on(
        settings: Settings, topology: Topology, amqp, monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="tracing-test")
    await publisher.start()
    try:
        async with capture(amqp, topology.lifecycle_exchange) as cap:
            with memory_tracing(monkeypatch, "outbox-pump") as spans:
                await publisher.publish(ClaimedEvent(
                    id=1, event_id="0b5e2ea4-69a3-4b5c-8d1e-0f1a2b3c4d5e", exchange=LIFECYCLE,
                    routing_key="client.online", message_type=message_type(event()),
                    payload=msgspec.json.encode(event()),
                    headers={}, ordering_key=None, tenant_id=1, traceparent=OTHER, attempts=1, max_attempts=10,
                    created_at=datetime.now(UTC)))
            await asyncio.wait_for(cap.arrived.wait(), 10)
    finally:
        await publisher.close()
    [publish] = finished(spans, "outbox.publish")
    trace_id, span_id = hex_ids(publish)
    assert trace_id == OTHER.split("-")[1]
    assert publish.parent is not None and format(publish.parent.span_id, "016x") == OTHER.split("-")[2]
    headers = cap.messages[0].headers or {}
    assert headers["traceparent"] == f"00-{trace_id}-{span_id}-01"
    assert publish.attributes is not None and publish.attributes[tracing.TENANT_ID] == 1
