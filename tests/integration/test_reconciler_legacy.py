"""The reconcile jobs on the legacy path (docs/legacy-path.md), against real Postgres: expired leases, offers to
offline clients, business-day expiry of a leased row, results never applied, zombie lease columns and owner/execution
mismatches."""

from __future__ import annotations

from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import set_setting
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS, JobResult
from services.reconciler.runner import run_job
from tests.support.reconcile_factory import (
    business,
    heartbeat,
    insert_execution,
    insert_legacy_lease,
    insert_request,
    insert_task,
    legacy_lease,
    make_world,
    outbox_messages,
    yesterday,
)

CONFIG = ReconcilerConfig()
LEASE_CLEARED = {"leased_to_executor": None, "lease_token_hash": None, "lease_expires_at": None}


async def reconcile(conn: Conn, name: str) -> JobResult:
    return await run_job(JOBS[name], conn, CONFIG)


def cleared(task: dict[str, object]) -> bool:
    return all(task[k] is None for k in LEASE_CLEARED) and task["legacy_lease_id"] is None


async def test_an_expired_legacy_lease_is_ended_and_its_task_retried(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        a, b = w.clients
        expired = await insert_task(conn, w, question_index=0, execution_owner="legacy", dispatch_attempts=1)
        expired_lease = await insert_legacy_lease(conn, w, expired, a, lease_expires_in=-5)
        alive = await insert_task(conn, w, question_index=1, execution_owner="legacy", dispatch_attempts=1)
        alive_lease = await insert_legacy_lease(conn, w, alive, b, lease_expires_in=60)

        result = await reconcile(conn, "expired_leases")

        assert result.fixed == 1
        assert (await legacy_lease(conn, expired_lease))["status"] == "expired"
        t = await business(conn, expired)
        assert (t["status"], t["dispatch_lane"], t["dispatch_attempts"]) == ("pending", "retry", 1) and cleared(t)
        revoked = [m for m in await outbox_messages(conn, "monitor.control") if m["task_id"] == str(expired_lease)]
        assert [m["control"] for m in revoked] == ["lease_revoked"]
        assert (await legacy_lease(conn, alive_lease))["status"] == "in_progress"
        assert (await business(conn, alive))["status"] == "leased"


async def test_offers_to_an_offline_client_are_withdrawn(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        gone, here = w.clients
        await heartbeat(conn, gone, seconds_ago=600)
        await heartbeat(conn, here, seconds_ago=0)
        offered = await insert_task(conn, w, question_index=0, execution_owner="legacy", dispatch_attempts=1)
        offer = await insert_legacy_lease(conn, w, offered, gone, status="queued")
        kept = await insert_task(conn, w, question_index=1, execution_owner="legacy", dispatch_attempts=1)
        kept_offer = await insert_legacy_lease(conn, w, kept, here, status="queued")

        result = await reconcile(conn, "offline_clients")

        assert result.details["queued_released"] == 1
        lease = await legacy_lease(conn, offer)
        assert (lease["status"], lease["interrupt_reason"]) == ("aborted", "client_offline")
        t = await business(conn, offered)
        assert (t["status"], t["dispatch_attempts"]) == ("pending", 0) and cleared(t)
        assert (await legacy_lease(conn, kept_offer))["status"] == "queued"


async def test_a_leased_row_of_a_past_business_day_expires(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        task = await insert_task(conn, w, execution_owner="legacy", business_date=yesterday())
        lease_id = await insert_legacy_lease(conn, w, task, w.clients[0])

        result = await reconcile(conn, "business_day_expiry")

        assert result.details["tasks_expired"] == 1
        t = await business(conn, task)
        assert t["status"] == "expired" and cleared(t)
        assert (await legacy_lease(conn, lease_id))["status"] == "aborted"
        cancels = await outbox_messages(conn, "monitor.control")
        assert [(c["task_id"], c["control"]) for c in cancels] == [(str(lease_id), "cancelled")]


async def test_the_consistency_reconcile_on_the_legacy_path(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=5)
        a = w.clients[0]
        await set_setting(conn, "unknown_grace_seconds", 60)
        # A result accepted two minutes ago and never applied (dead-lettered): the lease ends, the task is retried.
        lost = await insert_task(conn, w, question_index=0, execution_owner="legacy", dispatch_attempts=1)
        lost_lease = await insert_legacy_lease(conn, w, lost, a, result_received_ago=120)
        # A row left `leased` by a lease that already ended: a zombie.
        zombie = await insert_task(conn, w, question_index=1, execution_owner="legacy")
        zombie_lease = await insert_legacy_lease(conn, w, zombie, a)
        await conn.execute("UPDATE legacy_leases SET status = 'aborted' WHERE id = %s", (zombie_lease,))
        # Mismatches for a human: a live lease on a desktop_tasks-owned task, an execution on a legacy-owned one.
        crossed = await insert_task(conn, w, question_index=2, execution_owner="legacy")
        await insert_legacy_lease(conn, w, crossed, a)
        await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = 'desktop_tasks', status = 'pending'"
                           " WHERE id = %s", (crossed,))
        wrong_path = await insert_task(conn, w, question_index=3, execution_owner="legacy")
        await insert_execution(conn, w, wrong_path, a, lease_expires_in=60)

        result = await reconcile(conn, "migration_reconcile")

        assert result.details["legacy_results_lost"] == 1
        assert (await legacy_lease(conn, lost_lease))["status"] == "expired"
        t = await business(conn, lost)
        assert (t["status"], t["dispatch_lane"]) == ("pending", "retry") and cleared(t)
        z = await business(conn, zombie)
        assert z["status"] == "pending" and cleared(z)
        # The crossed task's lease columns are cleared (desktop_tasks-owned), and both mismatches are alerted.
        assert result.details["orphans"] == 2 and REGISTRY.get_sample_value("reconciler_migration_orphan_tasks") == 2
        assert (await business(conn, wrong_path))["status"] == "pending"  # alerted, never changed


async def test_an_unexpired_lease_is_never_touched_by_the_consistency_reconcile(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        task = await insert_task(conn, w, execution_owner="legacy")
        offer = await insert_legacy_lease(conn, w, task, w.clients[0], status="queued")
        pulled_task = await insert_task(conn, w, question_index=1, execution_owner="legacy")
        pulled = await insert_legacy_lease(conn, w, pulled_task, w.clients[0], result_received_ago=5)

        result = await reconcile(conn, "migration_reconcile")

        assert result.details["zombie_leases_cleared"] == 0 and result.details.get("legacy_results_lost", 0) == 0
        assert (await legacy_lease(conn, offer))["status"] == "queued"
        assert (await business(conn, task))["legacy_lease_id"] == offer
        assert (await legacy_lease(conn, pulled))["status"] == "in_progress"
        assert (await business(conn, pulled_task))["status"] == "received"





async def test_the_coordinators_start_up_check_counts_both_paths_and_finds_mismatches(
        pool: AsyncConnectionPool[Conn]) -> None:
    from services.dispatch_coordinator.coordinator import check_execution_paths

    async with pool.connection() as conn:
        w = await make_world(conn, questions=3)
        a = w.clients[0]
        fine = await insert_task(conn, w, question_index=0, execution_owner="legacy")
        await insert_legacy_lease(conn, w, fine, a)
        on_desktop = await insert_task(conn, w, question_index=1)
        await insert_execution(conn, w, on_desktop, a, lease_expires_in=60)
        wrong = await insert_task(conn, w, question_index=2, execution_owner="legacy")
        await insert_execution(conn, w, wrong, a, lease_expires_in=60)

        found = await check_execution_paths(conn)

    assert (found.in_flight.desktop_tasks, found.in_flight.legacy) == (2, 1)
    assert [(m.id, m.problem) for m in found.mismatches] == [
        (wrong, "active execution on a legacy-owned task")]


async def test_a_running_request_with_a_live_legacy_lease_does_not_time_out(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        a = w.clients[0]
        busy = await insert_request(conn, w, client_id=a, status="running", ttl_in=-1, dispatched=1)
        task = await insert_task(conn, w, lane="high", execution_owner="legacy", collect_request_id=busy)
        await insert_legacy_lease(conn, w, task, a, lane="high")
        stalled = await insert_request(conn, w, client_id=a, status="running", ttl_in=-1, dispatched=1)
        await insert_task(conn, w, question_index=1, lane="high", execution_owner="legacy", collect_request_id=stalled)

        await reconcile(conn, "request_ttl")

        cur = await conn.execute("SELECT id, status FROM monitoring_collect_requests")
        statuses = {r["id"]: r["status"] for r in await cur.fetchall()}
        assert statuses == {busy: "running", stalled: "timed_out"}
