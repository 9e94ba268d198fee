"""libs/tasks/business_day.py's operations against real Postgres: tasks of a business date that is over in the
tenant's time zone, locked one by one with their live work on both paths, and expired only while pending."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.tasks import business_day
from tests.support.reconcile_factory import (
    business,
    insert_execution,
    insert_legacy_lease,
    insert_task,
    make_world,
    yesterday,
)


async def test_past_tasks_are_found_locked_with_their_live_work_and_expired_once(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=3)
        past = await insert_task(conn, w, question_index=0, business_date=yesterday())
        leased = await insert_task(conn, w, question_index=1, business_date=yesterday(), execution_owner="legacy")
        await insert_task(conn, w, question_index=2)  # today's: not over
        execution = await insert_execution(conn, w, past, w.clients[0])
        lease = await insert_legacy_lease(conn, w, leased, w.clients[1])

        assert await business_day.expiring_task_ids(conn, limit=10) == sorted([past, leased])
        assert await business_day.expiring_task_ids(conn, limit=1) == [min(past, leased)]
        async with conn.transaction():
            task = await business_day.lock_expiring_task(conn, past)
            assert task is not None and (task.tenant_id, task.business_date) == (w.tenant_id, yesterday())
            assert [(x.id, x.status) for x in await business_day.live_work(conn, past)] == [(execution, "in_progress")]
            assert [(x.id, x.target_client_id) for x in await business_day.live_work(conn, leased)] == [
                (lease, w.clients[1])]
            assert await business_day.expire(conn, past)
            assert not await business_day.expire(conn, leased)  # leased, not pending: its lease ends first
        assert (await business(conn, past))["status"] == "expired"
        assert (await business(conn, leased))["status"] == "leased"
        assert await business_day.lock_expiring_task(conn, past) is None
        assert not await business_day.expire(conn, past)
