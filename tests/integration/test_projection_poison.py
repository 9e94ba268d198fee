"""projection-worker and a key whose rebuild always fails, against real Postgres and RabbitMQ.

The poison key is real: a trigger in the test's own database refuses the daily row of one brand (a stand-in
for a bug on one key's data); the projection DLQ is unbound on the test's own broker prefix.
"""

from __future__ import annotations

from datetime import UTC, datetime

import aio_pika
import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import ProjectionRebuild
from libs.db.pool import Conn
from libs.dispatch_settings import SettingsCache
from libs.mq.topology import Topology
from libs.telemetry import metrics as m
from services.ingest_shard_workers.apply import apply_batch
from services.projection_worker.consumer import ProjectionWorker
from services.projection_worker.rebuild import ProjectionConfig, Rebuilder
from tests.support.ingest_factory import World, fetch, make_executions, make_result, make_world
from tests.support.projection import DAY, as_rows, recomputed_from_facts, running_projection, stored
from tests.support.wait import eventually

REFUSE_LISTED_BRANDS = """
CREATE TABLE test_poison_brands (brand_id bigint PRIMARY KEY);
CREATE FUNCTION test_refuse_brand() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM test_poison_brands WHERE brand_id = NEW.brand_id) THEN
        RAISE EXCEPTION 'simulated bug: this projection row cannot be stored';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_refuse_brand BEFORE INSERT OR UPDATE ON monitoring_brand_daily
    FOR EACH ROW EXECUTE FUNCTION test_refuse_brand();
"""


@pytest.fixture
async def world(pool: AsyncConnectionPool[Conn]) -> World:
    """Four brands; brand_ids[1] is the poison key (its rebuild is refused)."""
    async with pool.connection() as conn:
        world = await make_world(conn, brands=4, questions=2, platforms=2)
        await conn.execute(REFUSE_LISTED_BRANDS)
        await conn.execute("INSERT INTO test_poison_brands (brand_id) VALUES (%s)", (world.brand_ids[1],))
        return world


async def ingest_results(pool: AsyncConnectionPool[Conn], world: World, shards: int) -> None:
    """Runs for every brand of the day, applied directly: one rebuild request per brand."""
    async with pool.connection() as conn:
        ex = await make_executions(conn, world, business_date=DAY)
        results = [make_result(e, shards=shards, brand_mentioned=i % 2 == 0) for i, e in enumerate(ex)]
        await apply_batch(conn, results, applied_by="test", settings=SettingsCache())


async def queue_rows(pool: AsyncConnectionPool[Conn]) -> dict[int, dict[str, object]]:
    rows = await fetch(pool, "SELECT brand_id, claimed_by, attempts FROM projection_rebuild_queue")
    return {int(r["brand_id"]): r for r in rows}  # type: ignore[call-overload]


async def assert_rebuilt(pool: AsyncConnectionPool[Conn], world: World, brand_ids: list[int]) -> None:
    for brand_id in brand_ids:
        expected = as_rows(await recomputed_from_facts(pool, world.tenant_id, brand_id))
        assert await stored(pool, world.tenant_id, brand_id) == expected
        assert expected[0] is not None


async def drain(amqp: AbstractRobustConnection, queue: str) -> list[tuple[dict[str, object], bytes]]:
    async with amqp.channel() as channel:
        dlq = await channel.get_queue(queue, ensure=False)
        letters = []
        while (message := await dlq.get(fail=False, no_ack=True)) is not None:
            letters.append((dict(message.headers or {}), message.body))
        return letters


async def publish_events(amqp: AbstractRobustConnection, topology: Topology, bodies: list[bytes]) -> None:
    async with amqp.channel() as channel:
        exchange = await channel.get_exchange(topology.projection_exchange, ensure=False)
        for body in bodies:
            await exchange.publish(aio_pika.Message(body, content_type="application/json",
                                                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                                   routing_key="rebuild")


def event(world: World, brand_id: int) -> bytes:
    return msgspec.json.encode(ProjectionRebuild(tenant_id=world.tenant_id, brand_id=brand_id, business_date=DAY,
                                                 requested_at=datetime.now(UTC)))


async def test_a_poison_key_is_released_and_the_sweep_rebuilds_the_others(pool, topology, amqp, world) -> None:
    await ingest_results(pool, world, topology.ingest_shards)
    poison, good = world.brand_ids[1], [b for b in world.brand_ids if b != world.brand_ids[1]]
    async with pool.connection() as conn:  # the oldest request: claimed first
        await conn.execute("UPDATE projection_rebuild_queue SET requested_at = requested_at - interval '1 minute' "
                           "WHERE brand_id = %s", (poison,))
    worker = ProjectionWorker(amqp, topology, Rebuilder(pool, ProjectionConfig(instance_id="projection-a")))
    failed = m.projection_rebuild_failed_count.value()

    assert await worker.sweep_once() == 3
    rows = await queue_rows(pool)
    assert list(rows) == [poison]  # the others were served at once, not left claimed until their lease expires
    assert (rows[poison]["claimed_by"], rows[poison]["attempts"]) == (None, 1)  # released, the attempt counted
    await assert_rebuilt(pool, world, good)
    assert (await stored(pool, world.tenant_id, poison)) == (None, {})
    assert m.projection_rebuild_failed_count.value() - failed == 1

    assert await worker.sweep_once() == 0  # tried again on the next pass, until max_attempts
    assert (await queue_rows(pool))[poison]["attempts"] == 2


async def test_a_poison_key_event_is_dead_lettered_with_its_reason_and_acked(pool, settings, topology, amqp,
                                                                            world) -> None:
    poison, good = world.brand_ids[1], [b for b in world.brand_ids if b != world.brand_ids[1]]
    m.projection_queue_depth.set(-1)
    async with running_projection(pool, settings, topology, sweep_interval_s=60):
        # Its first sweep, over an empty queue, is over: from now on only the events rebuild.
        await eventually(lambda: REGISTRY.get_sample_value("projection_queue_depth") == 0,
                         message="the first sweep done")
        await ingest_results(pool, world, topology.ingest_shards)
        await publish_events(amqp, topology, [event(world, poison), *(event(world, b) for b in good)])
        await eventually(lambda: _only_poison_left(pool, poison), message="the good keys rebuilt by their events")
        letters: list[tuple[dict[str, object], bytes]] = []

        async def dead_lettered() -> bool:
            letters.extend(await drain(amqp, topology.projection_dlq))
            return len(letters) >= 1

        await eventually(dead_lettered, message="the poison key's event dead-lettered")
    await assert_rebuilt(pool, world, good)
    [(headers, body)] = letters
    reason = str(headers["x-dead-letter-reason"])
    assert reason.startswith("rebuild_failed: RaiseException P0001: simulated bug"), reason
    assert msgspec.json.decode(body, type=ProjectionRebuild).brand_id == poison
    # Tried once by its event, not once per redelivery; the row stays for the sweep to retry.
    assert (await queue_rows(pool))[poison]["attempts"] == 1
    assert await drain(amqp, topology.projection_queue) == []  # nothing requeued or left unacked


async def test_an_unroutable_dead_letter_keeps_the_event(pool, settings, topology, amqp) -> None:
    unconfirmed = m.projection_dead_letter_unconfirmed_count.value()
    async with running_projection(pool, settings, topology, sweep_interval_s=60):
        async with amqp.channel() as channel:
            dlq = await channel.get_queue(topology.projection_dlq, ensure=False)
            await dlq.unbind(topology.dlx_exchange, routing_key=topology.projection_dlq)
        await publish_events(amqp, topology, [b'{"type": "projection_rebuild"}'])
        # A delivery tries once, then requeues the event: a second refusal is its redelivery.
        await eventually(lambda: m.projection_dead_letter_unconfirmed_count.value() - unconfirmed >= 2,
                         message="the dead letter refused on the redelivery too")
        async with amqp.channel() as channel:
            dlq = await channel.get_queue(topology.projection_dlq, ensure=False)
            await dlq.bind(topology.dlx_exchange, routing_key=topology.projection_dlq)
        letters: list[tuple[dict[str, object], bytes]] = []

        async def dead_lettered() -> bool:
            letters.extend(await drain(amqp, topology.projection_dlq))
            return len(letters) >= 1

        await eventually(dead_lettered, timeout=15, message="the event dead-lettered once routable")
    [(headers, body)] = letters
    assert body == b'{"type": "projection_rebuild"}'
    assert str(headers["x-dead-letter-reason"]).startswith("invalid_message")
    assert await drain(amqp, topology.projection_queue) == []


async def _only_poison_left(pool: AsyncConnectionPool[Conn], poison: int) -> bool:
    return list(await queue_rows(pool)) == [poison]
