"""Dispatch coordinator against real Postgres and RabbitMQ: scanner, dispatch contract, wake-ups, refunds,
hot reload, auto slow-down, aging, explain."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.contracts.wire import TaskAvailable
from libs.db.pool import Conn
from libs.dispatch_settings import load_settings, set_setting
from libs.domain.schedule import plan_occurrence
from libs.domain.shard import ingest_shard_key
from libs.mq.topology import Topology, declare_exchanges
from libs.tasks import execution_paths
from libs.tasks.records import EndedExecution, ExecutionEnd
from libs.tasks.transitions import emit_lifecycle, finish_business_task
from libs.telemetry import metrics
from services.dispatch_coordinator import admin
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_coordinator.explain import explain_task
from services.dispatch_coordinator.maintenance import run_aging
from services.dispatch_coordinator.scanner import scan_once
from tests.integration.test_coordinator_load import collect_now
from tests.support.capture import capture
from tests.support.coordinator_runner import run_coordinator
from tests.support.dispatch_fleet import concurrency_peaks, seed_fleet
from tests.support.hub_routing import logical_key
from tests.support.wait import eventually


async def _one(conn: Conn, sql: str, params: dict[str, Any] | None = None) -> Any:
    cur = await conn.execute(sql, params or {})
    row = await cur.fetchone()
    assert row is not None
    return next(iter(row.values()))


async def _count(pool: AsyncConnectionPool[Conn], sql: str, params: dict[str, Any] | None = None) -> int:
    async with pool.connection() as conn:
        return int(await _one(conn, sql, params))


async def test_scanner_creates_tasks_once_in_tenant_time_zone_and_by_rollout(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[6, 6], clients_per_tenant=1, time_zone="Asia/Shanghai")
        # 20:00 UTC is already the next day in Shanghai (UTC+8): the business date is the local one. The
        # latest 20:00 UTC in the past, so exactly one daily occurrence is due whatever the time of day.
        now = datetime.now(UTC)
        slot = now.replace(hour=20, minute=0, second=0, microsecond=0)
        if slot > now:
            slot -= timedelta(days=1)
        await conn.execute("UPDATE monitoring_plans SET next_run_at = %(s)s", {"s": slot})
        second = seeded.tenants[1].tenant_id
        # Rollout: only tenants with tenant_id % 100 < pct go to desktop_tasks.
        pct = max(seeded.tenants[0].tenant_id, second) % 100
        first_result = await scan_once(pool, batch_size=5, rollout_percentage=pct)
    assert first_result.plans == 5  # bounded batch
    await scan_once(pool, batch_size=100, rollout_percentage=pct)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT tenant_id, brand_id, business_date, ingest_shard_key, execution_owner, "
                                 "dispatch_lane, dispatch_priority, status FROM monitoring_collect_tasks")
        tasks = await cur.fetchall()
        assert len(tasks) == 12
        local_date = (slot + timedelta(hours=8)).date()
        assert {t["business_date"] for t in tasks} == {local_date}
        assert all(t["ingest_shard_key"] == f"{t['tenant_id']}:{t['brand_id']}:{local_date.isoformat()}"
                   for t in tasks)
        # The scanner's SQL and libs.domain.shard define the shard key identically.
        assert all(t["ingest_shard_key"] == ingest_shard_key(t["tenant_id"], t["brand_id"], t["business_date"])
                   for t in tasks)
        assert all((t["dispatch_lane"], t["dispatch_priority"], t["status"]) == ("normal", 100, "pending")
                   for t in tasks)
        owners = {t["tenant_id"]: t["execution_owner"] for t in tasks}
        for tenant, owner in owners.items():
            assert owner == ("desktop_tasks" if tenant % 100 < pct else "legacy")
        assert await _one(conn, "SELECT min(next_run_at) > now() FROM monitoring_plans")
        # Idempotent on the business key: the same occurrence scanned again creates nothing.
        await conn.execute("UPDATE monitoring_plans SET next_run_at = %(s)s", {"s": slot})
    again = await scan_once(pool, batch_size=100, rollout_percentage=pct)
    assert again.plans == 12 and again.created == 0


async def test_scanner_sql_matches_plan_occurrence_and_shard_key(pool: AsyncConnectionPool[Conn]) -> None:
    """The scanner computes occurrences in SQL: same slot, business date and next run as plan_occurrence
    (the Python definition), for several zones (one unknown -> UTC), intervals and missed slots, and the
    same shard key as ingest_shard_key."""
    zones = ["America/Los_Angeles", "Asia/Kolkata", "Pacific/Kiritimati", "No/Such_Zone"]
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[3] * len(zones), clients_per_tenant=1)
        for tenant, zone in zip(seeded.tenants, zones, strict=True):
            await conn.execute("UPDATE tenants SET time_zone = %(z)s WHERE id = %(t)s",
                               {"z": zone, "t": tenant.tenant_id})
        now = datetime.now(UTC)
        # Per platform: daily, 6-hourly and 17-minute plans, 0.5 to 3.5 intervals behind (never near a slot edge).
        cur = await conn.execute("SELECT id, tenant_id, ai_platform_id FROM monitoring_plans ORDER BY id")
        plans = await cur.fetchall()
        expected = {}
        for index, plan in enumerate(plans):
            interval = (86400, 6 * 3600, 17 * 60)[index % 3]
            next_run_at = now - timedelta(seconds=interval * (0.5 + index % 4))
            await conn.execute("UPDATE monitoring_plans SET next_run_at = %(n)s, interval_seconds = %(i)s "
                               "WHERE id = %(id)s", {"n": next_run_at, "i": interval, "id": plan["id"]})
            zone = zones[[t.tenant_id for t in seeded.tenants].index(plan["tenant_id"])]
            expected[plan["id"]] = plan_occurrence(next_run_at, interval, now, zone)
    result = await scan_once(pool, batch_size=100, rollout_percentage=100)
    assert result.plans == len(plans) == result.created
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT t.plan_id, t.tenant_id, t.brand_id, t.business_date, t.ingest_shard_key, "
                                 "p.next_run_at FROM monitoring_collect_tasks t JOIN monitoring_plans p "
                                 "ON p.id = t.plan_id")
        rows = await cur.fetchall()
    assert len(rows) == len(plans)
    for row in rows:
        occurrence = expected[row["plan_id"]]
        assert row["business_date"] == occurrence.business_date, row
        assert row["next_run_at"] == occurrence.next_run_at, row
        assert row["ingest_shard_key"] == ingest_shard_key(row["tenant_id"], row["brand_id"], row["business_date"])
    # The dates really differ by zone (the test would not notice a zone being ignored otherwise).
    assert len({(r["business_date"]) for r in rows}) > 1


async def test_dispatch_contract_events_wakeups_and_platform_concurrency(
        settings: Any, pool: AsyncConnectionPool[Conn], amqp: Any, topology: Topology) -> None:
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[12], clients_per_tenant=3)
        await set_setting(conn, "dispatch_tick_ms", 60_000)  # only wake-ups can make it dispatch again
    tenant = seeded.tenants[0]
    async with amqp.channel() as channel:
        await declare_exchanges(channel, topology)
    # Bind the capture before the coordinator starts: its first dispatch is published within moments.
    async with capture(amqp, topology.dispatch_exchange, "#.monitor.#") as cap, run_coordinator(settings) as running:
        # Scanner -> tasks -> dispatch: one execution per platform (default limit 1 per tenant account).
        await eventually(lambda: _count(pool, "SELECT count(*) FROM desktop_tasks"), timeout=10,
                         message="first dispatch")
        await eventually(lambda: _eq(_count(pool, "SELECT count(*) FROM desktop_tasks"), 3), timeout=5,
                         message="one execution per platform")
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT d.*, t.dispatch_attempts, t.last_dispatched_at FROM desktop_tasks d "
                                     "JOIN monitoring_collect_tasks t ON t.id = d.monitor_task_id")
            rows = await cur.fetchall()
        assert {r["ai_platform_id"] for r in rows} == set(seeded.platforms.values())
        for r in rows:
            assert (r["kind"], r["status"], r["lane"], r["lane_weight"], r["source"], r["priority"]) == (
                "monitor", "queued", "normal", 40, "daily_schedule", 100)
            assert r["target_client_id"] in tenant.clients and r["dispatch_attempts"] == 1
            assert r["scheduler_group_key"] == f"qid:{r['question_id']}" and r["last_dispatched_at"]
        await eventually(lambda: _ge(len(cap.messages), 3), timeout=10, message="task_available published")
        events = [msgspec.json.decode(m.body, type=TaskAvailable) for m in cap.messages]
        assert {e.task_id for e in events} == {r["id"] for r in rows}
        assert {logical_key(m.routing_key) for m in cap.messages} == {
            f"monitor.normal.{r['target_client_id']}" for r in rows}

        # A completion (lifecycle event) frees the platform: the next task goes at once, not on the 60 s tick.
        done = rows[0]
        async with pool.connection() as conn, conn.transaction():
            await conn.execute("UPDATE desktop_tasks SET status = 'in_progress', lease_epoch = 1, leased_at = now() "
                               "WHERE id = %(id)s", {"id": done["id"]})
        async with pool.connection() as conn, conn.transaction():
            ended = await execution_paths.end(conn, ExecutionEnd(task_id=done["id"], outcome="succeeded"))
            assert isinstance(ended, EndedExecution)
            await finish_business_task(conn, done["monitor_task_id"], status="completed")
            await emit_lifecycle(conn, "task.completed", tenant_id=tenant.tenant_id, task_id=done["id"])
        started = time.monotonic()
        await eventually(lambda: _eq(_count(pool, "SELECT count(*) FROM desktop_tasks"), 4), timeout=5,
                         message="dispatch after the completion event")
        assert time.monotonic() - started < 5

        # Collect-now (NOTIFY in its transaction) for a task whose platform is busy on ANOTHER client (the
        # collect-now client's own queued scheduled work is cancelled by the collect-now itself).
        cn_client = tenant.clients[2]
        async with pool.connection() as conn:
            busy = await (await conn.execute(
                "SELECT id, monitor_task_id, ai_platform_id FROM desktop_tasks WHERE status = 'queued' "
                "AND target_client_id <> %(c)s ORDER BY created_at LIMIT 1", {"c": cn_client})).fetchone()
            assert busy is not None
            ready = [r["id"] for r in await (await conn.execute(
                "SELECT id FROM monitoring_collect_tasks t WHERE status = 'pending' AND NOT EXISTS (SELECT 1 FROM "
                "desktop_tasks d WHERE d.monitor_task_id = t.id) AND ai_platform_id = %(p)s ORDER BY id LIMIT 1",
                {"p": busy["ai_platform_id"]})).fetchall()]
            request_id, _ = await collect_now(conn, tenant_id=tenant.tenant_id, client_id=cn_client,
                                              task_ids=ready)
        # The tenant's account on that platform is busy (limit 1): the high task waits for that completion.
        async with pool.connection() as conn:
            explained = await explain_task(conn, str(ready[0]))
            assert explained is not None and explained["blocked_by"] == "platform_concurrency"
        async with pool.connection() as conn, conn.transaction():
            ended = await execution_paths.end(conn, ExecutionEnd(task_id=busy["id"], outcome="succeeded"))
            assert isinstance(ended, EndedExecution)
            await finish_business_task(conn, busy["monitor_task_id"], status="completed")
            await emit_lifecycle(conn, "task.completed", tenant_id=tenant.tenant_id, task_id=busy["id"])
        await eventually(lambda: _count(pool, "SELECT count(*) FROM desktop_tasks WHERE lane = 'high'"), timeout=5,
                         message="high dispatched")
        async with pool.connection() as conn:
            assert await _one(conn, "SELECT lane FROM desktop_tasks WHERE ai_platform_id = %(p)s AND status = "
                                    "'queued'", {"p": busy["ai_platform_id"]}) == "high"
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT d.source, d.interrupt_generation, d.target_client_id, d.lane_weight, "
                                     "c.interrupt_generation AS client_gen FROM desktop_tasks d JOIN desktop_clients c "
                                     "ON c.id = d.target_client_id WHERE d.lane = 'high'")
            high = await cur.fetchone()
            cur = await conn.execute("SELECT status, dispatched_task_count FROM monitoring_collect_requests "
                                     "WHERE id = %(r)s", {"r": request_id})
            request = await cur.fetchone()
            peaks = await concurrency_peaks(conn)
        assert high is not None and high["source"] == "collect_now" and high["lane_weight"] == 70
        assert high["target_client_id"] == cn_client and high["interrupt_generation"] == high["client_gen"] > 0
        assert request is not None and (request["status"], request["dispatched_task_count"]) == ("dispatching", 1)
        await eventually(lambda: _any_key(cap, f"monitor.high.{cn_client}"), timeout=10,
                         message="high task_available on its client's routing key")
        assert running.coordinator.listening.is_set()
    # Platform concurrency is per (tenant, platform) across all three clients: never above 1.
    assert max(peaks["platform"].values()) == 1


async def _eq(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def _ge(value: int, expected: int) -> bool:
    return value >= expected


async def _any_key(cap: Any, key: str) -> bool:
    return any(logical_key(m.routing_key) == key for m in cap.messages)


async def _prepare(pool: AsyncConnectionPool[Conn], plans: int = 30, **settings: Any) -> Any:
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[plans], clients_per_tenant=2, max_queue_depth=100)
        for key, value in settings.items():
            await set_setting(conn, key, value)
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 100 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 100")
    await scan_once(pool, batch_size=1000, rollout_percentage=100)
    return seeded


async def test_budget_spent_on_a_preempted_queued_dispatch_is_given_back(pool: AsyncConnectionPool[Conn]) -> None:
    await _prepare(pool, cluster_dispatch_per_minute=10, tenant_dispatch_per_minute=10, high_reserved_share=0.0,
                   budget_window_seconds=3600)
    dispatcher = Dispatcher(pool)
    async with pool.connection() as conn:
        settings = await load_settings(conn)
    first = await dispatcher.run_pass(settings)
    assert first.dispatched == 10
    blocked = await dispatcher.run_pass(settings)
    assert blocked.dispatched == 0 and blocked.cluster_exhausted
    assert metrics.monitor_dispatch_reject_by_reason_count.value(reason="cluster_budget") >= 1
    async with pool.connection() as conn, conn.transaction():
        victims = await (await conn.execute("SELECT id FROM desktop_tasks ORDER BY id LIMIT 2")).fetchall()
        for_queued = ExecutionEnd(task_id=victims[0]["id"], outcome="aborted", reason="collect_now_preempt")
        assert isinstance(await execution_paths.end(conn, for_queued), EndedExecution)
        # An execution that had been leased keeps counting (its work happened).
        await conn.execute("UPDATE desktop_tasks SET status = 'in_progress', lease_epoch = 1 WHERE id = %(id)s",
                           {"id": victims[1]["id"]})
        for_leased = ExecutionEnd(task_id=victims[1]["id"], outcome="aborted", reason="collect_now_preempt")
        assert isinstance(await execution_paths.end(conn, for_leased), EndedExecution)
    refunded = await dispatcher.run_pass(settings)
    assert refunded.dispatched == 1


async def test_lane_pause_is_hot_reloaded_and_explained(settings: Any, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        await seed_fleet(conn, plans_per_tenant=[3], clients_per_tenant=1)
        await admin.set_lane_paused(conn, "normal", True)
    async with run_coordinator(settings, with_pump=False) as running:
        await eventually(lambda: _count(pool, "SELECT count(*) FROM monitoring_collect_tasks"), timeout=10,
                         message="scanned")
        async with pool.connection() as conn:
            task_id = await _one(conn, "SELECT min(id) FROM monitoring_collect_tasks")
            explained = await explain_task(conn, str(task_id))
        assert explained is not None and explained["ready"] and explained["blocked_by"] == "lane_paused"
        assert explained["lane_position"]["ahead_in_lane"] == 0 and explained["tenant_ready_backlog"]["normal"] == 3
        assert await _count(pool, "SELECT count(*) FROM desktop_tasks") == 0
        async with pool.connection() as conn:
            assert await admin.set_lane_paused(conn, "normal", False) == []
        # No restart: the running coordinator picks the change up within seconds.
        await eventually(lambda: _count(pool, "SELECT count(*) FROM desktop_tasks"), timeout=5,
                         message="dispatch after resume")
        async with pool.connection() as conn:
            explained = await explain_task(conn, str(task_id))
            status = await admin.status(conn)
        assert running.coordinator.dispatched_total >= 1
    assert explained is not None and (explained["ready"] is False) == ("active_execution" in explained)
    assert status["lanes"]["normal"]["paused"] is False and status["clients"]["eligible"] == 1


async def test_auto_slowdown_pauses_normal_keeps_high_and_resumes(settings: Any, pool: AsyncConnectionPool[Conn],
                                                                   topology: Topology) -> None:
    seeded = await _prepare(pool, plans=9)
    coordinator = Coordinator(pool, CoordinatorConfig(database_url=settings.database_url, topology=topology,
                                                      instance_id="t"))
    async with pool.connection() as conn:
        tenant = seeded.tenants[0]
        await conn.execute("INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date, requested_at) "
                           "VALUES (%(t)s, %(b)s, current_date, now() - interval '2 minutes')",
                           {"t": tenant.tenant_id, "b": tenant.brand_id})
        high_id = await _one(conn, "UPDATE monitoring_collect_tasks SET dispatch_lane = 'high', dispatch_priority = "
                                   "5000 WHERE id = (SELECT min(id) FROM monitoring_collect_tasks) RETURNING id")
    await coordinator.maintain_once()
    assert coordinator.slowdown.active and coordinator.slowdown.reasons == ["projection_lag"]
    assert REGISTRY.get_sample_value("dispatch_auto_slowdown_active") == 1
    outcome = await coordinator.dispatcher.run_pass(await coordinator.settings())
    assert outcome.dispatched == 1 and outcome.rejections.get("auto_slowdown", 0) >= 1
    async with pool.connection() as conn:
        assert await _one(conn, "SELECT monitor_task_id FROM desktop_tasks") == high_id
        explained = await explain_task(conn, str(high_id + 1))
        assert explained is not None and explained["blocked_by"] == "auto_slowdown"
        await conn.execute("DELETE FROM projection_rebuild_queue")
    await coordinator.maintain_once()
    assert not coordinator.slowdown.active and REGISTRY.get_sample_value("dispatch_auto_slowdown_active") == 0
    outcome = await coordinator.dispatcher.run_pass(await coordinator.settings())
    assert outcome.dispatched == 8


async def test_aging_boosts_the_oldest_tenth_with_the_log_formula(pool: AsyncConnectionPool[Conn]) -> None:
    await _prepare(pool, plans=30, aging_fraction=0.1)
    async with pool.connection() as conn:
        # Spread enqueued_at: task k waited k*10 minutes; the three oldest waited 300, 290, 280 minutes.
        await conn.execute(
            "UPDATE monitoring_collect_tasks t SET enqueued_at = now() - make_interval(mins => (r.k * 10)::int) "
            "FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM monitoring_collect_tasks) r WHERE r.id = t.id")
        await conn.execute(
            "UPDATE monitoring_collect_tasks SET aging_boost = 880, dispatch_lane = 'normal_boosted', "
            "dispatch_priority = 1880 WHERE id = (SELECT max(id) FROM monitoring_collect_tasks)")
        settings = await load_settings(conn)
    assert (await run_aging(pool, settings)).boosted == 3
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT dispatch_lane, dispatch_priority, aging_boost, "
                                 "round(extract(epoch FROM now() - enqueued_at) / 60) AS waited "
                                 "FROM monitoring_collect_tasks ORDER BY enqueued_at")
        rows = await cur.fetchall()
    oldest, second, third = rows[:3]
    assert (oldest["dispatch_lane"], oldest["aging_boost"], oldest["dispatch_priority"]) == ("normal_boosted", 900,
                                                                                            1900)  # capped
    boost = int(50 * math.log2(1 + 290 / 5))
    assert (second["dispatch_lane"], second["aging_boost"], second["dispatch_priority"]) == (
        "normal_boosted", boost, 1000 + boost)
    assert third["aging_boost"] == int(50 * math.log2(1 + 280 / 5))
    assert all(r["dispatch_lane"] == "normal" and r["aging_boost"] == 0 for r in rows[3:])


async def test_rollback_aborts_in_flight_and_returns_pending_to_legacy(pool: AsyncConnectionPool[Conn]) -> None:
    await _prepare(pool, plans=6)
    dispatcher = Dispatcher(pool)
    async with pool.connection() as conn:
        settings = await load_settings(conn)
    assert (await dispatcher.run_pass(settings)).dispatched == 6
    async with pool.connection() as conn:
        result = await admin.emergency_rollback(conn, force_in_flight=True)
        assert result["aborted_executions"] == 6 and result["business_tasks_to_legacy"] == 6
        assert (await load_settings(conn)).rollout_percentage == 0
        assert await _one(conn, "SELECT count(*) FROM desktop_tasks WHERE status = 'aborted' AND interrupt_reason = "
                                "'phase2_emergency_rollback'") == 6
        assert await _one(conn, "SELECT count(*) FROM outbox WHERE routing_key LIKE 'monitor.control.%%'") == 6
        assert await _one(conn, "SELECT count(*) FROM monitoring_collect_tasks WHERE execution_owner = 'legacy'") == 6
