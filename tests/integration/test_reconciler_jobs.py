"""Each reconcile job against real Postgres, from rows inserted in the states it must repair."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn, connect
from libs.dispatch_settings import set_setting
from libs.telemetry import metrics
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS, JobResult
from services.reconciler.runner import run_job
from tests.support.reconcile_factory import (
    attempt,
    business,
    execution,
    heartbeat,
    insert_execution,
    insert_legacy_lease,
    insert_moded_task,
    insert_request,
    insert_run,
    insert_task,
    make_world,
    outbox_messages,
    row,
    yesterday,
)

CONFIG = ReconcilerConfig()


async def reconcile(conn: Conn, name: str) -> JobResult:
    return await run_job(JOBS[name], conn, CONFIG)


async def test_expired_leases_retry_then_fail_and_count_preemption(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        a, b = w.clients
        normal = await insert_task(conn, w, question_index=0, dispatch_attempts=1, last_dispatched=True)
        normal_exec = await insert_execution(conn, w, normal, a, lease_expires_in=-5, interrupted_ago=20)
        request = await insert_request(conn, w, client_id=a, status="running", requested=1, dispatched=1)
        high = await insert_task(conn, w, question_index=1, lane="high", dispatch_attempts=3, target_client_id=a,
                                 collect_request_id=request, last_dispatched=True)
        high_exec = await insert_execution(conn, w, high, a, lane="high", lease_expires_in=-1,
                                           collect_request_id=request)
        alive = await insert_task(conn, w, question_index=2, dispatch_attempts=1)
        alive_exec = await insert_execution(conn, w, alive, b, lease_expires_in=60)
        preempt_before = metrics.collect_now_preempt_induced_retry_count.value()
        fixed_before = metrics.reconciler_job_rows_fixed_count.value(reconcile_job="expired_leases")
        phase2_before = metrics.phase2_reconcile_fixed_count.value(check="expired_leases")

        result = await reconcile(conn, "expired_leases")

        assert result.fixed == 2
        assert (await execution(conn, normal_exec))["status"] == "aborted"
        assert (await attempt(conn, normal_exec))["status"] == "expired"
        t = await business(conn, normal)
        assert (t["status"], t["dispatch_lane"], t["dispatch_priority"], t["dispatch_attempts"]) == (
            "pending", "retry", 50, 1)
        # At max attempts the business task fails; the request's only task failed -> request failed.
        assert (await business(conn, high))["status"] == "failed"
        req = await row(conn, "SELECT status, failed_task_count FROM monitoring_collect_requests WHERE id = %s",
                        request)
        assert req == {"status": "failed", "failed_task_count": 1}
        assert (await execution(conn, alive_exec))["status"] == "in_progress"
        assert metrics.collect_now_preempt_induced_retry_count.value() == preempt_before + 1
        assert metrics.reconciler_job_rows_fixed_count.value(reconcile_job="expired_leases") == fixed_before + 2
        # Routine repairs are not §16.2.4 inconsistencies: they stay out of the §15.2 alert's counter.
        assert metrics.phase2_reconcile_fixed_count.value(check="expired_leases") == phase2_before

        aborted = await outbox_messages(conn, "task.aborted")
        assert {m["task_id"] for m in aborted} == {str(normal_exec), str(high_exec)}
        assert all(m["reason"] == "lease_expired" for m in aborted)
        revoked = await outbox_messages(conn, f"monitor.control.{a}")
        assert {(m["task_id"], m["control"]) for m in revoked} == {(str(normal_exec), "lease_revoked"),
                                                                   (str(high_exec), "lease_revoked")}
        assert (await reconcile(conn, "expired_leases")).fixed == 0


async def test_expired_lease_with_result_received_is_left_to_ingest(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        task = await insert_task(conn, w, dispatch_attempts=1)
        exec_id = await insert_execution(conn, w, task, w.clients[0], lease_expires_in=-5, result_received_ago=2)
        assert (await reconcile(conn, "expired_leases")).fixed == 0
        assert (await execution(conn, exec_id))["status"] == "in_progress"


async def test_request_ttl_times_out_stalled_requests_and_warns_once(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        a = w.clients[0]
        expired = await insert_request(conn, w, client_id=a, status="accepted", ttl_in=-1, created_ago=301)
        bound = await insert_task(conn, w, question_index=0, lane="high", target_client_id=a,
                                  collect_request_id=expired)
        running_busy = await insert_request(conn, w, client_id=a, status="running", ttl_in=-1, dispatched=1)
        busy_task = await insert_task(conn, w, question_index=1, lane="high", collect_request_id=running_busy)
        await insert_execution(conn, w, busy_task, a, lane="high", collect_request_id=running_busy)
        running_stalled = await insert_request(conn, w, client_id=a, status="running", ttl_in=-1, dispatched=1)
        await insert_task(conn, w, question_index=2, lane="high", collect_request_id=running_stalled)
        quiet = await insert_request(conn, w, client_id=a, status="accepted", ttl_in=200, created_ago=45)
        fresh = await insert_request(conn, w, client_id=a, status="accepted", ttl_in=290, created_ago=5)
        ttl_before = metrics.collect_request_ttl_expired_count.value()
        warn_before = metrics.collect_request_no_dispatch_warning_count.value()

        result = await reconcile(conn, "request_ttl")

        async def status(request_id: uuid.UUID) -> str:
            return str((await row(conn, "SELECT status FROM monitoring_collect_requests WHERE id = %s",
                                  request_id))["status"])

        assert await status(expired) == "timed_out"
        assert await status(running_stalled) == "timed_out"
        assert await status(running_busy) == "running"
        assert await status(quiet) == "accepted" and await status(fresh) == "accepted"
        assert result.fixed == 2 and result.details["no_dispatch_warned"] == 1
        assert metrics.collect_request_ttl_expired_count.value() == ttl_before + 2
        assert metrics.collect_request_no_dispatch_warning_count.value() == warn_before + 1
        t = await business(conn, bound)
        assert (t["status"], t["dispatch_lane"], t["target_client_id"]) == ("pending", "normal", None)
        warned = await row(conn, "SELECT no_dispatch_warned_at FROM monitoring_collect_requests WHERE id = %s", quiet)
        assert warned["no_dispatch_warned_at"] is not None

        again = await reconcile(conn, "request_ttl")
        assert again.fixed == 0 and again.details["no_dispatch_warned"] == 0


async def test_offline_clients_unbind_high_and_release_queued(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, clients=2)
        gone, alive = w.clients
        await heartbeat(conn, gone, seconds_ago=45)
        await heartbeat(conn, alive, seconds_ago=1)
        high = await insert_task(conn, w, question_index=0, lane="high", target_client_id=gone)
        high_alive = await insert_task(conn, w, question_index=1, lane="high", target_client_id=alive)
        queued = await insert_task(conn, w, question_index=2, dispatch_attempts=1, last_dispatched=True)
        queued_exec = await insert_execution(conn, w, queued, gone, status="queued")
        running = await insert_task(conn, w, question_index=0, platform=None, dispatch_attempts=1,
                                    business_date=yesterday())
        running_exec = await insert_execution(conn, w, running, gone)

        result = await reconcile(conn, "offline_clients")

        assert result.details["clients_offline"] == 1 and result.details["high_unbound"] == 1
        assert result.details["queued_released"] == 1
        clients = {r["id"]: r for r in await (await conn.execute(
            "SELECT id, online, offline_since FROM desktop_clients WHERE tenant_id = %s", (w.tenant_id,))).fetchall()}
        assert clients[gone]["online"] is False and clients[gone]["offline_since"] is not None
        assert clients[alive]["online"] is True
        t = await business(conn, high)
        assert (t["target_client_id"], t["dispatch_lane"], t["status"]) == (None, "high", "pending")
        assert (await business(conn, high_alive))["target_client_id"] == alive
        assert (await execution(conn, queued_exec))["status"] == "aborted"
        assert (await business(conn, queued))["dispatch_attempts"] == 0  # it never ran: attempt given back
        assert (await execution(conn, running_exec))["status"] == "in_progress"  # its lease decides
        offline = await outbox_messages(conn, "client.offline")
        assert [m["client_id"] for m in offline] == [str(gone)]
        released = await outbox_messages(conn, "task.released")
        assert [m["task_id"] for m in released] == [str(queued_exec)]

        again = await reconcile(conn, "offline_clients")
        assert again.fixed == 0 and again.details.get("queued_released", 0) == 0


async def test_interrupt_hard_timeout_revokes_lease_and_moves_high_work(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, clients=2)
        stuck, other = w.clients
        await heartbeat(conn, stuck, seconds_ago=1)
        await heartbeat(conn, other, seconds_ago=1)
        await conn.execute("UPDATE platform_settings SET interrupt_soft_timeout_ms = 500, "
                           "interrupt_hard_timeout_ms = 1000 WHERE ai_platform_id = %s", (w.platform_id,))
        request = await insert_request(conn, w, client_id=stuck, status="dispatching", requested=2, dispatched=1)
        scheduled = await insert_task(conn, w, question_index=0, dispatch_attempts=1, last_dispatched=True)
        scheduled_exec = await insert_execution(conn, w, scheduled, stuck, interrupted_ago=5, interrupt_generation=3,
                                                collect_request_id=request)
        recent = await insert_task(conn, w, question_index=0, platform=None, business_date=yesterday(),
                                   dispatch_attempts=1)
        recent_exec = await insert_execution(conn, w, recent, stuck, interrupted_ago=0.2, interrupt_generation=3)
        high_queued = await insert_task(conn, w, question_index=1, lane="high", target_client_id=stuck,
                                        collect_request_id=request, dispatch_attempts=1, last_dispatched=True)
        high_queued_exec = await insert_execution(conn, w, high_queued, stuck, status="queued", lane="high",
                                                  collect_request_id=request)
        high_pending = await insert_task(conn, w, question_index=2, lane="high", target_client_id=stuck,
                                         collect_request_id=request)
        timeouts_before = metrics.monitor_preempt_timeout_count.value(client_id=str(stuck))

        result = await reconcile(conn, "interrupt_timeouts")

        assert result.fixed == 1
        ended = await execution(conn, scheduled_exec)
        assert (ended["status"], ended["interrupt_reason"]) == ("aborted", "interrupt_hard_timeout")
        assert (await attempt(conn, scheduled_exec))["status"] == "aborted"
        t = await business(conn, scheduled)
        # Not the task's fault: back to pending in its own lane, the attempt given back.
        assert (t["status"], t["dispatch_lane"], t["dispatch_attempts"]) == ("pending", "normal", 0)
        assert (await execution(conn, recent_exec))["status"] == "in_progress"
        assert (await execution(conn, high_queued_exec))["status"] == "aborted"
        for task in (high_queued, high_pending):
            moved = await business(conn, task)
            assert (moved["target_client_id"], moved["dispatch_lane"]) == (other, "high")
        assert metrics.monitor_preempt_timeout_count.value(client_id=str(stuck)) == timeouts_before + 1
        controls = await outbox_messages(conn, f"monitor.control.{stuck}")
        assert {(m["task_id"], m["control"]) for m in controls} == {
            (str(scheduled_exec), "lease_revoked"), (str(high_queued_exec), "cancelled")}
        assert all(m["interrupt_generation"] == 3 for m in controls)
        assert (await reconcile(conn, "interrupt_timeouts")).fixed == 0


async def test_interrupt_hard_timeout_unbinds_when_no_other_client(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, clients=1)
        stuck = w.clients[0]
        await heartbeat(conn, stuck, seconds_ago=1)
        await conn.execute("UPDATE platform_settings SET interrupt_soft_timeout_ms = 100, "
                           "interrupt_hard_timeout_ms = 100 WHERE ai_platform_id = %s", (w.platform_id,))
        scheduled = await insert_task(conn, w, question_index=0, dispatch_attempts=1)
        await insert_execution(conn, w, scheduled, stuck, interrupted_ago=1)
        high = await insert_task(conn, w, question_index=1, lane="high", target_client_id=stuck)
        assert (await reconcile(conn, "interrupt_timeouts")).fixed == 1
        assert (await business(conn, high))["target_client_id"] is None


async def test_unknown_executions_converge_from_evidence(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=5)
        a = w.clients[0]
        await set_setting(conn, "unknown_grace_seconds", 60)
        ok = await insert_task(conn, w, question_index=0, dispatch_attempts=1)
        ok_exec = await insert_execution(conn, w, ok, a, result_received_ago=90)
        await insert_run(conn, ok, status="succeeded", desktop_task_id=ok_exec)
        bad = await insert_task(conn, w, question_index=1, dispatch_attempts=1)
        bad_exec = await insert_execution(conn, w, bad, a, status="unknown", result_received_ago=200)
        await insert_run(conn, bad, status="failed", desktop_task_id=bad_exec)
        lost = await insert_task(conn, w, question_index=2, dispatch_attempts=1)
        lost_exec = await insert_execution(conn, w, lost, a, status="unknown", lease_expires_in=-10,
                                           result_received_ago=200)
        held = await insert_task(conn, w, question_index=3, dispatch_attempts=1)
        held_exec = await insert_execution(conn, w, held, a, status="unknown", lease_expires_in=30, lease_epoch=4,
                                           result_received_ago=200)
        young = await insert_task(conn, w, question_index=4, dispatch_attempts=1)
        young_exec = await insert_execution(conn, w, young, a, result_received_ago=5)

        result = await reconcile(conn, "unknown_executions")

        assert result.details["marked_unknown"] == 1 and result.fixed == 4
        assert (await execution(conn, ok_exec))["status"] == "succeeded"
        assert (await business(conn, ok))["status"] == "completed"
        assert (await execution(conn, bad_exec))["status"] == "failed"
        assert (await business(conn, bad))["dispatch_lane"] == "retry"
        assert (await execution(conn, lost_exec))["status"] == "aborted"
        assert (await attempt(conn, lost_exec))["status"] == "expired"
        lost_task = await business(conn, lost)
        assert (lost_task["status"], lost_task["dispatch_lane"]) == ("pending", "retry")
        requeued = await execution(conn, held_exec)
        assert (requeued["status"], requeued["lease_token_hash"], requeued["result_received_at"]) == (
            "queued", None, None)
        assert requeued["lease_epoch"] == 4  # the next lease gets epoch 5: the old token is fenced off
        assert (await attempt(conn, held_exec))["status"] == "aborted"
        assert (await execution(conn, young_exec))["status"] == "in_progress"
        active = await row(conn, "SELECT count(*) AS n FROM desktop_tasks WHERE monitor_task_id = %s "
                                 "AND status IN ('queued', 'in_progress', 'unknown')", held)
        assert active["n"] == 1
        assert (await reconcile(conn, "unknown_executions")).fixed == 0


async def test_business_day_expiry_in_tenant_time_zone(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=3)
        far_west = await make_world(conn, questions=1, time_zone="Pacific/Pago_Pago")  # UTC-11
        a = w.clients[0]
        old = await insert_task(conn, w, question_index=0, business_date=yesterday(), dispatch_attempts=1)
        old_exec = await insert_execution(conn, w, old, a)
        today_task = await insert_task(conn, w, question_index=1)
        done = await insert_task(conn, w, question_index=2, business_date=yesterday(), status="completed")
        west = await insert_task(conn, far_west, question_index=0, business_date=yesterday())

        result = await reconcile(conn, "business_day_expiry")

        t = await business(conn, old)
        assert (t["status"], t["completed_at"] is not None) == ("expired", True)
        assert (await execution(conn, old_exec))["status"] == "aborted"
        assert (await business(conn, today_task))["status"] == "pending"
        assert (await business(conn, done))["status"] == "completed"
        west_over = yesterday() < datetime.now(UTC).astimezone(ZoneInfo("Pacific/Pago_Pago")).date()
        assert (await business(conn, west))["status"] == ("expired" if west_over else "pending")
        assert result.fixed == (2 if west_over else 1)
        controls = await outbox_messages(conn, f"monitor.control.{a}")
        assert [(m["task_id"], m["control"]) for m in controls] == [(str(old_exec), "cancelled")]


async def test_migration_reconcile_zombies_stalled_and_orphans(pool: AsyncConnectionPool[Conn],
                                                               database_url: str) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=5)
        await set_setting(conn, "reconcile_interval_seconds", 0)
        zombie = await insert_task(conn, w, question_index=0, execution_owner="legacy", legacy_lease_expires_in=-10)
        await conn.execute("UPDATE monitoring_collect_tasks SET status = 'leased' WHERE id = %s", (zombie,))
        live = await insert_task(conn, w, question_index=1, execution_owner="legacy")
        await insert_legacy_lease(conn, w, live, w.clients[0], lease_expires_in=60)
        crossed = await insert_task(conn, w, question_index=2, legacy_lease_expires_in=60)
        orphan = await insert_task(conn, w, question_index=3, status="completed")
        stalled = await insert_task(conn, w, question_index=4)
        listener = await connect(database_url)
        try:
            await listener.execute("LISTEN dispatch_wakeup")
            phase2_before = metrics.phase2_reconcile_fixed_count.value(check="migration_reconcile")
            result = await reconcile(conn, "migration_reconcile")
            notes = [n async for n in listener.notifies(timeout=5.0, stop_after=1)]
        finally:
            await listener.close()

        assert result.details["zombie_leases_cleared"] == 2 and result.fixed == 2
        assert metrics.phase2_reconcile_fixed_count.value(check="migration_reconcile") == phase2_before + 2
        z = await business(conn, zombie)
        assert (z["status"], z["leased_to_executor"], z["lease_expires_at"]) == ("pending", None, None)
        assert (await business(conn, live))["status"] == "leased"
        assert (await business(conn, crossed))["leased_to_executor"] is None
        assert result.details["orphans"] == 1 and REGISTRY.get_sample_value("reconciler_migration_orphan_tasks") == 1
        assert result.details["stalled_ready"] >= 1 and (await business(conn, stalled))["status"] == "pending"
        assert [n.channel for n in notes] == ["dispatch_wakeup"]
        assert (await business(conn, orphan))["status"] == "completed"  # alerted, never changed


async def test_monitorctl_reconcile_once(pool: AsyncConnectionPool[Conn], database_url: str) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        task = await insert_task(conn, w, dispatch_attempts=1)
        exec_id = await insert_execution(conn, w, task, w.clients[0], lease_expires_in=-1)
    env = {**os.environ, "DATABASE_URL": database_url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tools.monitorctl", "--json", "reconcile", "--once", "--job", "expired_leases",
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert json.loads(out) == [{"job": "expired_leases", "fixed": 1, "details": {"business_retried": 1}}]
    async with pool.connection() as conn:
        assert (await execution(conn, exec_id))["status"] == "aborted"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tools.monitorctl", "reconcile",
                                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"--once" in err


async def test_the_hard_timeout_of_an_interrupted_execution_is_its_modes(pool: AsyncConnectionPool[Conn]) -> None:
    """§10.5 per-mode values: OpenAI deep reasoning (hard 180 s) is not force-cancelled at the quick mode's or the
    platform's 45 s; the quick one is."""
    async with pool.connection() as conn:
        w = await make_world(conn, clients=1)
        stuck = w.clients[0]
        await heartbeat(conn, stuck, seconds_ago=1)
        tasks = {}
        for index, mode in enumerate(("deep_reasoning", "quick")):
            task = await insert_moded_task(conn, w, question_index=index, mode=mode)
            tasks[mode] = await insert_execution(conn, w, task, stuck, interrupted_ago=50)
        assert (await reconcile(conn, "interrupt_timeouts")).fixed == 1
        assert (await execution(conn, tasks["deep_reasoning"]))["status"] == "in_progress"  # 50 s of its 180 s
        ended = await execution(conn, tasks["quick"])
        assert (ended["status"], ended["interrupt_reason"]) == ("aborted", "interrupt_hard_timeout")
