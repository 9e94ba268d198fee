"""Aging at the dispatch pace against real Postgres (docs/architecture.md §9.4): with a large backlog and few
dispatches a round boosts the pace's limit, not the backlog's share; oldest first, ready tasks only; the walk numbers
the share from the aging index alone and the UPDATE finds its rows by ctid, re-checking each row's state."""

from __future__ import annotations

import asyncio
import math
import re
from datetime import UTC, datetime
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.dispatch_settings import load_settings, set_setting
from libs.domain.aging import age_task, oldest_share
from libs.tasks import backlog_reads, business
from services.dispatch_coordinator.maintenance import AGING_BATCH, aging_pace, aging_round_limit, run_aging
from tests.support.backlog import Tenants, load_outstanding, load_ready, load_tenants
from tests.support.explain import Plan, explaining_pool
from tests.support.wait import eventually

READY = 20_000
TENANTS = 10
START = (datetime(1970, 1, 1, tzinfo=UTC), 0)

# Among the oldest tasks, some of every kind aging must leave alone: not yet due, another lane, no longer pending
# (an active execution is loaded apart: load_outstanding).
_NOT_READY = """
WITH oldest AS (SELECT id, row_number() OVER (ORDER BY enqueued_at, id) AS k FROM monitoring_collect_tasks
                WHERE status = 'pending' ORDER BY enqueued_at, id LIMIT 400)
UPDATE monitoring_collect_tasks t
SET dispatch_after = CASE WHEN o.k % 4 = 0 THEN now() + interval '1 hour' ELSE t.dispatch_after END,
    dispatch_lane = CASE WHEN o.k % 4 = 1 THEN 'retry' ELSE t.dispatch_lane END,
    status = CASE WHEN o.k % 4 = 2 THEN 'completed' ELSE t.status END
FROM oldest o WHERE o.id = t.id AND o.k % 4 <> 3
"""
_ALL = """
SELECT id, status, dispatch_lane, dispatch_priority, aging_boost, dispatch_after <= now() AS due, updated_at,
       EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id AND d.status IN ('queued', 'in_progress'))
       AS busy
FROM monitoring_collect_tasks t ORDER BY enqueued_at, id
"""


async def _load(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        tenants = await load_tenants(conn, tenants=TENANTS)
        await load_ready(conn, tenants, READY)
        await conn.execute(_NOT_READY)
        await load_outstanding(conn, tenants, per_tenant=5)  # 50 of the ready tasks, spread over their ages
        await conn.execute("VACUUM ANALYZE monitoring_collect_tasks")


async def _rows(pool: AsyncConnectionPool[Conn]) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(_ALL)
        return list(await cur.fetchall())


def _ready(row: dict[str, Any]) -> bool:
    return (row["status"] == "pending" and row["due"] and not row["busy"]
            and row["dispatch_lane"] in ("normal", "normal_boosted"))


async def test_a_round_at_the_pace_boosts_its_limit_oldest_first_and_only_ready_tasks(
        pool: AsyncConnectionPool[Conn]) -> None:
    await _load(pool)
    async with pool.connection() as conn:
        await set_setting(conn, "cluster_dispatch_per_minute", 20_000)
        settings = await load_settings(conn)
    ceiling = aging_round_limit(settings)
    assert ceiling == 20_000
    # A few dispatches since the last round: the pace's limit is twice them, far below the budget's limit and the
    # backlog's share (10 % of ~19,750 ready tasks).
    limit = aging_pace().limit(450, ceiling)
    assert limit == 900
    before = await _rows(pool)
    aged = await run_aging(pool, settings, limit=limit)
    after = await _rows(pool)
    assert (aged.boosted, aged.limit, aged.statements) == (900, 900, 1 + 2 * 2)  # the count, two batches of two
    changed = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a != b]
    ready = [i for i, row in enumerate(before) if _ready(row)]
    assert changed == ready[:900]  # the 900 oldest ready tasks, every task before them not ready and left alone
    assert len(ready) > 19_000 and changed[-1] > 900  # the not-ready ones were among the oldest
    for i in changed:
        assert after[i]["dispatch_lane"] == "normal_boosted" and after[i]["aging_boost"] > 0
    # The budget's limit, as every round had before: the backlog's whole share, ~2,000 tasks here (20,000 at
    # 1,000,000 ready tasks).
    budget = await run_aging(pool, settings)
    share = oldest_share(len(ready), settings.aging_fraction)
    assert 1_500 < share <= 2_000
    assert (budget.boosted, budget.limit, budget.statements) == (share, ceiling, 1 + 2 * math.ceil(share / AGING_BATCH))


async def test_the_share_bounds_the_walk_past_capped_tasks(pool: AsyncConnectionPool[Conn]) -> None:
    """The share is counted over every ready task, capped or not (the boundary the OFFSET walk found): with the oldest
    tasks at the cap a round boosts the uncapped rest of the share, and nothing beyond it."""
    async with pool.connection() as conn:
        tenants = await load_tenants(conn, tenants=2)
        await load_ready(conn, tenants, 1_000)
        await conn.execute("UPDATE monitoring_collect_tasks SET aging_boost = 900 WHERE id IN (SELECT id FROM "
                           "monitoring_collect_tasks ORDER BY enqueued_at, id LIMIT 60)")
        settings = await load_settings(conn)  # aging_fraction 0.1: a share of 100
        rows = await backlog_reads.aging_candidates(conn, cap=settings.aging_cap, after=START, share=100, batch=30)
        more = await backlog_reads.aging_candidates(conn, cap=settings.aging_cap, after=(
            rows[-1].enqueued_at, rows[-1].id), share=100 - rows[-1].walked, batch=30)
    assert [r.walked for r in rows] == list(range(61, 91))  # numbered from the oldest, the 60 capped ones skipped
    assert [r.walked for r in more] == list(range(1, 11))  # the share's last 10
    before = await _rows(pool)
    aged = await run_aging(pool, settings, limit=AGING_BATCH)
    after = await _rows(pool)
    assert aged.boosted == 40
    assert [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a != b] == list(range(60, 100))


async def _boosts(conn: Conn) -> dict[int, int]:
    cur = await conn.execute("SELECT id, aging_boost FROM monitoring_collect_tasks")
    return {r["id"]: r["aging_boost"] for r in await cur.fetchall()}


async def _load_ten_waiting(conn: Conn, tenants: Tenants) -> None:
    """Ten ready tasks that have all waited long enough to be boosted: the loader enqueues at random within the
    last hour, and one enqueued in the last 4 s gets no boost (`aging_boost` rounds it to 0), so `_apply` refused the
    batch and nothing waited (a CI failure once in a while)."""
    await load_ready(conn, tenants, 10)
    await conn.execute("UPDATE monitoring_collect_tasks SET enqueued_at = enqueued_at - interval '10 minutes' "
                       "WHERE status = 'pending'")


async def _apply(conn: Conn, rows: list[backlog_reads.AgingCandidate], cap: int, *,
                 tids: list[str] | None = None) -> int:
    aged = [age_task(r.lane, r.priority, r.aging_boost, r.wait_minutes, cap) for r in rows]
    assert all(a is not None for a in aged)
    return await business.apply_aging(conn, tids=tids or [r.tid for r in rows], versions=[r.version for r in rows],
                                      ids=[r.id for r in rows], lanes=[a.lane for a in aged if a],
                                      priorities=[a.priority for a in aged if a],
                                      boosts=[a.aging_boost for a in aged if a])


async def test_a_task_that_changed_since_its_read_is_not_boosted(pool: AsyncConnectionPool[Conn]) -> None:
    """The UPDATE finds each row by its ctid and re-checks it: a task a pass dispatched since the read (still pending,
    one dispatch attempt more), one promoted to high, one finished, and a ctid whose row is another task's are left
    alone; the others are boosted."""
    async with pool.connection() as conn:
        tenants = await load_tenants(conn, tenants=2)
        await _load_ten_waiting(conn, tenants)
        settings = await load_settings(conn)
        rows = await backlog_reads.aging_candidates(conn, cap=settings.aging_cap, after=START, share=10, batch=10)
        assert len(rows) == 10
        dispatched, promoted, finished, swapped = rows[0], rows[1], rows[2], rows[3]
        await business.count_dispatched(conn, [dispatched.tid])
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_lane = 'high' WHERE id = %s", (promoted.id,))
        await conn.execute("UPDATE monitoring_collect_tasks SET status = 'completed' WHERE id = %s", (finished.id,))
        tids = [r.tid for r in rows]
        tids[3] = rows[4].tid  # task 3's id with task 4's row: not written (task 4 is, by its own pair)
        before = await _boosts(conn)
        n = await _apply(conn, rows, settings.aging_cap, tids=tids)
        boosts = await _boosts(conn)
    left_alone = {dispatched.id, promoted.id, finished.id, swapped.id}
    assert n == 6
    assert {i for i in boosts if boosts[i] != before[i]} == {r.id for r in rows} - left_alone


async def test_a_task_dispatched_while_the_update_waits_is_not_boosted(pool: AsyncConnectionPool[Conn]) -> None:
    """A pass that holds a task's row (its claim, then its dispatch count) while aging's UPDATE reaches it: the UPDATE
    waits for the pass's commit and then leaves the newer row alone."""
    async with pool.connection() as conn:
        tenants = await load_tenants(conn, tenants=2)
        await _load_ten_waiting(conn, tenants)
        settings = await load_settings(conn)
        rows = await backlog_reads.aging_candidates(conn, cap=settings.aging_cap, after=START, share=10, batch=10)
        before = await _boosts(conn)
    taken = rows[5]
    async with pool.connection() as dispatch, pool.connection() as aging:
        async with dispatch.transaction():
            cur = await dispatch.execute("SELECT ctid::text AS tid FROM monitoring_collect_tasks WHERE id = %s "
                                         "FOR UPDATE", (taken.id,))
            await business.count_dispatched(dispatch, [(await cur.fetchone() or {})["tid"]])
            cur = await dispatch.execute("SELECT pg_backend_pid() AS pid")
            holder = (await cur.fetchone() or {})["pid"]
            waiting = asyncio.ensure_future(_apply(aging, rows, settings.aging_cap))

            async def blocked() -> bool:
                # Inside the pass's transaction pg_stat_activity is read once and kept (the statistics snapshot): a
                # first probe before aging's UPDATE arrived saw no waiter for good (CI, on a busy machine).
                await dispatch.execute("SELECT pg_stat_clear_snapshot()")
                cur = await dispatch.execute("SELECT count(*) AS n FROM pg_stat_activity "
                                             "WHERE %s = ANY (pg_blocking_pids(pid))", (holder,))
                return bool((await cur.fetchone() or {"n": 0})["n"])

            await eventually(blocked, message="aging's UPDATE waiting for the pass's row")
        n = await waiting
        boosts = await _boosts(aging)
    assert n == 9
    assert {i for i in boosts if boosts[i] != before[i]} == {r.id for r in rows} - {taken.id}


async def test_the_walk_is_index_only_and_the_update_a_tid_scan(settings: Settings,
                                                                 pool: AsyncConnectionPool[Conn]) -> None:
    await _load(pool)
    async with pool.connection() as conn:
        dispatch_settings = await load_settings(conn)
    plans: list[Plan] = []
    explained = explaining_pool(settings.database_url, plans)
    await explained.open(wait=True)
    try:
        # 100 tasks: the ctids of a batch of 500 would touch most of this 20,000-task table's ~550 pages, and the
        # planner rightly reads it whole instead; at 1,000,000 ready tasks (~27,000 pages) a batch of 500 is a Tid
        # Scan too (docs/benchmarks.md "Aging at the dispatch pace").
        await run_aging(explained, dispatch_settings, limit=100)
    finally:
        await explained.close()
    walk = next(p for p in plans if "row_number()" in p.query)
    update = next(p for p in plans if p.query.startswith("UPDATE monitoring_collect_tasks"))
    assert "Index Only Scan using ix_collect_tasks_aging" in walk.text and "Heap Fetches: 0" in walk.text, walk.text
    # The walk stops at the batch: it reads the 100 it returns and the ~100 not-ready tasks among them, not the share
    # (~1,970), as it did sorted by anything but its own order.
    walked = re.search(r"Index Only Scan using ix_collect_tasks_aging .* rows=(\d+) loops=1\)", walk.text)
    assert walked is not None and int(walked.group(1)) <= 250, walk.text
    assert "Tid Scan" in update.text and "Index Scan" not in update.text, update.text
    # The walk reads the index pages of the ~400 tasks it numbers and the heap of the 100 it returns, the update the
    # 100 rows and their indexes: nowhere near the 20,000-task backlog's ~550 heap and ~100 index pages a task read.
    assert walk.buffers < 1_500 and update.buffers < 5_000, (walk.buffers, update.buffers)
