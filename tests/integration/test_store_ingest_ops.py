"""libs/tasks/ingest_ops.py's reads against real Postgres: a batch's business tasks locked, the other live work of a
completed task on both paths, and the age of the oldest result accepted but not applied."""

from __future__ import annotations

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.tasks import ingest_ops
from tests.support.reconcile_factory import insert_execution, insert_legacy_lease, insert_task, make_world, today


async def test_lock_business_tasks_answers_the_tasks_there_and_holds_their_locks(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn, pool.connection() as other:
        w = await make_world(conn, questions=2)
        tasks = [await insert_task(conn, w, question_index=i) for i in range(2)]
        async with conn.transaction():
            locked = await ingest_ops.lock_business_tasks(conn, sorted([*tasks, 10**12]))
            assert sorted(locked) == tasks  # the unknown id is missing
            first = locked[tasks[0]]
            assert (first.tenant_id, first.status, first.business_date, first.execution_owner) == (
                w.tenant_id, "pending", today(), "desktop_tasks")
            assert first.run_key() == (w.tenant_id, w.brand_id, w.question_ids[0], w.platform_id, "desktop", "daily",
                                       today())
            with pytest.raises(psycopg.errors.LockNotAvailable):
                await other.execute("SELECT 1 FROM monitoring_collect_tasks WHERE id = %s FOR UPDATE NOWAIT",
                                    (tasks[0],))


async def test_other_live_executions_on_both_paths(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=2)
        desk, legacy_task = (await insert_task(conn, w, question_index=0),
                             await insert_task(conn, w, question_index=1, execution_owner="legacy"))
        own = await insert_execution(conn, w, desk, w.clients[0], status="succeeded")
        other = await insert_execution(conn, w, desk, w.clients[1], interrupt_generation=4)
        lease = await insert_legacy_lease(conn, w, legacy_task, w.clients[0])
        found = await ingest_ops.other_live_executions(conn, [desk, legacy_task], [own])
        assert {(x.id, x.monitor_task_id) for x in found} == {(other, desk), (lease, legacy_task)}
        by_id = {x.id: x for x in found}
        assert (by_id[other].target_client_id, by_id[other].interrupt_generation) == (w.clients[1], 4)
        assert await ingest_ops.other_live_executions(conn, [desk, legacy_task], [other, lease]) == []


async def test_oldest_unapplied_result_age(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=2)
        assert await ingest_ops.oldest_unapplied_result_age_ms(conn) == 0.0
        task = await insert_task(conn, w, question_index=0)
        await insert_execution(conn, w, task, w.clients[0], result_received_ago=5)
        legacy_task = await insert_task(conn, w, question_index=1, execution_owner="legacy")
        await insert_legacy_lease(conn, w, legacy_task, w.clients[0], result_received_ago=9)
        age = await ingest_ops.oldest_unapplied_result_age_ms(conn)
        assert 9_000 <= age < 60_000  # the legacy lease's, the older of the two
