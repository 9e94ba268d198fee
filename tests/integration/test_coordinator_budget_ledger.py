"""The budget ledger and its totals (migration 021) against real Postgres: after any sequence of dispatches (full
and high passes, executions written outside the coordinator), refunds (collect-now's own cancel statement,
execution_paths.end on other paths), leases and endings, changes of `budget_window_seconds` and leader changes, every
window it counts equals the count of the window's executions (queries.BUDGET_USED) in the same snapshot; what the passes
read equals that count whether the ledger counts the window or not; and a refund racing the ledger's start is never
lost."""

from __future__ import annotations

import asyncio
import functools
import random
import uuid
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings, load_settings, set_setting
from libs.tasks import dispatch_reads, execution_paths, executions
from libs.tasks.records import EndedExecution, ExecutionEnd
from services.collect_now_api import queries as collect_now_queries
from services.dispatch_coordinator import queries as q
from services.dispatch_coordinator.dispatcher import Dispatcher, read_snapshot
from services.dispatch_coordinator.scanner import scan_once
from tests.integration.test_coordinator_load import collect_now
from tests.support.dispatch_fleet import Seeded, seed_fleet
from tests.support.wait import eventually

# Every window the ledger holds for its window length, next to the count of the same window, in one snapshot.
_LEDGER_WINDOWS = """
SELECT l.window_start, l.window_seconds, l.tenant_id, l.high, sum(l.used)::bigint AS n
FROM dispatch_budget_ledger l JOIN dispatch_budget_ledger_tracking k
     ON k.window_seconds = l.window_seconds AND l.window_start >= k.since_window_start
GROUP BY 1, 2, 3, 4
"""
_TOTAL_WINDOWS = """
SELECT t.window_start, t.window_seconds, t.high, sum(t.used)::bigint AS n
FROM dispatch_budget_totals t JOIN dispatch_budget_ledger_tracking k
     ON k.window_seconds = t.window_seconds AND t.window_start >= k.since_window_start
GROUP BY 1, 2, 3
"""
_COUNTED_WINDOWS = f"""
SELECT dispatch_budget_window(d.created_at, k.window_seconds) AS window_start, k.window_seconds, d.tenant_id,
       d.lane = 'high' AS high, count(*) AS n
FROM desktop_tasks d JOIN dispatch_budget_ledger_tracking k
     ON dispatch_budget_window(d.created_at, k.window_seconds) >= k.since_window_start
WHERE d.kind = 'monitor' AND {q.COUNTS_AGAINST_BUDGET}
GROUP BY 1, 2, 3, 4
"""
_LEASE_SOME = """
UPDATE desktop_tasks SET status = 'in_progress', lease_epoch = lease_epoch + 1, leased_at = now(), updated_at = now()
WHERE id IN (SELECT id FROM desktop_tasks WHERE status = 'queued' ORDER BY id LIMIT %(n)s)
RETURNING id, lease_epoch
"""
_SOME = "SELECT id, lease_epoch, monitor_task_id FROM desktop_tasks WHERE status = %(status)s ORDER BY id LIMIT %(n)s"
_PROMOTABLE = """
SELECT t.id FROM monitoring_collect_tasks t
WHERE t.tenant_id = %(t)s AND t.status = 'pending' AND t.dispatch_lane <> 'high' AND NOT EXISTS (
    SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id AND d.status IN ('queued', 'in_progress', 'unknown'))
ORDER BY t.id LIMIT %(n)s
"""


async def _prepare(pool: AsyncConnectionPool[Conn]) -> Seeded:
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[60, 60], clients_per_tenant=2, max_concurrent=3,
                                  max_queue_depth=6)
        for key, value in (("cluster_dispatch_per_minute", 1000), ("tenant_dispatch_per_minute", 1000)):
            await set_setting(conn, key, value)
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 100 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 100")
    await scan_once(pool, batch_size=1000, rollout_percentage=100)
    return seeded


async def _settings(pool: AsyncConnectionPool[Conn], **changes: Any) -> DispatchSettings:
    async with pool.connection() as conn:
        for key, value in changes.items():
            await set_setting(conn, key, value)
        await conn.execute("UPDATE desktop_clients SET last_heartbeat_at = now(), online = true")
        return await load_settings(conn)


async def assert_ledger_equals_count(pool: AsyncConnectionPool[Conn]) -> int:
    """Every window the ledger counts, equal to the count of its executions (one snapshot); returns how many
    executions that covers."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cur = await conn.execute(_LEDGER_WINDOWS)
        ledger = {(r["window_start"], r["window_seconds"], r["tenant_id"], r["high"]): r["n"]
                  for r in await cur.fetchall() if r["n"] != 0}
        cur = await conn.execute(_TOTAL_WINDOWS)
        totals = {(r["window_start"], r["window_seconds"], r["high"]): r["n"] for r in await cur.fetchall() if r["n"]}
        cur = await conn.execute(_COUNTED_WINDOWS)
        counted = {(r["window_start"], r["window_seconds"], r["tenant_id"], r["high"]): r["n"]
                   for r in await cur.fetchall()}
    assert ledger == counted
    counted_totals: dict[tuple[int, int, bool], int] = {}
    for (start, seconds, _, high), n in counted.items():
        counted_totals[(start, seconds, high)] = counted_totals.get((start, seconds, high), 0) + n
    assert totals == counted_totals
    return sum(counted.values())


async def assert_pass_reads_the_count(pool: AsyncConnectionPool[Conn], settings: DispatchSettings) -> None:
    """What a full pass and a high pass read of their window (ledger or, without it, the count) equals the count
    (one snapshot)."""
    window = max(1, settings.budget_window_seconds)
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        snap = await read_snapshot(conn, settings)
        # A full pass's reading: the window's totals, and the use of the tenants its windows reach with their clients.
        windowed = await read_snapshot(conn, settings, all_clients=False)
        cur = await conn.execute("SELECT id FROM tenants")
        scoped = await dispatch_reads.clients_of(
            conn, tenants=[r["id"] for r in await cur.fetchall()], window_start=int(windowed.window_start),
            window_seconds=windowed.window_seconds, heartbeat_timeout_s=settings.heartbeat_timeout_seconds)
        cur = await conn.execute(q.BUDGET_USED, {"window_start": windowed.window_start,
                                                 "window_end": windowed.window_start + windowed.window_seconds})
        windowed_rows = await cur.fetchall()
        cur = await conn.execute(q.BUDGET_USED, {"window_start": snap.window_start,
                                                 "window_end": snap.window_start + snap.window_seconds})
        rows = await cur.fetchall()
        cur = await conn.execute(dispatch_reads._HIGH_SNAPSHOT, {"window": window,
                                                     "heartbeat_timeout_s": settings.heartbeat_timeout_seconds})
        high = await cur.fetchone()
        assert high is not None
        cur = await conn.execute(q.BUDGET_USED, {"window_start": high["window_start"],
                                                 "window_end": high["window_start"] + window})
        high_rows = await cur.fetchall()
    assert (high["cluster_used"], high["non_high_used"]) == (
        sum(r["n"] for r in high_rows), sum(r["n"] for r in high_rows if not r["high"]))
    assert snap.ledger.cluster_used == sum(r["n"] for r in rows)
    assert snap.ledger.non_high_used == sum(r["n"] for r in rows if not r["high"])
    tenants: dict[int, int] = {}
    for r in rows:
        if not r["high"]:
            tenants[r["tenant_id"]] = tenants.get(r["tenant_id"], 0) + r["n"]
    assert {t: n for t, n in snap.ledger.tenant_used.items() if n} == tenants
    assert not windowed.ledger.tenant_used
    assert (windowed.ledger.cluster_used, windowed.ledger.non_high_used) == (
        sum(r["n"] for r in windowed_rows), sum(r["n"] for r in windowed_rows if not r["high"]))
    scoped_used: dict[int, int] = {}
    expected_scoped: dict[int, int] = {}
    for u in scoped.budget:
        assert u.tenant_id is not None
        if not u.high:
            scoped_used[u.tenant_id] = scoped_used.get(u.tenant_id, 0) + u.n
    for r in windowed_rows:
        if not r["high"]:
            expected_scoped[r["tenant_id"]] = expected_scoped.get(r["tenant_id"], 0) + r["n"]
    assert {t: n for t, n in scoped_used.items() if n} == expected_scoped


async def _step(pool: AsyncConnectionPool[Conn], rng: random.Random, seeded: Seeded, state: dict[str, Any]) -> str:
    """One random operation of the ones that create, refund, lease or end executions, or move the window."""
    op = rng.choice(["full", "full", "high", "collect_now", "collect_now_api_cancel", "lease", "end_leased",
                     "end_queued", "window", "leader", "outside"])
    tenant = rng.choice(seeded.tenants)
    client = rng.choice(tenant.clients)
    async with pool.connection() as conn:
        if op == "full":
            await state["dispatcher"].run_pass(state["settings"])
        elif op == "high":
            cur = await conn.execute(_PROMOTABLE, {"t": tenant.tenant_id, "n": rng.randint(1, 3)})
            ids = [r["id"] for r in await cur.fetchall()]
            if ids:
                await collect_now(conn, tenant_id=tenant.tenant_id, client_id=client, task_ids=ids)
                await state["dispatcher"].run_high_pass(state["settings"])
        elif op == "collect_now":  # refunds through execution_paths.end(reason=collect_now_preempt) on queued work
            cur = await conn.execute(_PROMOTABLE, {"t": tenant.tenant_id, "n": 1})
            ids = [r["id"] for r in await cur.fetchall()]
            if ids:
                await collect_now(conn, tenant_id=tenant.tenant_id, client_id=client, task_ids=ids)
        elif op == "collect_now_api_cancel":  # collect-now-api's own set-based cancel (the refund of a click)
            async with conn.transaction():
                params = {"client_id": client, "tenant_id": tenant.tenant_id, "request_id": str(uuid.uuid4())}
                await conn.execute(collect_now_queries.INCREMENT_GENERATION, params)
                await conn.execute(executions.CANCEL_QUEUED_SCHEDULED, params)
        elif op == "lease":
            await conn.execute(_LEASE_SOME, {"n": rng.randint(1, 4)})
        elif op == "end_leased":  # after a lease nothing is given back, whatever the outcome and reason
            cur = await conn.execute(_SOME, {"status": "in_progress", "n": rng.randint(1, 3)})
            for r in await cur.fetchall():
                outcome = rng.choice(["succeeded", "failed", "aborted", "expired"])
                reason = rng.choice([None, "collect_now_preempt", "lease_expired"])
                await execution_paths.end(conn, ExecutionEnd(task_id=r["id"], outcome=outcome,
                                                             lease_epoch=r["lease_epoch"], reason=reason))
        elif op == "end_queued":  # never leased: only collect-now's reason gives the budget back
            cur = await conn.execute(_SOME, {"status": "queued", "n": rng.randint(1, 3)})
            for r in await cur.fetchall():
                await execution_paths.end(conn, ExecutionEnd(
                    task_id=r["id"], outcome="aborted",
                    reason=rng.choice([None, "collect_now_preempt", "client_offline"])))
        elif op == "window":  # mid-window change of the window length
            state["settings"] = await _settings(pool, budget_window_seconds=rng.choice([60, 7, 3600, 60]))
        elif op == "leader":  # a new leader: a fresh dispatcher, the ledger as the old one left it
            state["dispatcher"] = Dispatcher(pool)
        elif op == "outside":  # an execution written by hand (not under the pass lock), then its refund
            cur = await conn.execute(_PROMOTABLE, {"t": tenant.tenant_id, "n": 1})
            row = await cur.fetchone()
            if row is not None:
                execution = uuid.uuid4()
                await conn.execute(
                    "INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, "
                    "lane, lane_weight, source, monitor_task_id) SELECT %(id)s, 'monitor', t.tenant_id, "
                    "t.workspace_id, %(c)s, 'queued', 100, 'normal', 40, 'daily_schedule', t.id "
                    "FROM monitoring_collect_tasks t WHERE t.id = %(t)s",
                    {"id": execution, "c": client, "t": row["id"]})
                if rng.random() < 0.5:
                    await execution_paths.end(conn, ExecutionEnd(task_id=execution, outcome="aborted",
                                                                 reason="collect_now_preempt"))
    return op


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_the_ledger_equals_the_count_after_any_sequence(pool: AsyncConnectionPool[Conn], seed: int) -> None:
    seeded = await _prepare(pool)
    rng = random.Random(seed)
    state: dict[str, Any] = {"dispatcher": Dispatcher(pool), "settings": await _settings(pool)}
    ops: list[str] = []
    for _ in range(40):
        ops.append(await _step(pool, rng, seeded, state))
        await assert_pass_reads_the_count(pool, state["settings"])
        await assert_ledger_equals_count(pool)
    await state["dispatcher"].run_pass(state["settings"])  # (re)starts the ledger for the last window length
    assert await assert_ledger_equals_count(pool) > 0, ops


async def test_a_window_change_restarts_the_ledger_and_refunds_land_in_it(pool: AsyncConnectionPool[Conn]) -> None:
    seeded = await _prepare(pool)
    tenant = seeded.tenants[0]
    dispatcher = Dispatcher(pool)
    settings = await _settings(pool)
    assert (await dispatcher.run_pass(settings)).dispatched > 0
    assert await assert_ledger_equals_count(pool) > 0
    # A collect-now cancels the client's queued executions: their budget goes back in the same transaction.
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE target_client_id = %s "
                                 "AND status = 'queued'", (tenant.clients[0],))
        queued = (await cur.fetchone() or {"n": 0})["n"]
        before = sum(r.n for r in await dispatch_reads.budget_use(
            conn, window_start=int(dispatcher.ledger_window[1]), window_seconds=60))
        async with conn.transaction():
            params = {"client_id": tenant.clients[0], "tenant_id": tenant.tenant_id, "request_id": str(uuid.uuid4())}
            await conn.execute(collect_now_queries.INCREMENT_GENERATION, params)
            await conn.execute(executions.CANCEL_QUEUED_SCHEDULED, params)
        assert sum(r.n for r in await dispatch_reads.budget_use(
            conn, window_start=int(dispatcher.ledger_window[1]), window_seconds=60)) == before - queued and queued > 0
    await assert_ledger_equals_count(pool)
    # budget_window_seconds changes mid-window: the next full pass starts the ledger for the new length.
    settings = await _settings(pool, budget_window_seconds=30)
    await assert_pass_reads_the_count(pool, settings)  # counted until the ledger counts 30 s windows
    await dispatcher.run_pass(settings)
    async with pool.connection() as conn:
        cur = await conn.execute(q.LEDGER_TRACKING)
        assert [r["window_seconds"] for r in await cur.fetchall()] == [30]
    await assert_ledger_equals_count(pool)
    await assert_pass_reads_the_count(pool, settings)


async def test_the_high_pass_reads_the_ledger_without_counting(pool: AsyncConnectionPool[Conn]) -> None:
    await _prepare(pool)
    dispatcher = Dispatcher(pool)
    settings = await _settings(pool)
    await dispatcher.run_pass(settings)
    async with pool.connection() as conn:
        cur = await conn.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + dispatch_reads._HIGH_SNAPSHOT,
                                 {"window": 60, "heartbeat_timeout_s": 30})
        plan = "\n".join(r["QUERY PLAN"] for r in await cur.fetchall())
    # The count's scan of the window's executions is planned (the ledger's absence) but never runs.
    count_branch = plan[plan.index("Append"):]
    assert "ix_desktop_tasks_created" in count_branch and "(never executed)" in count_branch, plan


async def test_an_execution_aborted_for_another_reason_keeps_its_budget(pool: AsyncConnectionPool[Conn]) -> None:
    seeded = await _prepare(pool)
    dispatcher = Dispatcher(pool)
    settings = await _settings(pool)
    await dispatcher.run_pass(settings)
    async with pool.connection() as conn:
        cur = await conn.execute(_SOME, {"status": "queued", "n": 1})
        row = await cur.fetchone()
        assert row is not None
        no_refund = ExecutionEnd(task_id=row["id"], outcome="aborted")  # no reason: not a collect-now refund
        assert isinstance(await execution_paths.end(conn, no_refund), EndedExecution)
        cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE kind = 'monitor'")
        total = (await cur.fetchone() or {"n": 0})["n"]
    assert await assert_ledger_equals_count(pool) == total, seeded


async def test_a_refund_racing_the_ledger_start_is_never_lost(pool: AsyncConnectionPool[Conn]) -> None:
    """Either order: a refund in flight when the ledger starts (the start waits for it, then counts without it), and
    a refund while the start is in flight (it waits, then lands in the rows the start wrote)."""
    await _prepare(pool)
    dispatcher = Dispatcher(pool)
    settings = await _settings(pool)
    await dispatcher.run_pass(settings)
    async with pool.connection() as conn:
        cur = await conn.execute(_SOME, {"status": "queued", "n": 2})
        first, second = [r["id"] for r in await cur.fetchall()]
        await conn.execute(q.LEDGER_FORGET)  # as before the ledger's first start
    async with pool.connection() as refunder, pool.connection() as starter:
        # 1. The refund holds the ledger lock shared (uncommitted) when the start begins: the start waits.
        await refunder.execute("BEGIN")
        first_refund = ExecutionEnd(task_id=first, outcome="aborted", reason="collect_now_preempt")
        assert isinstance(await execution_paths.end(refunder, first_refund), EndedExecution)
        start = asyncio.create_task(Dispatcher(pool)._ensure_ledger(starter, 60))
        await eventually(functools.partial(_waiting_for_advisory_lock, pool), timeout=10)
        assert not start.done()
        await refunder.execute("COMMIT")
        await asyncio.wait_for(start, 10)
        await assert_ledger_equals_count(pool)
        # 2. The start holds it exclusively (uncommitted) when a refund comes: the refund waits, then applies.
        await starter.execute(q.LEDGER_FORGET)
        await starter.execute("BEGIN")
        await starter.execute(q.PASS_LOCK)
        await starter.execute(q.LEDGER_LOCK)
        cur = await starter.execute(q.NOW)
        now = (await cur.fetchone() or {"now": 0.0})["now"]
        params = {"window": 60, "window_start": int(now // 60 * 60)}
        for statement in (q.LEDGER_CLEAR, q.LEDGER_TRACK, q.LEDGER_START):
            await starter.execute(statement, params)
        refund = asyncio.create_task(execution_paths.end(refunder, ExecutionEnd(
            task_id=second, outcome="aborted", reason="collect_now_preempt")))
        await eventually(functools.partial(_waiting_for_advisory_lock, pool), timeout=10)
        assert not refund.done()
        await starter.execute("COMMIT")
        assert isinstance(await asyncio.wait_for(refund, 10), EndedExecution)
    await assert_ledger_equals_count(pool)


async def _waiting_for_advisory_lock(pool: AsyncConnectionPool[Conn]) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        return bool((await cur.fetchone() or {"n": 0})["n"])
