"""The operator's migration levers (docs/legacy-path.md), through the real `monitorctl` against real Postgres:
`rollout set` (tenant movement), `rollout status` (both paths' counts) and `rollback` (dry run by default, `--yes`,
`--yes --force`; one transaction, idempotent, its dry run's counts are what it then changes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import msgspec
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import load_settings, set_setting
from libs.domain.lanes import lane_weight
from libs.tasks import execution_paths, legacy
from libs.tasks.records import Done, EndedExecution, ExecutionEnd, Leased
from libs.tasks.transitions import finish_business_task
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_coordinator.scanner import scan_once
from tests.support.db import fetch, one
from tests.support.desktop import dispatch_execution, insert_ready_task
from tests.support.monitorctl import monitorctl_json, monitorctl_refused

REASON = "phase2_emergency_rollback"
CHANGES = ("tenants_to_legacy", "aborted_executions", "task_control_messages", "business_tasks_to_legacy")


@dataclass
class World:
    seed: dict[str, Any]
    tenant: dict[str, Any]  # tenant A: every hand-made task
    client_id: str
    platforms: list[int]
    executions: list[dict[str, Any]]  # queued, in_progress, unknown (with their pending business tasks)
    idle: list[int]  # pending desktop_tasks tasks without an execution
    legacy_pending: int
    completed: int


async def _world(pool: AsyncConnectionPool[Conn]) -> World:
    """Two tenants (A, B) at rollout 100. A: three active executions (queued, in progress, unknown), four ready
    desktop_tasks tasks without one, a pending legacy task and a completed desktop_tasks task."""
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=2, brands=1, questions=3, clients=1, due=False)
        tenant = seed["tenants"][0]
        client = tenant["clients"][0]["client_id"]
        platforms = [int(p["ai_platform_id"]) for p in seed["platforms"]]
        executions = [await dispatch_execution(conn, tenant=tenant, platform_id=platforms[0], client_id=client,
                                               question_index=q) for q in range(3)]
        await conn.execute("UPDATE desktop_tasks SET status = 'in_progress', lease_epoch = 1, leased_at = now() "
                           "WHERE id = %s", (executions[1]["task_id"],))
        await conn.execute("UPDATE desktop_tasks SET status = 'unknown', lease_epoch = 1 WHERE id = %s",
                           (executions[2]["task_id"],))
        idle = [await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=q, platform_id=platforms[1])
                for q in range(3)]
        idle.append(await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=0,
                                            platform_id=platforms[2]))
        legacy_pending = await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=1,
                                                 platform_id=platforms[2])
        await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = 'legacy' WHERE id = %s",
                           (legacy_pending,))
        completed = await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=2,
                                            platform_id=platforms[2])
        await finish_business_task(conn, completed, status="completed")
    return World(seed=seed, tenant=tenant, client_id=client, platforms=platforms, executions=executions, idle=idle,
                 legacy_pending=legacy_pending, completed=completed)


async def _state(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    """Everything a rollback may write."""
    return {
        "tasks": await fetch(pool, "SELECT id, execution_owner, status, dispatch_attempts, leased_to_executor, "
                                   "legacy_lease_id, lease_token_hash, updated_at FROM monitoring_collect_tasks "
                                   "ORDER BY id"),
        "executions": await fetch(pool, "SELECT id, status, interrupt_reason, updated_at FROM desktop_tasks "
                                        "ORDER BY id"),
        "leases": await fetch(pool, "SELECT id, status, updated_at FROM legacy_leases ORDER BY id"),
        "outbox": await fetch(pool, "SELECT id, routing_key FROM outbox ORDER BY id"),
        "settings": await fetch(pool, "SELECT key, value, updated_at FROM dispatch_settings ORDER BY key"),
    }


def _changes(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "dry_run"}


async def _owner(pool: AsyncConnectionPool[Conn], task_id: int) -> dict[str, Any]:
    return await one(pool, "SELECT execution_owner, status, dispatch_attempts FROM monitoring_collect_tasks "
                           "WHERE id = %s", task_id)


def _text(settings: Settings, *args: str) -> str:
    """A command's human output (no --json)."""
    env = {**os.environ, "DATABASE_URL": settings.database_url, "AMQP_URL": settings.amqp_url}
    done = subprocess.run([sys.executable, "-m", "tools.monitorctl", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_rollback_dry_run_changes_nothing_and_counts_what_the_apply_then_changes(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool)
    before = await _state(pool)

    default = await monitorctl_json(settings, "rollback")
    assert await monitorctl_json(settings, "rollback", "--dry-run") == default
    assert default == {
        "dry_run": True, "forced": False, "rollout_percentage": 0, "rollout_percentage_before": 100,
        "rollout_changed": True, "tenants_to_legacy": 2, "aborted_executions": 0, "task_control_messages": 0,
        "business_tasks_to_legacy": len(world.idle), "in_flight_left_to_finish": 3}
    forced_preview = await monitorctl_json(settings, "rollback", "--force")
    assert forced_preview["dry_run"] and forced_preview["aborted_executions"] == 3
    assert forced_preview["business_tasks_to_legacy"] == len(world.idle) + 3
    assert await _state(pool) == before  # nothing changed, not even a timestamp
    async with pool.connection() as conn:
        assert (await load_settings(conn)).rollout_percentage == 100
    text = await asyncio.to_thread(_text, settings, "rollback")
    assert "dry run: nothing changed" in text and "left to finish: 3" in text
    assert await _state(pool) == before

    applied = await monitorctl_json(settings, "rollback", "--yes")
    assert applied["dry_run"] is False and _changes(applied) == _changes(default)
    # The forced dry run after the first apply, then the forced apply: the same counts again.
    forced_preview = await monitorctl_json(settings, "rollback", "--force")
    assert (forced_preview["tenants_to_legacy"], forced_preview["aborted_executions"],
            forced_preview["business_tasks_to_legacy"]) == (0, 3, 3)
    forced = await monitorctl_json(settings, "rollback", "--yes", "--force")
    assert forced["dry_run"] is False and _changes(forced) == _changes(forced_preview)


async def test_rollback_yes_leaves_in_flight_executions_alone_and_moves_only_tasks_without_one(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool)
    outbox_before = await fetch(pool, "SELECT id FROM outbox")

    result = await monitorctl_json(settings, "rollback", "--yes")
    assert (result["business_tasks_to_legacy"], result["aborted_executions"],
            result["in_flight_left_to_finish"]) == (len(world.idle), 0, 3)
    async with pool.connection() as conn:
        assert (await load_settings(conn)).rollout_percentage == 0
    executions = await fetch(pool, "SELECT status, interrupt_reason FROM desktop_tasks ORDER BY lease_epoch, status")
    assert sorted(e["status"] for e in executions) == ["in_progress", "queued", "unknown"]
    assert all(e["interrupt_reason"] is None for e in executions)
    for execution in world.executions:  # their tasks stay on desktop_tasks, attempt kept
        assert await _owner(pool, execution["monitor_task_id"]) == {
            "execution_owner": "desktop_tasks", "status": "pending", "dispatch_attempts": 1}
    for task_id in world.idle:
        assert await _owner(pool, task_id) == {"execution_owner": "legacy", "status": "pending",
                                               "dispatch_attempts": 0}
    assert (await _owner(pool, world.legacy_pending))["execution_owner"] == "legacy"
    assert await _owner(pool, world.completed) == {"execution_owner": "desktop_tasks", "status": "completed",
                                                   "dispatch_attempts": 0}
    assert await fetch(pool, "SELECT id FROM outbox") == outbox_before  # no client is told anything

    # An execution that finishes afterwards leaves its task done on desktop_tasks; a second apply leaves it there.
    done = world.executions[1]
    async with pool.connection() as conn, conn.transaction():
        ended = await execution_paths.end(conn, ExecutionEnd(task_id=done["task_id"], outcome="succeeded"))
        assert isinstance(ended, EndedExecution)
        assert await finish_business_task(conn, done["monitor_task_id"], status="completed")
    again = await monitorctl_json(settings, "rollback", "--yes")
    assert [again[k] for k in CHANGES] == [0, 0, 0, 0] and again["in_flight_left_to_finish"] == 2
    assert await _owner(pool, done["monitor_task_id"]) == {"execution_owner": "desktop_tasks", "status": "completed",
                                                           "dispatch_attempts": 1}


async def test_rollback_force_aborts_in_flight_tells_each_client_and_returns_the_tasks_to_legacy(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool)

    result = await monitorctl_json(settings, "rollback", "--yes", "--force")
    assert (result["aborted_executions"], result["task_control_messages"], result["business_tasks_to_legacy"],
            result["in_flight_left_to_finish"]) == (3, 3, len(world.idle) + 3, 0)
    executions = await fetch(pool, "SELECT id, status, interrupt_reason, finished_at FROM desktop_tasks")
    assert {(e["status"], e["interrupt_reason"]) for e in executions} == {("aborted", REASON)}
    assert all(e["finished_at"] is not None for e in executions)
    for execution in world.executions:  # back on the legacy path, the dispatch attempt given back
        assert await _owner(pool, execution["monitor_task_id"]) == {
            "execution_owner": "legacy", "status": "pending", "dispatch_attempts": 0}
    assert [(await _owner(pool, t))["execution_owner"] for t in world.idle] == ["legacy"] * len(world.idle)
    assert (await _owner(pool, world.completed))["status"] == "completed"

    controls = await fetch(pool, "SELECT routing_key, ordering_key, tenant_id, payload FROM outbox "
                                 "WHERE message_type = 'task_control' ORDER BY id")
    assert len(controls) == 3
    told = set()
    for row in controls:
        assert row["routing_key"] == f"monitor.control.{world.client_id}"
        assert row["ordering_key"] == f"client:{world.client_id}"
        assert row["tenant_id"] == world.tenant["tenant_id"]
        message = msgspec.json.decode(bytes(row["payload"]))
        assert (message["control"], message["reason"], message["target_client_id"]) == (
            "cancelled", REASON, world.client_id)
        told.add(uuid.UUID(message["task_id"]))
    assert told == {e["task_id"] for e in world.executions}
    aborted = await fetch(pool, "SELECT payload FROM outbox WHERE routing_key = 'task.aborted'")
    assert {uuid.UUID(msgspec.json.decode(bytes(r["payload"]))["task_id"]) for r in aborted} == told
    assert all(msgspec.json.decode(bytes(r["payload"]))["reason"] == REASON for r in aborted)


async def test_rollback_run_twice_changes_nothing_the_second_time(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    await _world(pool)
    first = await monitorctl_json(settings, "rollback", "--yes", "--force")
    assert first["aborted_executions"] == 3
    after_first = await _state(pool)
    for args in (("--yes", "--force"), ("--yes",), ("--force",), ()):
        again = await monitorctl_json(settings, "rollback", *args)
        assert [again[k] for k in CHANGES] == [0, 0, 0, 0], (args, again)
        assert (again["rollout_changed"], again["in_flight_left_to_finish"]) == (False, 0)
    assert await _state(pool) == after_first


async def test_after_a_rollback_scheduled_work_is_created_and_offered_on_the_legacy_path(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool)
    await monitorctl_json(settings, "rollback", "--yes", "--force")
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET online = true, last_heartbeat_at = now()")
        await conn.execute("UPDATE monitoring_plans SET next_run_at = now() - interval '1 minute'")
        dispatch_settings = await load_settings(conn)
    assert dispatch_settings.rollout_percentage == 0
    scanned = await scan_once(pool, batch_size=100, rollout_percentage=dispatch_settings.rollout_percentage)
    assert scanned.created > 0
    tenant_b = world.seed["tenants"][1]["tenant_id"]
    owners = await fetch(pool, "SELECT DISTINCT execution_owner FROM monitoring_collect_tasks WHERE tenant_id = %s",
                         tenant_b)
    assert owners == [{"execution_owner": "legacy"}]

    outcome = await Dispatcher(pool).run_pass(dispatch_settings)
    assert outcome.dispatched > 0
    assert (await one(pool, "SELECT count(*) AS n FROM desktop_tasks WHERE status <> 'aborted'"))["n"] == 0
    offered = await fetch(pool, "SELECT t.execution_owner, t.status, l.status AS lease FROM legacy_leases l "
                                "JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id")
    assert len(offered) == outcome.dispatched
    assert {(o["execution_owner"], o["status"], o["lease"]) for o in offered} == {("legacy", "leased", "queued")}


async def test_rollout_set_prints_how_many_tenants_move_and_leaves_existing_tasks_on_their_path(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=4, brands=1, questions=1, clients=1, due=False)
        tenant = seed["tenants"][0]
        existing = await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=0,
                                           platform_id=int(seed["platforms"][0]["ai_platform_id"]))
    ids = [t["tenant_id"] for t in seed["tenants"]]
    cut = sorted(i % 100 for i in ids)[2]  # two tenants below it, two at or above
    on_desktop = sum(1 for i in ids if i % 100 < cut)

    preview = await monitorctl_json(settings, "rollout", "set", str(cut), "--dry-run")
    assert preview == {
        "rollout_percentage": {"before": 100, "after": cut}, "tenants": 4,
        "desktop_tasks_tenants": {"before": 4, "after": on_desktop},
        "legacy_tenants": {"before": 0, "after": 4 - on_desktop},
        "tenants_to_desktop_tasks": 0, "tenants_to_legacy": 4 - on_desktop, "applied": False}
    async with pool.connection() as conn:
        assert (await load_settings(conn)).rollout_percentage == 100

    applied = await monitorctl_json(settings, "rollout", "set", str(cut))
    assert applied == {**preview, "applied": True}
    async with pool.connection() as conn:
        assert (await load_settings(conn)).rollout_percentage == cut
    assert (await _owner(pool, existing))["execution_owner"] == "desktop_tasks"

    assert "--force" in await monitorctl_refused(settings, "rollout", "set", "100")  # a jump past the ramp's gates
    text = await asyncio.to_thread(_text, settings, "rollout", "set", "100", "--force")
    assert f"rollout: {cut}% -> 100%" in text
    assert f"to desktop_tasks for {4 - on_desktop} tenant(s)" in text and "existing tasks keep their path" in text
    back = await monitorctl_json(settings, "rollout", "set", "0")
    assert (back["tenants_to_legacy"], back["tenants_to_desktop_tasks"]) == (4, 0)
    assert (await _owner(pool, existing))["execution_owner"] == "desktop_tasks"
    assert "between 0 and 100" in await monitorctl_refused(settings, "rollout", "set", "101")
    assert ">= 0" in await monitorctl_refused(settings, "rollout", "set", "-1")


_LEGACY_ROW = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner, enqueued_at)
VALUES (%(t)s, %(w)s, %(b)s, %(q)s, %(p)s, %(d)s, 'pending', 100, 'normal', 'k', %(owner)s, now())
RETURNING id, enqueued_at
"""


async def test_rollout_status_counts_the_real_rows_of_both_paths(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=2, brands=1, questions=5, clients=1, due=False)
        desk, leg = seed["tenants"]
        platforms = [int(p["ai_platform_id"]) for p in seed["platforms"]]
        client = uuid.UUID(leg["clients"][0]["client_id"])
        # Rollout between the two tenants: the first on desktop_tasks, the second on legacy.
        await set_setting(conn, "rollout_percentage", desk["tenant_id"] % 100 + 1)
        assert leg["tenant_id"] % 100 >= desk["tenant_id"] % 100 + 1

        # desktop_tasks: 2 pending, 1 in flight (its business row pending too), 1 completed today, 1 yesterday.
        for q in range(2):
            await insert_ready_task(conn, tenant=desk, brand_index=0, question_index=q, platform_id=platforms[0])
        await dispatch_execution(conn, tenant=desk, platform_id=platforms[1], client_id=desk["clients"][0]["client_id"])
        done = await insert_ready_task(conn, tenant=desk, brand_index=0, question_index=2, platform_id=platforms[0])
        await finish_business_task(conn, done, status="completed")
        old = await insert_ready_task(conn, tenant=desk, brand_index=0, question_index=3, platform_id=platforms[0])
        await finish_business_task(conn, old, status="completed")
        await conn.execute("UPDATE monitoring_collect_tasks SET completed_at = %s WHERE id = %s",
                           (datetime.now(UTC).replace(hour=0, minute=0, second=0) - timedelta(minutes=1), old))

        # legacy: 1 pending; leased: 1 offered, 1 pulled; 1 received; 2 completed today.
        brand = leg["brands"][0]
        rows: list[dict[str, Any]] = []
        for q in range(5):
            cur = await conn.execute(_LEGACY_ROW, {"t": leg["tenant_id"], "w": leg["workspace_id"],
                                                   "b": brand["brand_id"], "q": brand["question_ids"][q],
                                                   "p": platforms[0], "d": date.today(), "owner": "legacy"})
            row = await cur.fetchone()
            assert row is not None
            rows.append(row)
        offers = [{"id": uuid.uuid4(), "monitor_task_id": r["id"], "tenant_id": leg["tenant_id"],
                   "workspace_id": leg["workspace_id"], "target_client_id": client, "ai_platform_id": platforms[0],
                   "brand_id": brand["brand_id"], "question_id": brand["question_ids"][q],
                   "business_date": date.today(), "lane": "normal", "lane_weight": lane_weight("monitor", "normal"),
                   "priority": 100, "interrupt_generation": 0, "collect_request_id": None,
                   "enqueued_at": r["enqueued_at"]} for q, r in enumerate(rows[1:4], start=1)]
        async with conn.transaction():
            await legacy.offer(conn, offers, ts=datetime.now(UTC))
        for offer in offers[1:]:  # pulled
            leased = await execution_paths.LEGACY.mark_leased(conn, offer["id"], epoch=1, token_hash="h" * 64,
                                                              ttl_s=120)
            assert isinstance(await leased.result(), Leased)
        # the hub's result post: business row received, then the lease's row
        received = await execution_paths.LEGACY.mark_result_received(conn, offers[2]["id"],
                                                                     tenant_id=leg["tenant_id"], epoch=1)
        assert isinstance(received, Done)
        cur = await conn.execute("SELECT status FROM monitoring_collect_tasks WHERE id = %s",
                                 (offers[2]["monitor_task_id"],))
        assert await cur.fetchone() == {"status": "received"}
        await finish_business_task(conn, rows[4]["id"], status="completed")
        extra = await insert_ready_task(conn, tenant=leg, brand_index=0, question_index=0, platform_id=platforms[1])
        await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = 'legacy' WHERE id = %s", (extra,))
        await finish_business_task(conn, extra, status="completed")

    status = await monitorctl_json(settings, "rollout", "status")
    assert status == {
        "rollout_percentage": desk["tenant_id"] % 100 + 1, "tenants": 2,
        "paths": {
            "desktop_tasks": {"tenants": 1, "pending": 2, "in_flight": 1, "completed_today": 1},
            "legacy": {"tenants": 1, "pending": 1, "in_flight": 3, "leased": 2, "received": 1,
                       "completed_today": 2},
        },
        "active_executions": {"queued": 1, "in_progress": 0, "unknown": 0, "total": 1},
        "live_legacy_leases": {"offered": 1, "pulled": 2, "total": 3},
    }
    text = await asyncio.to_thread(_text, settings, "rollout", "status")
    assert "legacy in flight: 2 leased, 1 received" in text and "live legacy leases: 3 (1 offered, 2 pulled)" in text
