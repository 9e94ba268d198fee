"""ingest-shard-workers through a database outage, and the broker's own dead letters, against real Postgres and
RabbitMQ.

The outage is the worker's alone: its pool reaches the test's database through a TCP proxy that the test cuts
(every open connection dropped, new ones refused), while the shared server and the test's own pool stay up.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import date

import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn, make_pool
from libs.mq.topology import INGEST_DELIVERY_LIMIT, Topology, declare_ingest
from libs.telemetry import metrics as m
from services.ingest_shard_workers.consumer import ShardConsumer
from tests.support.ingest_factory import fetch, make_executions, make_result, make_world, publish, running_ingest
from tests.support.tcpproxy import TcpProxy
from tests.support.wait import eventually

DAY = date(2026, 3, 18)
# The old behaviour gave a result back after each failed round (4 attempts of 0.3 s pool wait and 1.7 s of pauses,
# then 1, 2, 4, 8, 15 s before each requeue): redelivered ~4, 9, 16, 27 and 45 s into the outage, dead-lettered
# past the quorum delivery limit at ~45-50 s. The test counts every delivery the worker receives, so 20 s (three
# such redeliveries) shows that none is spent; INGEST_OUTAGE_SECONDS=60 outlasts the old limit's time itself, and
# 360 is the six-minute run (docs/reliability.md, `make faults-long`).
OUTAGE_S = float(os.environ.get("INGEST_OUTAGE_SECONDS", "20"))

pytestmark = pytest.mark.timeout(OUTAGE_S + 120)


async def applied_ids(pool: AsyncConnectionPool[Conn]) -> list[uuid.UUID]:
    rows = await fetch(pool, "SELECT result_id FROM ingest_applied_results ORDER BY seq")
    return [row["result_id"] for row in rows]  # type: ignore[misc]


async def queue_count(amqp: AbstractRobustConnection, queue: str) -> int:
    """Messages ready in `queue` (not those delivered and unacked)."""
    async with amqp.channel() as channel:
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


def dead_letters() -> float:
    return sum(s.value for s in m.ingest_dead_letter_count.collect()[0].samples)


async def counting_deliveries(shard: ShardConsumer) -> list[int]:
    """Re-subscribe `shard`'s consumer so that it notes the `x-delivery-count` of everything it receives (0 for a
    first delivery): the deliveries a result spent of the broker's limit."""
    deliveries: list[int] = []
    receive = shard._on_message

    async def counted(message: AbstractIncomingMessage) -> None:
        count = (message.headers or {}).get("x-delivery-count")
        deliveries.append(count if isinstance(count, int) else 0)
        await receive(message)

    shard._on_message = counted  # type: ignore[method-assign]
    await shard.close()
    await shard.subscribe()
    return deliveries


def through(proxy: TcpProxy, settings: Settings) -> Settings:
    params = conninfo_to_dict(settings.database_url)
    return replace(settings, database_url=make_conninfo(settings.database_url, host="127.0.0.1", port=proxy.port,
                                                        dbname=params["dbname"]))


@contextlib.asynccontextmanager
async def proxied_pool(settings: Settings) -> AsyncIterator[tuple[TcpProxy, Settings, AsyncConnectionPool[Conn]]]:
    """The worker's pool, reaching the test's database through a TCP proxy the test can cut."""
    params = conninfo_to_dict(settings.database_url)
    proxy = TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    await proxy.start()
    worker_settings = through(proxy, settings)
    worker_pool = make_pool(worker_settings, name="ingest-under-test", min_size=1, max_size=2)
    # A short wait for a pooled connection, so the old behaviour spent its delivery limit within OUTAGE_S. And the
    # pool's own reconnect backoff (psycopg's: doubling up to 5 min) capped by giving each attempt up after 1 s:
    # that backoff is the pool's, not this consumer's (bounded for every pool separately).
    worker_pool.timeout = 0.3
    worker_pool.reconnect_timeout = 1.0
    await worker_pool.open(wait=True)
    try:
        yield proxy, worker_settings, worker_pool
    finally:
        await proxy.close()
        await worker_pool.close()


async def test_results_are_held_through_a_database_outage_longer_than_the_delivery_limit_and_applied_once(
        pool, settings, topology, amqp) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=3, platforms=2)
        ex = await make_executions(conn, world, business_date=DAY)
    results = [make_result(e, shards=topology.ingest_shards, answer=f"answer {i}") for i, e in enumerate(ex)]
    shard = results[0].shard
    dead_before, transient_before = dead_letters(), m.ingest_transient_error_count.value()
    async with proxied_pool(settings) as (proxy, worker_settings, worker_pool):
        async with running_ingest(worker_pool, worker_settings, topology) as worker:
            assert {r.shard for r in results} == {shard}  # one business key's shard
            deliveries = await counting_deliveries(worker.shards[shard])
            await publish(amqp, topology, [results[0]])
            await eventually(lambda: _applied(pool, 1), message="the first result applied before the outage")

            await proxy.cut()
            await publish(amqp, topology, list(results[1:]))
            await eventually(lambda: m.ingest_transient_error_count.value() > transient_before,
                             message="the worker met the outage")
            outage_ends = time.monotonic() + OUTAGE_S

            async def held() -> bool:
                # Through the whole outage: nothing applied, nothing dead-lettered, nothing given back to the queue.
                assert len(await applied_ids(pool)) == 1
                assert await queue_count(amqp, topology.ingest_dlq) == 0
                assert await queue_count(amqp, topology.ingest_queue(shard)) == 0
                assert deliveries == [0] * len(deliveries), f"a held result was given back: {deliveries}"
                return time.monotonic() >= outage_ends

            await eventually(held, timeout=OUTAGE_S + 10, interval=1.0, message="the outage held through")
            await proxy.restore()
            back = time.monotonic()
            await eventually(lambda: _applied(pool, len(results)), timeout=10, interval=0.05,
                             message="every result applied after the database came back")
            resumed_s = time.monotonic() - back
            print(f"resumed {resumed_s:.2f} s after the database came back, outage {OUTAGE_S:.0f} s")
            assert resumed_s < 2.5
    # Each result delivered once, through the outage and after it: none of the limit spent.
    assert deliveries == [0] * len(results), deliveries
    assert sorted(map(str, await applied_ids(pool))) == sorted(str(r.result_id) for r in results)
    assert len(await fetch(pool, "SELECT 1 FROM question_monitor_runs")) == len(results)
    assert await queue_count(amqp, topology.ingest_dlq) == 0
    assert await queue_count(amqp, topology.ingest_dead_letter_tally) == 0
    assert await queue_count(amqp, topology.ingest_queue(shard)) == 0
    assert dead_letters() == dead_before


async def test_an_outage_longer_than_the_hold_gives_the_deliveries_back_once_per_hold(
        pool, settings, topology, amqp) -> None:
    """With a 2 s hold, a 7 s outage returns the held deliveries about three times (each return one delivery of
    the limit, as the broker's consumer_timeout would otherwise force), and the results are applied once after."""
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=2, platforms=1)
        ex = await make_executions(conn, world, business_date=DAY)
    results = [make_result(e, shards=topology.ingest_shards) for e in ex]
    async with proxied_pool(settings) as (proxy, worker_settings, worker_pool):
        async with running_ingest(worker_pool, worker_settings, topology, db_outage_hold_s=2.0) as worker:
            deliveries = await counting_deliveries(worker.shards[results[0].shard])
            await proxy.cut()
            await publish(amqp, topology, list(results))
            outage_ends = time.monotonic() + 7.0
            await eventually(lambda: time.monotonic() >= outage_ends and len(deliveries) > 2, timeout=20,
                             interval=0.2, message="the held deliveries given back after each hold")
            await proxy.restore()
            await eventually(lambda: _applied(pool, len(results)), timeout=20, message="applied after the outage")
    assert sorted(map(str, await applied_ids(pool))) == sorted(str(r.result_id) for r in results)
    assert await queue_count(amqp, topology.ingest_dlq) == 0
    redeliveries = max(deliveries)
    print(f"x-delivery-count of each delivery: {deliveries}")
    # Given back once per 2 s hold (plus the pause before each requeue), never more: the limit of 5 is not reached.
    assert 1 <= redeliveries < INGEST_DELIVERY_LIMIT, deliveries


async def test_a_result_the_broker_dead_letters_is_counted_once_by_the_alerts_metric(
        pool, settings, topology, amqp) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        [execution] = await make_executions(conn, world, business_date=DAY)
    result = make_result(execution, shards=topology.ingest_shards)
    async with amqp.channel() as channel:
        await declare_ingest(channel, topology)
    await publish(amqp, topology, [result])
    # No ingest worker yet: a consumer that keeps giving the result back, as a crash-looping one would, until the
    # broker dead-letters it past the delivery limit.
    await _spend_delivery_limit(amqp, topology, topology.ingest_queue(result.shard))
    limit_before = m.ingest_dead_letter_count.value(reason="delivery_limit")
    malformed_before = m.ingest_dead_letter_count.value(reason="malformed_json")
    total_before = dead_letters()
    async with running_ingest(pool, settings, topology):
        await eventually(lambda: m.ingest_dead_letter_count.value(reason="delivery_limit") - limit_before == 1,
                         message="the broker's dead letter counted")
        # The worker's own dead letter is counted where it is published, and not a second time by the tally.
        await publish(amqp, topology, [b"{not json"], shard=result.shard)
        await eventually(lambda: m.ingest_dead_letter_count.value(reason="malformed_json") - malformed_before == 1,
                         message="the worker's own dead letter counted")
        await eventually(lambda: _holds(amqp, topology.ingest_dlq, 2), message="both in the DLQ")
        await eventually(lambda: _holds(amqp, topology.ingest_dead_letter_tally, 0), message="the tally drained")
    assert dead_letters() - total_before == 2
    assert await queue_count(amqp, topology.ingest_dlq) == 2  # the DLQ keeps both for a human


async def _spend_delivery_limit(amqp: AbstractRobustConnection, topology: Topology, queue_name: str) -> None:
    """Consume `queue_name` and give every delivery back until the broker has dead-lettered it."""
    deliveries: list[int] = []

    async def give_back(message: AbstractIncomingMessage) -> None:
        deliveries.append(1)
        await message.nack(requeue=True)

    async with amqp.channel() as channel:
        queue = await channel.get_queue(queue_name, ensure=False)
        tag = await queue.consume(give_back)
        await eventually(lambda: queue_count(amqp, topology.ingest_dlq), message="the broker's dead letter in the DLQ")
        await queue.cancel(tag)
    assert len(deliveries) == INGEST_DELIVERY_LIMIT + 1


async def _holds(amqp: AbstractRobustConnection, queue: str, n: int) -> bool:
    return await queue_count(amqp, queue) == n


async def _applied(pool: AsyncConnectionPool[Conn], n: int) -> bool:
    return len(await applied_ids(pool)) >= n
