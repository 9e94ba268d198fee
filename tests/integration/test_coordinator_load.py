"""The issue's load scenario, scaled to run in the test suite (the full 20,000-task run is bench/b_dispatch.py).

10 tenants x 4 online simulated clients, 3 platforms with different concurrency limits, every plan due at
once (tenant 1 has a backlog 10x the others', due earlier so FIFO would serve it first), short budget
windows so several windows pass. Platform limits are set high here so that the cluster budget, not
platform capacity, decides who gets a window's slots (the first pass of each window runs into the
budget): that is when tenant fairness is the scheduler's doing. Tight platform limits (1 per tenant
account across clients) are proven in test_coordinator.py. Measured from
the database afterwards: budgets per window, platform / client concurrency and queue depth never exceeded;
a collect-now issued mid-run goes ahead of every normal task on its client; the big tenant never takes more
than its fair share while others wait; normal keeps its background share while a high burst is busy.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import set_setting
from libs.tasks import execution_paths
from libs.tasks.records import EndedExecution, ExecutionEnd
from libs.tasks.transitions import yield_business_task
from tests.support.coordinator_runner import run_coordinator
from tests.support.dispatch_fleet import Fleet, concurrency_peaks, running, seed_fleet, window_counts
from tests.support.wait import eventually

WINDOW_S = 4
CLUSTER = 300
TENANT = 150
SHARE = 0.15
RESERVE = 0.10
PLATFORM_LIMITS = {"openai": 30, "gemini": 40, "perplexity": 50}
BIG, SMALL = 900, 90


async def collect_now(conn: Conn, *, tenant_id: int, client_id: uuid.UUID, task_ids: list[int]) -> tuple[uuid.UUID,
                                                                                                          float]:
    """A minimal collect-now transaction per cross-service contract 4 (what collect-now-api does)."""
    request_id = uuid.uuid4()
    async with conn.transaction():
        cur = await conn.execute("UPDATE desktop_clients SET interrupt_generation = interrupt_generation + 1 "
                                 "WHERE id = %(c)s RETURNING interrupt_generation", {"c": client_id})
        gen = (await cur.fetchone())["interrupt_generation"]  # type: ignore[index]
        await conn.execute(
            "INSERT INTO monitoring_collect_requests (id, tenant_id, workspace_id, brand_id, requested_by_user_id, "
            "target_client_id, scope_hash, request_scope, requested_task_count, interrupt_generation, ttl_expires_at) "
            "SELECT %(r)s, t.tenant_id, t.workspace_id, t.brand_id, t.tenant_id, %(c)s, 'h', '{}', %(n)s, %(g)s, "
            "now() + interval '5 minutes' FROM monitoring_collect_tasks t WHERE t.id = %(first)s",
            {"r": request_id, "c": client_id, "n": len(task_ids), "g": gen, "first": task_ids[0]})
        await conn.execute(
            "UPDATE monitoring_collect_tasks SET dispatch_lane = 'high', dispatch_priority = 5000, "
            "target_client_id = %(c)s, interrupt_generation = %(g)s, collect_request_id = %(r)s, "
            "dispatch_after = now(), trigger_source = 'manual' WHERE id = ANY(%(ids)s)",
            {"c": client_id, "g": gen, "r": request_id, "ids": task_ids})
        cur = await conn.execute("SELECT id, monitor_task_id FROM desktop_tasks WHERE target_client_id = %(c)s "
                                 "AND status = 'queued' AND source = 'daily_schedule'", {"c": client_id})
        for row in await cur.fetchall():
            preempted = ExecutionEnd(task_id=row["id"], outcome="aborted", reason="collect_now_preempt")
            if isinstance(await execution_paths.end(conn, preempted), EndedExecution):
                await yield_business_task(conn, row["monitor_task_id"])
        await conn.execute(
            "UPDATE desktop_tasks SET control_flags = jsonb_build_object('interrupt_requested', true, "
            "'interrupt_generation', %(g)s::bigint), interrupt_generation = %(g)s, interrupted_at = now(), "
            "interrupt_reason = 'collect_now_preempt' WHERE target_client_id = %(c)s AND status = 'in_progress' "
            "AND source = 'daily_schedule'", {"g": gen, "c": client_id})
        await conn.execute("SELECT pg_notify('dispatch_wakeup', '')")
    return request_id, time.time()


async def _ready_tasks(conn: Conn, tenant_id: int, n: int) -> list[int]:
    cur = await conn.execute(
        "SELECT t.id FROM monitoring_collect_tasks t WHERE t.tenant_id = %(t)s AND t.status = 'pending' AND "
        "NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id AND d.status IN "
        "('queued', 'in_progress', 'unknown')) ORDER BY t.id LIMIT %(n)s", {"t": tenant_id, "n": n})
    return [r["id"] for r in await cur.fetchall()]


async def _high_burst(conn: Conn, tenant_ids: list[int], per_tenant: int) -> float:
    """Collect-now-style high tasks (tomorrow's business date, unbound) for several tenants at once."""
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, "
            "business_date, status, trigger_source, dispatch_priority, dispatch_lane, ingest_shard_key, "
            "execution_owner) "
            "SELECT p.tenant_id, p.workspace_id, p.brand_id, p.question_id, p.ai_platform_id, current_date + 1, "
            "'pending', 'manual', 5000, 'high', p.tenant_id || ':' || p.brand_id, 'desktop_tasks' "
            "FROM (SELECT *, row_number() OVER (PARTITION BY tenant_id ORDER BY id) rn FROM monitoring_plans "
            "      WHERE tenant_id = ANY(%(t)s)) p WHERE p.rn <= %(n)s", {"t": tenant_ids, "n": per_tenant})
        await conn.execute("SELECT pg_notify('dispatch_wakeup', '')")
    return time.time()


async def _executions(conn: Conn) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT id, tenant_id, target_client_id, lane, monitor_task_id, status, collect_request_id, "
        "extract(epoch FROM created_at)::float8 AS created, extract(epoch FROM leased_at)::float8 AS leased "
        "FROM desktop_tasks WHERE kind = 'monitor'")
    return list(await cur.fetchall())


async def test_budgets_concurrency_collect_now_fairness_and_background_share(
        settings: Any, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[BIG] + [SMALL] * 9, clients_per_tenant=4)
        for key, value in (("budget_window_seconds", WINDOW_S), ("cluster_dispatch_per_minute", CLUSTER),
                           ("tenant_dispatch_per_minute", TENANT), ("normal_background_share", SHARE),
                           ("high_reserved_share", RESERVE), ("dispatch_tick_ms", 200),
                           ("aging_interval_seconds", 3600)):
            await set_setting(conn, key, value)
        for code, limit in PLATFORM_LIMITS.items():
            await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) VALUES (%(p)s, %(n)s) "
                               "ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = EXCLUDED.max_concurrent",
                               {"p": seeded.platforms[code], "n": limit})
    tenants = [t.tenant_id for t in seeded.tenants]
    big, small = tenants[0], tenants[1:]
    fleet = Fleet(pool, seeded.client_ids, task_seconds=0.03)

    async with run_coordinator(settings), running(fleet):
        # Wait for the scanner, then for enough windows for the budgets to bite.
        async def created() -> bool:
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT count(*) AS n FROM monitoring_collect_tasks")
                return (await cur.fetchone())["n"] >= BIG + 9 * SMALL  # type: ignore[index,no-any-return]
        await eventually(created, timeout=10, message="scanner created every task")

        # Collect-now mid-run on one of tenant 2's clients.
        async def small_tenant_progress() -> bool:
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE tenant_id = %(t)s",
                                         {"t": small[0]})
                return (await cur.fetchone())["n"] >= 15  # type: ignore[index,no-any-return]
        await eventually(small_tenant_progress, timeout=15, message="tenant 2 under way")
        cn_client = seeded.tenants[1].clients[0]
        async with pool.connection() as conn:
            cn_tasks = await _ready_tasks(conn, small[0], 3)
            request_id, cn_at = await collect_now(conn, tenant_id=small[0], client_id=cn_client, task_ids=cn_tasks)

        async def cn_dispatched() -> bool:
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE collect_request_id = %(r)s "
                                         "AND lane = 'high'", {"r": request_id})
                return (await cur.fetchone())["n"] == 3  # type: ignore[index,no-any-return]
        await eventually(cn_dispatched, timeout=5, message="collect-now tasks dispatched")

        async def small_done() -> bool:
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT count(DISTINCT monitor_task_id) AS n FROM desktop_tasks "
                                         "WHERE tenant_id = ANY(%(t)s) AND status <> 'aborted'", {"t": small})
                return (await cur.fetchone())["n"] >= 9 * SMALL  # type: ignore[index,no-any-return]
        await eventually(small_done, timeout=30, message="every small tenant's task dispatched")
        small_done_at = time.time()

        # A high burst bigger than a window's budget, while tenant 1 still has normal work.
        async with pool.connection() as conn:
            burst_at = await _high_burst(conn, small[1:], 80)

        async def burst_dispatched() -> bool:
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE lane = 'high' "
                                         "AND collect_request_id IS NULL")
                return (await cur.fetchone())["n"] >= 8 * 80  # type: ignore[index,no-any-return]
        await eventually(burst_dispatched, timeout=30, message="high burst dispatched")

    async with pool.connection() as conn:
        counts = await window_counts(conn, WINDOW_S)
        peaks = await concurrency_peaks(conn)
        rows = await _executions(conn)
        cur = await conn.execute("SELECT status, dispatched_task_count, first_dispatched_at FROM "
                                 "monitoring_collect_requests WHERE id = %(r)s", {"r": request_id})
        request = await cur.fetchone()
        cur = await conn.execute("SELECT monitor_task_id, count(*) AS n FROM desktop_tasks WHERE status IN "
                                 "('queued', 'in_progress', 'unknown') GROUP BY 1 HAVING count(*) > 1")
        doubled = await cur.fetchall()

    # 1. Budgets per window, measured from the database.
    non_high_cap = CLUSTER - math.ceil(CLUSTER * RESERVE)
    for window, per in counts.items():
        assert sum(per.values()) <= CLUSTER, (window, per)
        assert sum(n for (_, high), n in per.items() if not high) <= non_high_cap, (window, per)
        for (tenant, high), n in per.items():
            if not high:
                assert n <= TENANT, (window, tenant, n)
    assert any(sum(n for (_, h), n in per.items() if not h) == non_high_cap for per in counts.values()), \
        "the cluster budget never became the limit: the scenario proves nothing"

    # 2. Concurrency: per (tenant, platform) across clients, per client running, per client queue depth.
    code_of = {v: k for k, v in seeded.platforms.items()}
    for (tenant, platform), peak in peaks["platform"].items():
        assert peak <= PLATFORM_LIMITS[code_of[platform]], (tenant, code_of[platform], peak)
    assert all(peak <= 2 for peak in peaks["client_running"].values())
    assert all(peak <= 20 for peak in peaks["client_queued"].values())
    assert doubled == []

    # 3. Collect-now: its tasks went ahead of every normal task on its client.
    assert request is not None and request["dispatched_task_count"] == 3 and request["first_dispatched_at"]
    assert request["status"] in ("dispatching", "running")
    highs = [r for r in rows if r["collect_request_id"] == request_id]
    last_high_created = max(r["created"] for r in highs)
    last_high_leased = max(r["leased"] for r in highs)
    later_normal = [r for r in rows if r["target_client_id"] == cn_client and r["lane"] != "high"
                    and r["created"] > cn_at]
    assert all(r["created"] >= last_high_created for r in later_normal)
    assert all(r["leased"] is None or r["leased"] >= last_high_leased for r in later_normal
               if r["status"] != "aborted")
    assert all(r["leased"] is None or r["leased"] < cn_at or r["leased"] >= last_high_leased
               for r in rows if r["target_client_id"] == cn_client and r["lane"] != "high"
               and r["status"] != "aborted")

    # 4. Fairness: while small tenants had work, tenant 1 never got more than its fair share of a window.
    start_window = min(counts)
    for window, per in counts.items():
        if window == start_window or (window + 1) * WINDOW_S > small_done_at:
            continue  # the first (partial) window and windows that ended after the small tenants were done
        normal = {t: n for (t, high), n in per.items() if not high}
        total = sum(normal.values())
        fair = total / len(tenants)
        assert normal.get(big, 0) <= 1.5 * fair + 5, (window, normal)
        assert all(normal.get(t, 0) >= 0.5 * fair - 5 for t in small), (window, normal)

    # 5. Normal progresses while the high burst is busy, with at least its background share.
    burst = [r for r in rows if r["lane"] == "high" and r["collect_request_id"] is None]
    burst_end = max(r["created"] for r in burst)
    busy_windows = [w for w in counts if w * WINDOW_S >= burst_at and (w + 1) * WINDOW_S <= burst_end]
    full_high = [w for w in counts if sum(n for (_, h), n in counts[w].items() if h) >= CLUSTER - math.ceil(
        CLUSTER * SHARE)]
    assert full_high, "the high burst never filled a window: background share untested"
    for window in {*busy_windows, *full_high}:
        normal = sum(n for (_, high), n in counts[window].items() if not high)
        assert normal >= math.ceil(CLUSTER * SHARE), (window, counts[window])
