"""projection-worker merge mode (§12.4) against real Postgres and RabbitMQ: while the coordinator publishes
auto slow-down, events are acked without a rebuild and the queue is rebuilt in batches, one transaction each."""

from __future__ import annotations

import asyncio
import json
import random
from datetime import date, timedelta

from aio_pika.abc import AbstractRobustConnection
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import MonitorResult
from libs.db.pool import Conn
from libs.mq.topology import Topology
from libs.telemetry import metrics as m
from services.projection_worker.rebuild import ProjectionConfig, Rebuilder
from tests.support.ingest_factory import (
    Execution,
    fetch,
    make_executions,
    make_result,
    make_world,
    publish,
    running_ingest,
)
from tests.support.projection import DAY, as_rows, recomputed_from_facts, running_projection, running_pump, stored
from tests.support.wait import eventually

DAY2 = DAY + timedelta(days=1)
TABLES = {
    "monitoring_brand_daily": ("tenant_id", "brand_id", "business_date"),
    "monitoring_brand_platform_daily": ("tenant_id", "brand_id", "business_date", "ai_platform_id"),
}
Key = tuple[int, int, date]


def results_for(executions: list[Execution], shards: int, rng: random.Random, *,
                all_failed: bool = False) -> list[MonitorResult]:
    return [make_result(e, shards=shards, status="failed" if all_failed or rng.random() < 0.15 else "succeeded",
                        brand_mentioned=rng.random() < 0.5, error="x",
                        citations=[f"https://{rng.choice(['a', 'b', 'c', 'd'])}.example/p{rng.randint(1, 3)}"
                                   for _ in range(rng.randint(0, 4))])
            for e in executions]


async def make_results(pool: AsyncConnectionPool[Conn], shards: int, seed: int = 3) -> (
    tuple[list[Key], list[MonitorResult]]
):
    """Keys over two tenants and two business dates: one brand whose runs all failed, others mixed."""
    rng = random.Random(seed)
    results: list[MonitorResult] = []
    keys: list[Key] = []
    async with pool.connection() as conn:
        for brands, dates in ((4, (DAY, DAY2)), (3, (DAY,))):
            world = await make_world(conn, brands=brands, questions=3, platforms=3)
            for day in dates:
                for i, brand_id in enumerate(world.brand_ids[:3] if day == DAY2 else world.brand_ids):
                    ex = await make_executions(conn, world, business_date=day, brand_id=brand_id)
                    results += results_for(ex, shards, rng, all_failed=i == 0 and day == DAY)
                    keys.append((world.tenant_id, brand_id, day))
    return keys, results


async def ingest(pool: AsyncConnectionPool[Conn], amqp: AbstractRobustConnection, topology: Topology,
                 results: list[MonitorResult], applied_before: int = 0) -> None:
    await publish(amqp, topology, list(results), concurrency=20)
    await eventually(lambda: _count(pool, "SELECT count(*) AS n FROM ingest_applied_results",
                                    applied_before + len(results)), timeout=20, message="results applied")


async def dump(pool: AsyncConnectionPool[Conn]) -> dict[str, list[tuple[object, ...]]]:
    """Both projection tables, every column but rebuilt_at, in key order."""
    out = {}
    for table, key in TABLES.items():
        rows = await fetch(pool, f"SELECT * FROM {table} ORDER BY {', '.join(key)}")
        out[table] = [tuple(v for k, v in r.items() if k != "rebuilt_at") for r in rows]
    return out


async def set_slowdown(pool: AsyncConnectionPool[Conn], active: bool, reasons: list[str]) -> None:
    """What the dispatch-coordinator's maintenance round publishes (services/dispatch_coordinator)."""
    value = {"active": active, "reasons": reasons, "since": None, "signals": {"projection_lag_ms": 61_000.0}}
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO dispatch_coordinator_state (key, value, updated_at) "
                           "VALUES ('slowdown', %s::jsonb, now()) "
                           "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()",
                           (json.dumps(value),))


async def _count(pool: AsyncConnectionPool[Conn], query: str, n: int) -> bool:
    rows = await fetch(pool, query)
    return rows[0]["n"] == n


def rebuilds() -> dict[str, float]:
    return {t: m.projection_rebuild_count.value(trigger=t) for t in ("event", "sweep", "merge")}


async def test_merged_rebuild_equals_rebuilding_each_key_alone(pool, settings, topology, amqp) -> None:
    keys, results = await make_results(pool, topology.ingest_shards)
    async with running_ingest(pool, settings, topology):
        await ingest(pool, amqp, topology, results)
    (t1, b1, _), (t2, b2, _) = keys[0], keys[-1]
    empty_key = (t2, b2, DAY2)  # requested, but it has no runs: its stale rows go
    bystander = (t1, b1, DAY + timedelta(days=5))  # not requested: untouched

    async def stale_rows() -> None:
        async with pool.connection() as conn:
            for t, b, d in (empty_key, bystander):
                await conn.execute("INSERT INTO monitoring_brand_daily (tenant_id, brand_id, business_date, runs) "
                                   "VALUES (%s, %s, %s, 9)", (t, b, d))
                await conn.execute("INSERT INTO monitoring_brand_platform_daily (tenant_id, brand_id, business_date, "
                                   "ai_platform_id, runs) VALUES (%s, %s, %s, 424242, 9)", (t, b, d))
            # A platform of a requested key that has no runs any more.
            await conn.execute("INSERT INTO monitoring_brand_platform_daily (tenant_id, brand_id, business_date, "
                               "ai_platform_id, runs) VALUES (%s, %s, %s, 424242, 9)", keys[1])
            await conn.execute("INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date) "
                               "VALUES (%s, %s, %s) ON CONFLICT DO NOTHING", empty_key)

    requested = [*keys, empty_key]
    await stale_rows()
    assert await _count(pool, "SELECT count(*) AS n FROM projection_rebuild_queue", len(requested))

    merged = Rebuilder(pool, ProjectionConfig(instance_id="merge"))
    claims = await merged.claim_oldest(500)
    assert len(claims) == len(requested)
    before = rebuilds()
    outcome = await merged.rebuild_merged(claims)
    assert (outcome.rebuilt, outcome.served, outcome.rerequested, outcome.lost) == (len(requested),) * 2 + (0, 0)
    assert rebuilds()["merge"] - before["merge"] == len(requested)
    assert await fetch(pool, "SELECT 1 FROM projection_rebuild_queue") == []
    after_merge = await dump(pool)
    stamps = await fetch(pool, "SELECT count(DISTINCT rebuilt_at) AS n FROM (SELECT business_date, rebuilt_at FROM "
                               "monitoring_brand_daily UNION ALL SELECT business_date, rebuilt_at FROM "
                               "monitoring_brand_platform_daily) s WHERE business_date <> %s", bystander[2])
    assert stamps[0]["n"] == 1  # every rebuilt row written by one transaction

    # The same starting point, rebuilt one key per transaction.
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM monitoring_brand_daily")
        await conn.execute("DELETE FROM monitoring_brand_platform_daily")
        await conn.execute("INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date) "
                           "SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::date[])",
                           ([k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]))
    await stale_rows()
    alone = Rebuilder(pool, ProjectionConfig(instance_id="alone"))
    for claim in await alone.claim_oldest(500):
        assert await alone.rebuild(claim, "sweep") is True
    assert await dump(pool) == after_merge

    for t, b, d in keys:
        expected = as_rows(await recomputed_from_facts(pool, t, b, d))
        assert expected[0] is not None
        assert await stored(pool, t, b, d) == expected
    assert await stored(pool, *empty_key) == (None, {})
    assert (await stored(pool, *bystander))[0] == (9, 0, 0, 0, 0, 0, 0)
    failed_only = await stored(pool, *keys[0])
    assert failed_only[0] is not None and failed_only[0][1] == 0 and failed_only[0][5] == 0


async def test_slowdown_acks_events_without_rebuild_then_one_merge_pass(pool, settings, topology, amqp) -> None:
    keys, results = await make_results(pool, topology.ingest_shards, seed=11)
    late_key = keys[2]
    late = next(r for r in results if (r.tenant_id, r.brand_id, r.business_date) == late_key)
    early = [r for r in results if r is not late]
    await set_slowdown(pool, True, ["projection_lag"])
    before, deferred = rebuilds(), m.projection_rebuild_deferred_count.value()
    # A window far longer than the test: the only merge pass is the one run below.
    async with (running_ingest(pool, settings, topology),
                running_projection(pool, settings, topology, sweep_interval_s=0.1, merge_window_s=3600) as worker):
        assert worker.mode.merge and worker.mode.reasons == ("projection_lag",)
        assert REGISTRY.get_sample_value("projection_merge_mode_active") == 1
        await ingest(pool, amqp, topology, early)
        async with running_pump(pool, settings, topology):
            await eventually(lambda: _deferred(deferred, len(keys)), timeout=15, message="every event acked")
        assert rebuilds() == before
        rows = await fetch(pool, "SELECT count(*) AS n, count(claimed_by) AS claimed FROM projection_rebuild_queue")
        assert (rows[0]["n"], rows[0]["claimed"]) == (len(keys), 0)  # the rows stay the requests
        assert await fetch(pool, "SELECT 1 FROM monitoring_brand_daily") == []

        # One merge pass; a result for one key lands between its claim and its rebuild.
        claims = await worker.rebuilder.claim_oldest(worker.merge_batch)
        assert len(claims) == len(keys)
        [late_claim] = [c for c in claims if c.key_tuple == late_key]
        await ingest(pool, amqp, topology, [late], applied_before=len(early))
        outcome = await worker.rebuilder.rebuild_merged(claims)
        assert (outcome.rebuilt, outcome.served, outcome.rerequested) == (len(keys), len(keys) - 1, 1)
        [kept] = await fetch(pool, "SELECT tenant_id, brand_id, business_date, claimed_by, request_count, attempts "
                                   "FROM projection_rebuild_queue")
        assert (kept["tenant_id"], kept["brand_id"], kept["business_date"]) == late_key
        assert (kept["claimed_by"], kept["request_count"], kept["attempts"]) == (None, late_claim.request_count + 1, 0)
        stamps = await fetch(pool, "SELECT count(DISTINCT rebuilt_at) AS n, count(*) AS rows FROM ("
                                   "SELECT rebuilt_at FROM monitoring_brand_daily UNION ALL "
                                   "SELECT rebuilt_at FROM monitoring_brand_platform_daily) s")
        assert stamps[0]["n"] == 1 and stamps[0]["rows"] > len(keys)  # one transaction
        for t, b, d in keys:
            assert await stored(pool, t, b, d) == as_rows(await recomputed_from_facts(pool, t, b, d))
        after = rebuilds()
        assert (after["event"], after["sweep"]) == (before["event"], before["sweep"])
        assert after["merge"] - before["merge"] == len(keys)

        # The kept key goes with the next pass.
        assert await worker.merge_once() == 1
        assert await fetch(pool, "SELECT 1 FROM projection_rebuild_queue") == []
    assert m.projection_rebuild_deferred_count.value() - deferred == len(keys)


async def test_worker_merges_on_its_window_and_returns_to_per_event_when_slowdown_ends(pool, settings, topology,
                                                                                        amqp) -> None:
    keys, results = await make_results(pool, topology.ingest_shards, seed=5)
    first = [r for r in results if (r.tenant_id, r.brand_id, r.business_date) != keys[-1]]
    second = [r for r in results if (r.tenant_id, r.brand_id, r.business_date) == keys[-1]]
    await set_slowdown(pool, True, ["db_write_latency"])
    before, deferred = rebuilds(), m.projection_rebuild_deferred_count.value()
    async with (running_ingest(pool, settings, topology),
                running_projection(pool, settings, topology, sweep_interval_s=0.1, merge_window_s=0.3) as worker,
                running_pump(pool, settings, topology)):
        assert worker.mode.merge
        await ingest(pool, amqp, topology, first)
        await eventually(lambda: _count(pool, "SELECT count(*) AS n FROM projection_rebuild_queue", 0),
                         timeout=15, message="merge passes served the queue")
        await eventually(lambda: _deferred(deferred, len(keys) - 1), timeout=15, message="events acked")
        merged = rebuilds()
        assert merged["merge"] - before["merge"] >= len(keys) - 1
        assert (merged["event"], merged["sweep"]) == (before["event"], before["sweep"])

        await set_slowdown(pool, False, [])

        async def per_event() -> bool:
            return not worker.mode.merge

        await eventually(per_event, message="per-event mode again")
        assert REGISTRY.get_sample_value("projection_merge_mode_active") == 0
        deferred_in_merge_mode = m.projection_rebuild_deferred_count.value()
        await ingest(pool, amqp, topology, second, applied_before=len(first))
        await eventually(lambda: _count(pool, "SELECT count(*) AS n FROM projection_rebuild_queue", 0),
                         timeout=15, message="the new key rebuilt")
        now = rebuilds()
        assert now["merge"] == merged["merge"]
        assert now["event"] + now["sweep"] > merged["event"] + merged["sweep"]
        assert m.projection_rebuild_deferred_count.value() == deferred_in_merge_mode  # not deferred any more
    for t, b, d in keys:
        assert await stored(pool, t, b, d) == as_rows(await recomputed_from_facts(pool, t, b, d))


async def _deferred(before: float, n: int) -> bool:
    return m.projection_rebuild_deferred_count.value() - before >= n



async def test_a_claim_taken_over_is_left_out_and_the_rest_of_the_batch_redone(pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=1, platforms=1)
        for brand_id in world.brand_ids:
            await conn.execute("INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date) "
                               "VALUES (%s, %s, %s)", (world.tenant_id, brand_id, DAY))
            # Stale rows: neither key has runs, so whoever rebuilds a key deletes its row.
            await conn.execute("INSERT INTO monitoring_brand_daily (tenant_id, brand_id, business_date, runs) "
                               "VALUES (%s, %s, %s, 5)", (world.tenant_id, brand_id, DAY))
    a = Rebuilder(pool, ProjectionConfig(instance_id="a"))
    b = Rebuilder(pool, ProjectionConfig(instance_id="b"))
    claims = await a.claim_oldest(10)
    assert len(claims) == 2
    taken_brand = world.brand_ids[1]
    async with pool.connection() as conn:
        await conn.execute("UPDATE projection_rebuild_queue SET claim_expires_at = now() - interval '1 second' "
                           "WHERE brand_id = %s", (taken_brand,))
    [taken] = await b.claim_oldest(10)
    assert taken.brand_id == taken_brand
    outcome = await a.rebuild_merged(claims)
    assert (outcome.rebuilt, outcome.served, outcome.lost) == (1, 1, 1)
    rows = await fetch(pool, "SELECT brand_id FROM monitoring_brand_daily")
    assert [r["brand_id"] for r in rows] == [taken_brand]  # not written by a: b holds it
    [queued] = await fetch(pool, "SELECT brand_id, claimed_by FROM projection_rebuild_queue")
    assert (queued["brand_id"], queued["claimed_by"]) == (taken_brand, "b")
    assert await b.rebuild(taken, "sweep") is True
    assert await fetch(pool, "SELECT 1 FROM monitoring_brand_daily") == []


async def test_a_merge_window_drains_a_backlog_in_batches(pool, settings, topology, amqp) -> None:
    """More keys than one batch: the window merges batch after batch until the queue is drained, so merge
    mode keeps up with any request rate (each batch one transaction)."""
    keys, results = await make_results(pool, topology.ingest_shards, seed=5)
    await set_slowdown(pool, True, ["projection_lag"])
    async with (running_ingest(pool, settings, topology),
                running_projection(pool, settings, topology, sweep_interval_s=0.1, merge_window_s=3600,
                                   merge_batch=3) as worker):
        await ingest(pool, amqp, topology, results)
        rows = await fetch(pool, "SELECT count(*) AS n FROM projection_rebuild_queue")
        assert rows[0]["n"] == len(keys) > 2 * worker.merge_batch
        before = rebuilds()["merge"]
        assert await worker.merge_window(asyncio.Event()) == len(keys)
        assert rebuilds()["merge"] - before == len(keys)
        assert await fetch(pool, "SELECT 1 FROM projection_rebuild_queue") == []
        stamps = await fetch(pool, "SELECT count(DISTINCT rebuilt_at) AS n FROM monitoring_brand_daily")
        assert stamps[0]["n"] == -(-len(keys) // worker.merge_batch)  # one transaction per batch
        for t, b, d in keys:
            assert await stored(pool, t, b, d) == as_rows(await recomputed_from_facts(pool, t, b, d))
