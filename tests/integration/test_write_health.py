"""Auto slow-down from the real writers: a slow monitoring database seen by the ingest workers (a lock held on
the rows their results update) pauses normal dispatch through the shared write-health table, and its end resumes
it. Also: a stale writer row stops counting, and conflicts count across writers."""

from __future__ import annotations

import asyncio
from datetime import date

from aio_pika.abc import AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn, connect
from libs.db.write_health import WriterHealth, publishing
from libs.dispatch_settings import DispatchSettings
from libs.domain.slowdown import WriteStats
from libs.mq.topology import Topology
from services.dispatch_coordinator.maintenance import SlowdownState, measure_signals, update_slowdown
from tests.support.ingest_factory import make_executions, make_result, make_world, publish, running_ingest
from tests.support.wait import eventually

DAY = date(2026, 3, 14)


async def _signals(pool: AsyncConnectionPool[Conn]) -> tuple[float, float]:
    async with pool.connection() as conn:
        signals = await measure_signals(conn, WriteStats(), min_writes=1)
    return signals.write_p95_ms, signals.conflict_rate


async def test_a_slow_ingest_database_pauses_normal_dispatch_and_its_end_resumes_it(
        settings: Settings, pool: AsyncConnectionPool[Conn], topology: Topology,
        amqp: AbstractRobustConnection) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        (execution,) = await make_executions(conn, world, business_date=DAY)
    health = WriterHealth("ingest", "ingest-slow", window_s=3.0, min_samples=1)
    dispatch = DispatchSettings()  # db_write_p95_threshold_ms = 500
    state = SlowdownState()
    async with running_ingest(pool, settings, topology, write_health=health), publishing(health, pool, 0.2):
        holder = await connect(settings.database_url)
        try:
            await holder.execute("BEGIN")
            await holder.execute("SELECT id FROM desktop_tasks WHERE id = %s FOR UPDATE", (execution.task_id,))
            await publish(amqp, topology, [make_result(execution, shards=topology.ingest_shards)])
            await asyncio.sleep(1.2)  # the fault: the hot row stays locked this long (nothing is waited for)
        finally:
            await holder.execute("ROLLBACK")
            await holder.close()

        async def slow() -> float | None:
            p95, _ = await _signals(pool)
            return p95 if p95 > 500 else None

        p95 = await eventually(slow, timeout=10, message="the ingest writer's slow batch reaches the coordinator")
        assert p95 >= 1000
        async with pool.connection() as conn:
            signals = await measure_signals(conn, WriteStats(), min_writes=1)
        assert update_slowdown(state, signals, dispatch) is True and state.reasons == ["db_write_latency"]

        async def healthy() -> bool | None:
            p95_now, _ = await _signals(pool)
            return True if p95_now <= 500 else None

        await eventually(healthy, timeout=15, message="the slow batch leaves the writer's window")
        async with pool.connection() as conn:
            signals = await measure_signals(conn, WriteStats(), min_writes=1)
        assert update_slowdown(state, signals, dispatch) is False


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
