"""libs/tasks/business_day.py's operations against real Postgres: tasks of a business date that is over in the
tenant's time zone, locked one by one with their live work on both paths, and expired only while pending."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.tasks import business_day
from tests.support.backlog import load_history, load_ready, load_tenants
from tests.support.explain import Plan, explaining_pool
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


# A year and more of finished history; an overdue backlog (yesterday's tasks) and today's, TODAY_EACH a tenant.
HISTORY = 20_000
TENANTS = 20
TODAY_EACH = 30  # the loader's questions x platforms: one business day of each tenant


async def test_the_sweep_reads_the_overdue_live_tasks_not_the_history_nor_todays(
        pool: AsyncConnectionPool[Conn], settings: Settings) -> None:
    """The candidates' read probes each tenant's overdue live tasks (ix_collect_tasks_live_tenant_date, migration
    076). It catches the two walks that read more: every business task by date (075's index, what the planner took
    before), which reads the 20,000 finished ones in front of the first live one, and every live task by date, which
    reads today's backlog too and throws it away."""
    async with pool.connection() as conn:
        tenants = await load_tenants(conn, tenants=TENANTS, online=False)
        await load_history(conn, tenants, HISTORY)
        await load_ready(conn, tenants, TENANTS * TODAY_EACH)  # yesterday's: overdue
        await load_ready(conn, tenants, TENANTS * TODAY_EACH, first_day=0)  # today's
        await conn.execute("VACUUM ANALYZE monitoring_collect_tasks")
        cur = await conn.execute("SELECT t.id FROM monitoring_collect_tasks t WHERE t.status = 'pending' "
                                 "AND t.business_date < current_date ORDER BY t.business_date, t.id LIMIT 50")
        oldest = [int(r["id"]) for r in await cur.fetchall()]
    plans: list[Plan] = []
    explained = explaining_pool(settings.database_url, plans)
    await explained.open(wait=True)
    try:
        async with explained.connection() as conn:
            found = await business_day.expiring_task_ids(conn, limit=50)
    finally:
        await explained.close()
    assert len(found) == 50 and found == oldest  # every tenant is UTC here: the oldest 50 overdue, date then id
    (plan,) = [p for p in plans if "AT TIME ZONE tn.time_zone" in p.query]
    # Each tenant's probe reads its 30 overdue entries and stops at today's: 600 read, none thrown away. The walk of
    # every live task throws today's 600 away; the history walk, 20,000.
    assert plan.filtered < TENANTS * TODAY_EACH // 2 and plan.buffers < 1_000, plan.text
    assert "ix_collect_tasks_live_tenant_date" in plan.text, plan.text
