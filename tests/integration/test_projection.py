"""projection-worker against real Postgres and RabbitMQ: coalesced, overwrite-in-place rebuilds."""

from __future__ import annotations

import random
from decimal import Decimal

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.telemetry import metrics as m
from services.projection_worker.rebuild import ProjectionConfig, Rebuilder
from tests.support.ingest_factory import fetch, make_executions, make_result, make_world, publish, running_ingest
from tests.support.projection import (
    DAY,
    as_rows,
    expected_from_results,
    recomputed_from_facts,
    running_projection,
    running_pump,
    stored,
)
from tests.support.wait import eventually

DOMAINS = ["a.example", "b.example", "c.example.org", "news.example.net", "blog.example.io", "wiki.example"]


def random_citations(rng: random.Random) -> list[str]:
    urls = []
    for _ in range(rng.randint(0, 5)):
        domain = rng.choice(DOMAINS)
        page = rng.randint(1, 4)
        variant = rng.choice(["https://{d}/p{n}", "http://www.{d}/p{n}/", "https://{d}/p{n}?utm_source=x",
                              "https://{d}/p{n}#frag"])
        urls.append(variant.format(d=domain, n=page))
    return urls


async def test_thousand_results_for_one_brand_day_coalesce_into_few_rebuilds(pool, settings, topology, amqp) -> None:
    rng = random.Random(7)
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=250, platforms=4)
        ex = await make_executions(conn, world, business_date=DAY)
    assert len(ex) == 1000
    results = [make_result(e, shards=topology.ingest_shards, status="failed" if rng.random() < 0.1 else "succeeded",
                           brand_mentioned=rng.random() < 0.4, citations=random_citations(rng), error="x")
               for e in ex]
    rebuilds = sum(m.projection_rebuild_count.value(trigger=t) for t in ("event", "sweep"))
    async with (running_ingest(pool, settings, topology, batch_size=100),
                running_projection(pool, settings, topology), running_pump(pool, settings, topology)):
        await publish(amqp, topology, list(results), concurrency=50)

        async def settled() -> bool:
            done = await fetch(pool, "SELECT count(*) AS n FROM ingest_applied_results")
            queued = await fetch(pool, "SELECT count(*) AS n FROM projection_rebuild_queue")
            return done[0]["n"] == 1000 and queued[0]["n"] == 0

        await eventually(settled, timeout=30, message="all applied and the projection served")
    rebuilt = sum(m.projection_rebuild_count.value(trigger=t) for t in ("event", "sweep")) - rebuilds
    # Each ingest transaction requests the rebuild once for its brand/day, and requests made while one is
    # pending coalesce: at most one rebuild per ingest transaction, never one per result. How many of them
    # coalesce further depends on how the projection worker's pace meets ingest's (the machine's load).
    batches = await fetch(pool, "SELECT count(DISTINCT xmin::text) AS n FROM ingest_applied_results")
    assert 1 <= rebuilt <= batches[0]["n"] <= 100, f"{rebuilt} rebuilds for one brand/day, {batches} batches"
    requests = await fetch(pool, "SELECT count(*) AS n FROM outbox WHERE exchange = 'monitor.projection'")
    assert 1 <= requests[0]["n"] <= rebuilt + 1  # type: ignore[operator]
    brand_id = world.brand_ids[0]
    expected = as_rows(expected_from_results(results))
    assert expected[0] is not None and expected[0][0] == 1000
    assert await stored(pool, world.tenant_id, brand_id) == expected
    assert as_rows(await recomputed_from_facts(pool, world.tenant_id, brand_id)) == expected


async def test_sweep_serves_a_request_whose_event_was_lost_and_rebuild_is_idempotent(pool, settings, topology,
                                                                                     amqp) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=3, platforms=2)
        ex = await make_executions(conn, world, business_date=DAY)
    results = [make_result(e, shards=topology.ingest_shards, brand_mentioned=i % 2 == 0)
               for i, e in enumerate(ex)]
    async with running_ingest(pool, settings, topology):
        await publish(amqp, topology, list(results))
        await eventually(lambda: _count(pool, "ingest_applied_results", 6), message="results applied")
    # No pump: the ProjectionRebuild event stays in the outbox, as if lost.
    brand_id = world.brand_ids[0]
    async with running_projection(pool, settings, topology, sweep_interval_s=0.2):
        await eventually(lambda: _count(pool, "projection_rebuild_queue", 0), message="sweep served the key")
    first = await stored(pool, world.tenant_id, brand_id)
    assert first == as_rows(expected_from_results(results))
    assert first[0] is not None and first[0][4] == Decimal("0.5000")
    # Requested again with nothing new: the same figures, overwritten in place.
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date) "
                           "VALUES (%s, %s, %s)", (world.tenant_id, brand_id, DAY))
    rebuilder = Rebuilder(pool, ProjectionConfig(instance_id="manual"))
    [claim] = await rebuilder.claim_oldest(10)
    assert await rebuilder.rebuild(claim, "sweep") is True
    assert await stored(pool, world.tenant_id, brand_id) == first
    rows = await fetch(pool, "SELECT count(*) AS n FROM monitoring_brand_platform_daily")
    assert rows[0]["n"] == 2


async def test_key_requested_again_during_a_rebuild_is_kept_for_the_next_pass(pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        await conn.execute("INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date) "
                           "VALUES (%s, %s, %s)", (world.tenant_id, world.brand_ids[0], DAY))
    a = Rebuilder(pool, ProjectionConfig(instance_id="a"))
    b = Rebuilder(pool, ProjectionConfig(instance_id="b"))
    [claim] = await a.claim_oldest(10)
    assert await b.claim_oldest(10) == []  # claimed: another worker skips it
    assert await b.claim_key(world.tenant_id, world.brand_ids[0], DAY) is None
    async with pool.connection() as conn:  # what ingest does when a new result lands meanwhile
        await conn.execute("UPDATE projection_rebuild_queue SET last_requested_at = clock_timestamp(), "
                           "request_count = request_count + 1")
    assert await a.rebuild(claim, "event") is False
    [row] = await fetch(pool, "SELECT claimed_by, request_count FROM projection_rebuild_queue")
    assert (row["claimed_by"], row["request_count"]) == (None, 2)
    [again] = await b.claim_oldest(10)
    assert await b.rebuild(again, "sweep") is True
    assert await fetch(pool, "SELECT 1 FROM projection_rebuild_queue") == []
    # An expired claim can be taken over; the old holder's late rebuild is rolled back.
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date) "
                           "VALUES (%s, %s, %s)", (world.tenant_id, world.brand_ids[0], DAY))
    [stale] = await a.claim_oldest(10)
    async with pool.connection() as conn:
        await conn.execute("UPDATE projection_rebuild_queue SET claim_expires_at = now() - interval '1 second'")
    [taken] = await b.claim_oldest(10)
    assert await a.rebuild(stale, "sweep") is False
    assert await b.rebuild(taken, "sweep") is True


async def _count(pool: AsyncConnectionPool[Conn], table: str, n: int) -> bool:
    rows = await fetch(pool, f"SELECT count(*) AS n FROM {table}")
    return rows[0]["n"] == n
