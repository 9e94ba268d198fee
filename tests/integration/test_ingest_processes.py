"""Real `ingest-shard-workers` (and `projection-worker`) processes sharing the shard queues."""

from __future__ import annotations

import asyncio
import itertools
import random
from datetime import date
from pathlib import Path

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.ingest.aggregates import CitationFact, RunFact, compute_daily
from libs.ingest.citations import parse_citations
from tests.support.ingest_factory import fetch, make_executions, make_result, make_world, publish, shard_of
from tests.support.procs import ServiceProcess, service_env
from tests.support.wait import eventually

DAY = date(2026, 3, 16)


def worker(settings: Settings, log_dir: Path, name: str, **env: str | int) -> ServiceProcess:
    return ServiceProcess("ingest-shard-workers", service_env(settings, INSTANCE_ID=name,
                                                              INGEST_MEMBER_HEARTBEAT_SECONDS="0.3", **env),
                          log_dir=log_dir)


async def applied(pool: AsyncConnectionPool[Conn]) -> list[dict[str, object]]:
    return await fetch(pool, "SELECT result_id, applied_by FROM ingest_applied_results ORDER BY seq")


async def test_one_shard_across_two_workers_is_applied_in_publish_order(pool, settings, topology, amqp,
                                                                        tmp_path) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=150, platforms=2)
        ex = await make_executions(conn, world, business_date=DAY)
    results = [make_result(e, shards=topology.ingest_shards) for e in ex]
    # One result per transaction, so the stream lasts long enough to hand the shard over mid-way.
    w1 = worker(settings, tmp_path, "w1", INGEST_BATCH_SIZE=1, INGEST_PREFETCH=20)
    w2 = worker(settings, tmp_path, "w2", INGEST_BATCH_SIZE=1, INGEST_PREFETCH=20)
    await asyncio.to_thread(w1.start)
    await asyncio.to_thread(w2.start)
    try:
        publisher = asyncio.create_task(publish(amqp, topology, list(results)))

        async def some_applied() -> list[dict[str, object]] | None:
            rows = await applied(pool)
            return rows if len(rows) >= 60 else None

        active = str((await eventually(some_applied, timeout=20, message="first results applied"))[-1]["applied_by"])
        # Graceful stop of the active consumer mid-stream: the other replica takes the shard over.
        stopping = w1 if active == "w1" else w2
        assert await asyncio.to_thread(stopping.stop) == 0
        await publisher
        await eventually(lambda: _n_applied(pool, len(results)), timeout=30, message="every result applied")
    finally:
        w1.stop()
        w2.stop()
    rows = await applied(pool)
    assert [r["result_id"] for r in rows] == [r.result_id for r in results]
    assert {r["applied_by"] for r in rows} == {"w1", "w2"}
    # Never interleaved: the shard moved at most twice (rebalancing to its assigned replica, the stop).
    owners = [r["applied_by"] for r in rows]
    assert 1 <= sum(1 for a, b in itertools.pairwise(owners) if a != b) <= 2
    assert "Traceback" not in stopping.logs()


async def test_worker_killed_mid_stream_loses_nothing_and_counts_nothing_twice(pool, settings, topology, amqp,
                                                                               tmp_path) -> None:
    rng = random.Random(11)
    async with pool.connection() as conn:
        world = await make_world(conn, brands=4, questions=50, platforms=4)
        ex = await make_executions(conn, world, business_date=DAY)
    assert len({shard_of(e, topology.ingest_shards) for e in ex}) >= 2
    results = [make_result(e, shards=topology.ingest_shards, status="failed" if rng.random() < 0.1 else "succeeded",
                           brand_mentioned=rng.random() < 0.5, error="x",
                           citations=[f"https://d{rng.randint(1, 9)}.example/p{rng.randint(1, 3)}"
                                      for _ in range(rng.randint(0, 4))]) for e in ex]
    w1 = worker(settings, tmp_path, "w1", INGEST_BATCH_SIZE=20, INGEST_PREFETCH=40)
    w2 = worker(settings, tmp_path, "w2", INGEST_BATCH_SIZE=20, INGEST_PREFETCH=40)
    projection = ServiceProcess("projection-worker", service_env(settings, PROJECTION_SWEEP_INTERVAL_MS=200),
                                log_dir=tmp_path)
    for proc in (w1, w2, projection):
        await asyncio.to_thread(proc.start)
    try:
        publisher = asyncio.create_task(publish(amqp, topology, list(results), concurrency=10))
        await eventually(lambda: _n_applied(pool, 150), timeout=20, message="a part applied")
        w1.kill()
        await publisher
        await eventually(lambda: _n_applied(pool, len(results)), timeout=30, message="every result applied")
        await eventually(lambda: _queue_empty(pool), timeout=20, message="projections served")
    finally:
        for proc in (w1, w2, projection):
            proc.stop()
    assert len(await applied(pool)) == len(results)
    runs = await fetch(pool, "SELECT result_id FROM question_monitor_runs")
    assert sorted(str(r["result_id"]) for r in runs) == sorted(str(r.result_id) for r in results)
    executions = await fetch(pool, "SELECT status, count(*) AS n FROM desktop_tasks GROUP BY status")
    by_status = {e["status"]: e["n"] for e in executions}
    assert by_status == {s: sum(1 for r in results if r.status == s) for s in ("succeeded", "failed")}
    # Exactly one lifecycle event per result, even for the batch that was committed but never acked.
    events = await fetch(pool, "SELECT count(*) AS n FROM outbox WHERE exchange = 'monitor.lifecycle'")
    assert events[0]["n"] == len(results)
    completed = await fetch(pool, "SELECT count(*) AS n FROM monitoring_collect_tasks WHERE status = 'completed'")
    assert completed[0]["n"] == by_status["succeeded"]
    for brand_id in world.brand_ids:
        mine = [r for r in results if r.brand_id == brand_id]
        brand, platforms = compute_daily(
            [RunFact(i, r.ai_platform_id, r.status, r.brand_mentioned) for i, r in enumerate(mine)],
            [CitationFact(i, c.domain) for i, r in enumerate(mine) if r.status == "succeeded"
             for c in parse_citations(r.citations)])
        assert brand is not None
        [row] = await fetch(pool, "SELECT runs, succeeded_runs, failed_runs, brand_mentioned_runs, mention_rate, "
                                  "citations, distinct_cited_domains FROM monitoring_brand_daily "
                                  "WHERE tenant_id = %s AND brand_id = %s AND business_date = %s",
                            world.tenant_id, brand_id, DAY)
        assert tuple(row.values()) == (brand.runs, brand.succeeded_runs, brand.failed_runs,
                                       brand.brand_mentioned_runs, brand.mention_rate, brand.citations,
                                       brand.distinct_cited_domains)
        stored = await fetch(pool, "SELECT ai_platform_id, runs, citations FROM monitoring_brand_platform_daily "
                                   "WHERE tenant_id = %s AND brand_id = %s", world.tenant_id, brand_id)
        assert {r["ai_platform_id"]: (r["runs"], r["citations"]) for r in stored} == {
            k: (v.runs, v.citations) for k, v in platforms.items()}


async def _n_applied(pool: AsyncConnectionPool[Conn], n: int) -> bool:
    rows = await fetch(pool, "SELECT count(*) AS n FROM ingest_applied_results")
    return rows[0]["n"] >= n  # type: ignore[operator]


async def _queue_empty(pool: AsyncConnectionPool[Conn]) -> bool:
    rows = await fetch(pool, "SELECT count(*) AS n FROM projection_rebuild_queue")
    return rows[0]["n"] == 0
