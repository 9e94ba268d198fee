"""Ingest lag (the auto slow-down's `ingest_lag` signal) on real Postgres, on both execution paths: the oldest result
the hub accepted that ingest has not applied yet, whether it came on a desktop_tasks execution (in progress or
already marked unknown by the reconciler) or on a legacy lease."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.domain.slowdown import WriteStats
from libs.ingest.lag import ingest_lag_ms
from services.dispatch_coordinator.maintenance import measure_signals
from tests.support.reconcile_factory import insert_execution, insert_legacy_lease, insert_task, make_world


async def lags(pool: AsyncConnectionPool[Conn]) -> tuple[float, float]:
    """(the coordinator's slow-down signal, libs.ingest.lag's reader), in seconds."""
    async with pool.connection() as conn:
        signals = await measure_signals(conn, WriteStats())
        return signals.ingest_lag_ms / 1000, await ingest_lag_ms(conn) / 1000


def about(seconds: float, expected: float) -> bool:
    return expected <= seconds < expected + 30  # the row's age at the query, on a loaded box


async def test_a_legacy_result_not_applied_yet_is_ingest_lag(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=1, questions=3)
        client = world.clients[0]
        posted = await insert_task(conn, world, question_index=0, execution_owner="legacy")
        await insert_legacy_lease(conn, world, posted, client, result_received_ago=120)
        running = await insert_task(conn, world, question_index=1, execution_owner="legacy")
        await insert_legacy_lease(conn, world, running, client)  # pulled, no result yet: no lag
    coordinator, reader = await lags(pool)
    assert about(coordinator, 120) and about(reader, 120), (coordinator, reader)

    async with pool.connection() as conn:  # ingest applied it: the lease ended
        await conn.execute("UPDATE legacy_leases SET status = 'succeeded', finished_at = now() "
                           "WHERE monitor_task_id = %s", (posted,))
    assert await lags(pool) == (0, 0)


async def test_unknown_executions_and_the_oldest_of_both_paths(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=1, questions=3)
        client = world.clients[0]
        assert await lags(pool) == (0, 0)
        unknown = await insert_task(conn, world, question_index=0)
        await insert_execution(conn, world, unknown, client, status="unknown", result_received_ago=300)
        received = await insert_task(conn, world, question_index=1)
        await insert_execution(conn, world, received, client, result_received_ago=60)
        legacy = await insert_task(conn, world, question_index=2, execution_owner="legacy")
        await insert_legacy_lease(conn, world, legacy, client, result_received_ago=200)
    coordinator, reader = await lags(pool)
    assert about(coordinator, 300) and about(reader, 300), (coordinator, reader)  # the unknown execution's

    async with pool.connection() as conn:  # the reconciler converged the unknown one: the legacy result is oldest
        await conn.execute("UPDATE desktop_tasks SET status = 'succeeded', finished_at = now() "
                           "WHERE monitor_task_id = %s", (unknown,))
    coordinator, reader = await lags(pool)
    assert about(coordinator, 200) and about(reader, 200), (coordinator, reader)
