"""Auto slow-down from the real writers: a slow monitoring database seen by the ingest workers (a lock held on
the rows their results update) pauses normal dispatch through the shared write-health table (the coordinator's
maintenance and dispatch pass: high work still goes, normal does not), and its end resumes it. Also: a stale
writer row stops counting, and conflicts count across writers."""

from __future__ import annotations

import asyncio
from datetime import date

from aio_pika.abc import AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn, connect
from libs.db.write_health import WriterHealth, publishing
from libs.domain.slowdown import WriteStats
from libs.mq.topology import Topology
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig
from services.dispatch_coordinator.maintenance import measure_signals
from services.dispatch_coordinator.scanner import scan_once
from tests.support.dispatch_fleet import seed_fleet
from tests.support.ingest_factory import make_executions, make_result, make_world, publish, running_ingest
from tests.support.wait import eventually

DAY = date(2026, 3, 14)


async def _signals(pool: AsyncConnectionPool[Conn]) -> tuple[float, float]:
    async with pool.connection() as conn:
        signals = await measure_signals(conn, WriteStats(), min_writes=1)
    return signals.write_p95_ms, signals.conflict_rate


async def _dispatched_lanes(pool: AsyncConnectionPool[Conn], tenant_id: int) -> dict[str, int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT lane, count(*)::int AS n FROM desktop_tasks WHERE tenant_id = %s "
                                 "GROUP BY lane", (tenant_id,))
        return {r["lane"]: r["n"] for r in await cur.fetchall()}


async def _ingest_waits_on(pool: AsyncConnectionPool[Conn], holder_pid: int) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*)::int AS n FROM pg_stat_activity "
                                 "WHERE %s = ANY (pg_blocking_pids(pid))", (holder_pid,))
        row = await cur.fetchone()
    return row is not None and row["n"] > 0


async def test_a_slow_ingest_database_pauses_normal_dispatch_and_its_end_resumes_it(
        settings: Settings, pool: AsyncConnectionPool[Conn], topology: Topology,
        amqp: AbstractRobustConnection) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        (execution,) = await make_executions(conn, world, business_date=DAY)
        # Work for the coordinator: a tenant with online clients, due plans turned into pending normal tasks by the
        # scanner, one of them moved to the high lane (a collect-now).
        fleet = (await seed_fleet(conn, plans_per_tenant=[6], clients_per_tenant=2, max_queue_depth=100)).tenants[0]
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 100 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 100")
    await scan_once(pool, batch_size=100, rollout_percentage=100)
    async with pool.connection() as conn:
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_lane = 'high', dispatch_priority = 5000 "
                           "WHERE id = (SELECT min(id) FROM monitoring_collect_tasks WHERE tenant_id = %s)",
                           (fleet.tenant_id,))
    coordinator = Coordinator(pool, CoordinatorConfig(database_url=settings.database_url, topology=topology,
                                                      instance_id="coordinator-write-health"))
    assert (await coordinator.settings()).db_write_p95_threshold_ms == 500
    await coordinator.maintain_once()
    assert not coordinator.slowdown.active  # healthy before the fault

    health = WriterHealth("ingest", "ingest-slow", window_s=3.0, min_samples=1)
    async with running_ingest(pool, settings, topology, write_health=health), publishing(health, pool, 0.2):
        holder = await connect(settings.database_url)
        try:
            await holder.execute("BEGIN")
            await holder.execute("SELECT id FROM desktop_tasks WHERE id = %s FOR UPDATE", (execution.task_id,))
            await publish(amqp, topology, [make_result(execution, shards=topology.ingest_shards)])
            await eventually(lambda: _ingest_waits_on(pool, holder.info.backend_pid), timeout=10,
                             message="the ingest write blocked on the locked row")
            await asyncio.sleep(1.0)  # the fault: the blocked ingest write waits this long (a duration, not a poll)
        finally:
            await holder.execute("ROLLBACK")
            await holder.close()

        async def paused() -> bool:
            await coordinator.maintain_once()
            return coordinator.slowdown.active

        await eventually(paused, timeout=10, message="the ingest writer's slow batch pauses the coordinator")
        assert coordinator.slowdown.reasons == ["db_write_latency"]
        assert coordinator.slowdown.signals.write_p95_ms >= 1000
        # The coordinator's own pass while slowed down: the high task goes, no normal (nor retry) work does.
        outcome = await coordinator.dispatcher.run_pass(await coordinator.settings())
        assert outcome.dispatched == outcome.high_dispatched == 1
        assert outcome.rejections.get("auto_slowdown", 0) >= 1
        assert await _dispatched_lanes(pool, fleet.tenant_id) == {"high": 1}

        async def resumed() -> bool:
            await coordinator.maintain_once()
            return not coordinator.slowdown.active

        await eventually(resumed, timeout=15, message="the slow batch leaves the writer's window")
        outcome = await coordinator.dispatcher.run_pass(await coordinator.settings())
        assert outcome.dispatched > 0 and outcome.high_dispatched == 0
        lanes = await _dispatched_lanes(pool, fleet.tenant_id)
        assert lanes["high"] == 1 and lanes.get("normal", 0) == outcome.dispatched


async def test_conflicts_count_across_writers_and_a_stale_writer_stops_counting(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO writer_health (writer, instance, p95_ms, writes, conflicts, updated_at) VALUES "
            "('hub', 'hub-1', 20, 60, 6, now()), ('projection', 'p-1', 40, 40, 4, now()), "
            "('ingest', 'dead-1', 9000, 10, 10, now() - interval '5 minutes')")
    p95, rate = await _signals(pool)
    assert p95 == 40  # the dead replica's 9 s is not the system's
    assert rate == (6 + 4) / (60 + 40)
