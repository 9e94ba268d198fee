"""Result ingest throughput with 1, 2 and 4 `ingest-shard-workers` processes, and projection rebuilds/s.

For each worker count: a fresh database and broker prefix (16 shards), N business tasks with an
in-progress execution each, N MonitorResults published to the shard queues up front (90% succeeded,
0-5 citations each), then the worker processes are started and drain them. Figures:
- steady results/s: applied results per second while every worker process is active (from the
  `ingest_applied_results` ledger: window from the moment the last worker applied its first result),
- overall results/s: all N over first-to-last applied (includes start-up and shard rebalancing).
Projection: rebuilds/s of one projection worker (2 concurrent loops) over brand/day keys of 500 runs, and
keys/s rebuilt in merge mode (auto slow-down): every key in one transaction per batch, one loop.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from datetime import date
from pathlib import Path

import aio_pika
from psycopg_pool import AsyncConnectionPool

from bench.common import bench_environment
from libs.config import Settings
from libs.db.pool import Conn, make_pool
from libs.mq.topology import Topology, declare_ingest
from services.projection_worker.rebuild import ProjectionConfig, Rebuilder
from tests.support.ingest_factory import World, make_executions, make_result, make_world, publish_results
from tests.support.procs import ServiceProcess, service_env

SHARDS = 16


async def _prepare(settings: Settings, pool: AsyncConnectionPool[Conn], n_results: int) -> int:
    """Business tasks + executions for n_results, results published; returns the number of brand/day keys."""
    questions, platforms = 125, 4
    brands = max(1, n_results // (questions * platforms))
    rng = random.Random(5)
    async with pool.connection() as conn:
        world = await make_world(conn, brands=brands, questions=questions, platforms=platforms)
        executions = await make_executions(conn, world, business_date=date(2026, 3, 20))
    results = [make_result(e, shards=SHARDS, status="failed" if rng.random() < 0.1 else "succeeded",
                           brand_mentioned=rng.random() < 0.4, error="timeout",
                           citations=[f"https://d{rng.randint(1, 40)}.example/p{rng.randint(1, 20)}"
                                      for _ in range(rng.randint(0, 5))])
               for e in executions]
    topology = Topology(settings.mq_prefix, SHARDS)
    connection = await aio_pika.connect_robust(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        await declare_ingest(channel, topology)
        await publish_results(channel, topology, results, concurrency=500)
    return brands


async def _applied_stats(pool: AsyncConnectionPool[Conn]) -> dict[str, float]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "WITH firsts AS (SELECT applied_by, min(applied_at) AS first FROM ingest_applied_results GROUP BY 1) "
            "SELECT (SELECT count(*) FROM ingest_applied_results) AS total, "
            "extract(epoch FROM max(a.applied_at) - min(a.applied_at)) AS wall_s, "
            "(SELECT count(*) FROM ingest_applied_results "
            " WHERE applied_at >= (SELECT max(first) FROM firsts)) AS steady_n, "
            "extract(epoch FROM max(a.applied_at) - (SELECT max(first) FROM firsts)) AS steady_s, "
            "(SELECT count(*) FROM firsts) AS workers "
            "FROM ingest_applied_results a")
        row = await cur.fetchone()
    assert row is not None
    return {k: float(v or 0) for k, v in row.items()}


async def run_ingest(workers: int, n_results: int) -> dict[str, float]:
    async with bench_environment(shards=SHARDS) as settings:
        pool = make_pool(settings, name="bench-ingest", min_size=1, max_size=4)
        await pool.open(wait=True)
        try:
            await _prepare(settings, pool, n_results)
            log_dir = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
            env = service_env(settings, INGEST_MEMBER_HEARTBEAT_SECONDS="0.5", LOG_LEVEL="WARNING", DB_POOL_MAX=4)
            procs = [ServiceProcess("ingest-shard-workers", {**env, "INSTANCE_ID": f"w{i}"}, log_dir=log_dir)
                     for i in range(workers)]
            started = time.monotonic()
            await asyncio.gather(*(asyncio.to_thread(p.start) for p in procs))
            try:
                while True:
                    stats = await _applied_stats(pool)
                    if stats["total"] >= n_results:
                        break
                    if time.monotonic() - started > 300:
                        raise RuntimeError(f"ingest did not finish: {stats}")
                    await asyncio.sleep(0.25)  # benchmark progress poll
            finally:
                await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs))
            return stats
        finally:
            await pool.close()


async def _projection_world(pool: AsyncConnectionPool[Conn], keys: int, runs_per_key: int) -> tuple[World, date]:
    """`keys` brand/day keys of `runs_per_key` runs each, 3 citation facts per run, written straight in
    (the ingest figure is measured above)."""
    questions = runs_per_key // 4
    day = date(2026, 3, 21)
    async with pool.connection() as conn:
        world = await make_world(conn, brands=keys, questions=questions, platforms=4)
        await make_executions(conn, world, business_date=day)
        await conn.execute(
            "INSERT INTO question_monitor_runs (tenant_id, workspace_id, brand_id, question_id, "
            "ai_platform_id, collector_type, run_mode, business_date, status, brand_mentioned, citation_count) "
            "SELECT tenant_id, workspace_id, brand_id, question_id, ai_platform_id, 'desktop', 'daily', "
            "business_date, CASE WHEN id % 10 = 0 THEN 'failed' ELSE 'succeeded' END, id % 3 = 0, 3 "
            "FROM monitoring_collect_tasks")
        await conn.execute(
            "INSERT INTO monitoring_citation_facts (run_id, tenant_id, brand_id, question_id, ai_platform_id, "
            "business_date, citation_fingerprint, url, domain) "
            "SELECT r.id, r.tenant_id, r.brand_id, r.question_id, r.ai_platform_id, r.business_date, "
            "md5(r.id || '-' || g), 'https://d' || (r.id * g) % 50 || '.example/', "
            "'d' || (r.id * g) % 50 || '.example' FROM question_monitor_runs r, generate_series(1, 3) g")
    return world, day


async def run_projection(keys: int, runs_per_key: int, seconds: float) -> tuple[float, float, float]:
    """(per-key rebuilds/s with 2 loops, keys/s rebuilt in merge batches of all `keys` with 1 loop,
    mean ms per merged batch)."""
    async with bench_environment(shards=SHARDS) as settings:
        pool = make_pool(settings, name="bench-projection", min_size=1, max_size=4)
        await pool.open(wait=True)
        try:
            world, day = await _projection_world(pool, keys, runs_per_key)
            rebuilder = Rebuilder(pool, ProjectionConfig(instance_id="bench"))

            async def request_all() -> None:
                async with pool.connection() as conn:
                    await conn.execute(
                        "INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date) "
                        "SELECT %s, b, %s FROM unnest(%s::bigint[]) b ON CONFLICT DO NOTHING",
                        (world.tenant_id, day, world.brand_ids))

            done = 0
            deadline = time.monotonic() + seconds

            async def loop() -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    await request_all()
                    for claim in await rebuilder.claim_oldest(10):
                        await rebuilder.rebuild(claim, "sweep")
                        done += 1

            began = time.monotonic()
            await asyncio.gather(loop(), loop())
            per_key = done / (time.monotonic() - began)

            # Merge mode: one worker, one batch of every key per transaction, back to back.
            async with pool.connection() as conn:
                await conn.execute("DELETE FROM projection_rebuild_queue")
            merged = batches = 0
            deadline = time.monotonic() + seconds
            began = time.monotonic()
            while time.monotonic() < deadline:
                await request_all()
                merged += (await rebuilder.rebuild_merged(await rebuilder.claim_oldest(keys))).rebuilt
                batches += 1
            elapsed = time.monotonic() - began
            return per_key, merged / elapsed, elapsed * 1000 / max(1, batches)
        finally:
            await pool.close()


async def run(args: argparse.Namespace) -> None:
    n_results = 4_000 if args.quick else 20_000
    defaults = Settings()
    print(f"ingest: {n_results} results, {SHARDS} shards, batch {defaults.ingest_batch_size}, prefetch "
          f"{defaults.ingest_prefetch}, 90% succeeded, 0-5 citations")
    for workers in (1, 2, 4):
        stats = await run_ingest(workers, n_results)
        steady = stats["steady_n"] / stats["steady_s"] if stats["steady_s"] > 0 else float("nan")
        overall = stats["total"] / stats["wall_s"] if stats["wall_s"] > 0 else float("nan")
        print(f"  {workers} worker process(es): steady {steady:,.0f} results/s, overall {overall:,.0f} results/s "
              f"({int(stats['total'])} in {stats['wall_s']:.2f}s, {int(stats['workers'])} applied)", flush=True)
    seconds = 3.0 if args.quick else 10.0
    rate, merged, batch_ms = await run_projection(keys=20, runs_per_key=500, seconds=seconds)
    print(f"projection: {rate:,.0f} rebuilds/s (brand/day keys of 500 runs + 1,350 citation facts, 2 loops)",
          flush=True)
    print(f"projection merge mode: {merged:,.0f} keys/s rebuilt in merge batches (20 keys per transaction, "
          f"{batch_ms:,.0f} ms per batch, 1 loop)", flush=True)
