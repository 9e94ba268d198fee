"""The backlog census (maintenance.BacklogCensus) and aging's batched rounds against real Postgres: a sweep over many
slices adds up to the exact whole-backlog statements, later sweeps cost one slice a tick and change the gauges only
once complete, and an aging round takes its share from the census, oldest first, at most its limit."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import load_settings, set_setting
from libs.tasks import backlog_reads
from services.dispatch_coordinator import maintenance
from services.dispatch_coordinator.maintenance import (
    BacklogCensus,
    aging_round_limit,
    census_for,
    observe_backlog,
    run_aging,
)
from services.dispatch_coordinator.scanner import scan_once
from tests.support.dispatch_fleet import seed_fleet

# Tasks of every kind the census tells apart: lanes, execution paths, not yet due, with an active execution.
_VARIETY = """
WITH picked AS (SELECT id, row_number() OVER (ORDER BY id) AS k FROM monitoring_collect_tasks)
UPDATE monitoring_collect_tasks t
SET dispatch_lane = CASE WHEN p.k % 7 = 0 THEN 'retry' WHEN p.k % 5 = 0 THEN 'normal_boosted'
                         WHEN p.k % 11 = 0 THEN 'high' ELSE 'normal' END,
    execution_owner = CASE WHEN p.k % 13 = 0 THEN 'legacy' ELSE 'desktop_tasks' END,
    dispatch_after = CASE WHEN p.k % 17 = 0 THEN now() + interval '1 hour' ELSE now() END,
    enqueued_at = now() - make_interval(secs => (p.k * 37) % 20000)
FROM picked p WHERE p.id = t.id
"""


async def _seed(pool: AsyncConnectionPool[Conn], plans: int) -> None:
    async with pool.connection() as conn:
        await seed_fleet(conn, plans_per_tenant=[plans // 3] * 3, clients_per_tenant=1)
    await scan_once(pool, batch_size=10_000, rollout_percentage=100)
    async with pool.connection() as conn:
        await conn.execute(_VARIETY)


async def _exact(conn: Conn) -> dict[str, Any]:
    lanes = {(r.tenant_id, r.lane): r.n for r in await backlog_reads.backlog_exact(conn) if r.lane != "high"}
    owners = await backlog_reads.pending_by_owner(conn)
    return {"lanes": lanes, "owners": owners, "p99_ms": await backlog_reads.normal_wait_p99_ms(conn)}


async def _pending(conn: Conn) -> int:
    cur = await conn.execute("SELECT count(*) AS n FROM monitoring_collect_tasks WHERE status = 'pending'")
    return int((await cur.fetchone() or {"n": 0})["n"])


async def test_a_sweep_of_many_slices_adds_up_to_the_exact_statements(pool: AsyncConnectionPool[Conn],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    await _seed(pool, 900)
    monkeypatch.setattr(maintenance, "CENSUS_SLICE_ROWS", 40)
    async with pool.connection() as conn:
        await conn.execute("UPDATE monitoring_collect_tasks SET status = 'completed' WHERE id % 3 = 0")  # history
        assert await _pending(conn) > 10 * 40  # many slices
        census = BacklogCensus()
        totals = await census.advance(conn)  # the first sweep is counted at once
        exact = await _exact(conn)
    assert totals is not None
    assert totals.tenant_lanes == exact["lanes"] and totals.owners == exact["owners"]
    # The waits come in buckets 1.6% wide (plus the time since the sweep measured them).
    assert math.isclose(totals.wait_percentile_ms(0.99, time.time()), exact["p99_ms"], rel_tol=0.02)
    assert totals.ready_normal == sum(n for (_, lane), n in exact["lanes"].items() if lane != "retry")


async def test_later_sweeps_count_one_slice_a_tick_and_publish_when_complete(pool: AsyncConnectionPool[Conn],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    await _seed(pool, 600)
    monkeypatch.setattr(maintenance, "CENSUS_SLICE_ROWS", 50)
    async with pool.connection() as conn:
        census = census_for(conn)
        first = await observe_backlog(conn)
        slices = await _pending(conn) // 50 + 1
        # New ready high and normal work: the high lane is exact at once, the rest once the sweep is complete.
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_lane = 'high', execution_owner = "
                           "'desktop_tasks', dispatch_after = now() WHERE id = (SELECT min(id) FROM "
                           "monitoring_collect_tasks WHERE dispatch_lane = 'normal')")
        seen: list[int] = []
        for n in range(slices):
            backlog = await observe_backlog(conn)
            assert backlog.high == first.high + 1
            seen.append(backlog.normal)
            assert census.after_id > 0 or n == slices - 1  # a cursor into the pending tasks until the sweep ends
        exact = await _exact(conn)
    assert seen[:-1] == [first.normal] * (slices - 1)  # unchanged until the sweep completed ...
    assert seen[-1] == first.normal - 1  # ... then the task that went high has left the normal count
    assert seen[-1] == sum(n for (_, lane), n in exact["lanes"].items() if lane != "retry")


async def test_a_census_slice_reads_only_pending_tasks_whatever_the_statistics(pool: AsyncConnectionPool[Conn]) -> None:
    """The pending-only index, in id order (this table has no statistics: it was never analysed)."""
    await _seed(pool, 600)
    async with pool.connection() as conn:
        cur = await conn.execute("EXPLAIN (VERBOSE) " + backlog_reads._CENSUS_SLICE,
                                 {"after": 0, "rows": 100, "reference": time.time()})
        plan = "\n".join(r["QUERY PLAN"] for r in await cur.fetchall())
    assert "ix_collect_tasks_pending_id" in plan and "hashed SubPlan" in plan, plan


async def test_an_aging_round_takes_its_share_from_the_census_oldest_first_within_its_limit(
        pool: AsyncConnectionPool[Conn], monkeypatch: pytest.MonkeyPatch) -> None:
    async with pool.connection() as conn:
        await seed_fleet(conn, plans_per_tenant=[30], clients_per_tenant=1)
    await scan_once(pool, batch_size=1000, rollout_percentage=100)
    async with pool.connection() as conn:
        await conn.execute(  # task k waited k*10 minutes
            "UPDATE monitoring_collect_tasks t SET enqueued_at = now() - make_interval(mins => (r.k * 10)::int) "
            "FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM monitoring_collect_tasks) r WHERE r.id = t.id")
        await set_setting(conn, "aging_fraction", 0.5)
        settings = await load_settings(conn)
        census = census_for(conn)
        await census.advance(conn)
        assert census.done is not None and census.done.ready_normal == 30
        # The census says 20 are ready (as it would have a few seconds ago): the round takes half of those, 10.
        census.done = replace(census.done, lanes={"normal": {1: 20}})
    monkeypatch.setattr(maintenance, "AGING_BATCH", 3)
    assert (await run_aging(pool, settings)).boosted == 10  # in batches of 3
    # Within a limit of 4 a round: the 4 oldest of the share that are not yet at the cap.
    limited = replace(settings, cluster_dispatch_per_minute=4)
    assert aging_round_limit(limited) == 4
    async with pool.connection() as conn:
        await conn.execute("UPDATE monitoring_collect_tasks SET aging_boost = 900 WHERE id IN (SELECT id FROM "
                           "monitoring_collect_tasks ORDER BY enqueued_at LIMIT 2)")
        cur = await conn.execute("SELECT id, aging_boost FROM monitoring_collect_tasks ORDER BY enqueued_at, id")
        before = await cur.fetchall()
    assert (await run_aging(pool, limited)).boosted == 4
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, aging_boost FROM monitoring_collect_tasks ORDER BY enqueued_at, id")
        after = await cur.fetchall()
    changed = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if b["aging_boost"] != a["aging_boost"]]
    assert changed == [2, 3, 4, 5]  # the two capped ones skipped, then the oldest four
