"""The coordinator's operations of the task store (docs/architecture.md "The task store: the coordinator's
operations"), one test per module (and business.py's reconciler operations), against real Postgres: each answers
typed Structs, and the READY rule they share (libs/tasks/ready.py) leaves out a task with an active execution
wherever it is read."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.tasks import admin_ops, backlog_reads, business, consistency_reads, dispatch_reads, explain_reads
from tests.support.reconcile_factory import (
    World,
    heartbeat,
    insert_execution,
    insert_legacy_lease,
    insert_request,
    insert_task,
    make_world,
)


@dataclass(frozen=True)
class Seeded:
    """Three pending desktop_tasks-owned tasks: a ready normal one, a normal one with an active (running) execution,
    and a high one bound to the second client."""

    world: World
    ready_normal: int
    busy: int
    execution: uuid.UUID
    high: int

    @property
    def pair(self) -> tuple[int, int]:
        return (self.world.tenant_id, self.world.platform_id)


async def _seed(conn: Conn, *, questions: int = 3) -> Seeded:
    w = await make_world(conn, clients=2, questions=questions)
    for client in w.clients:
        await heartbeat(conn, client, seconds_ago=1)
    ready_normal = await insert_task(conn, w, question_index=0)
    busy = await insert_task(conn, w, question_index=1)
    execution = await insert_execution(conn, w, busy, w.clients[0])
    high = await insert_task(conn, w, question_index=2, lane="high", target_client_id=w.clients[1])
    return Seeded(w, ready_normal, busy, execution, high)


async def test_dispatch_reads_snapshot_candidates_claim_and_high_read(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        s = await _seed(conn)
        w = s.world
        now = int(time.time())
        snap = await dispatch_reads.read_pass_snapshot(conn, window_start=now - now % 60, window_seconds=60,
                                                       heartbeat_timeout_s=30)
        loads = {c.id: c for c in snap.clients}
        assert set(loads) == set(w.clients)
        assert (loads[w.clients[0]].in_progress, loads[w.clients[0]].pending_high) == (1, False)
        assert (loads[w.clients[1]].in_progress, loads[w.clients[1]].pending_high) == (0, True)
        assert dispatch_reads.PlatformActive(w.tenant_id, w.platform_id, 1) in snap.active
        assert w.platform_id in {p.ai_platform_id for p in snap.platforms}

        assert [c.id for c in await dispatch_reads.high_candidates(conn, limit=10)] == [s.high]
        normal = await dispatch_reads.pair_candidates(conn, tenants=[w.tenant_id], platforms=[w.platform_id],
                                                      lanes=["normal"], limits=[10])
        assert [c.id for c in normal] == [s.ready_normal]  # the busy one has an active execution: not READY
        assert await dispatch_reads.pending_pairs(conn) == {s.pair}

        async with conn.transaction():
            claim = await dispatch_reads.claim(conn, client_ids=[w.clients[1]],
                                               task_ids=[s.high, s.busy, s.ready_normal], normal_clients=[w.clients[1]])
            # The claim share-locks the clients it names, and only them: a writer of the other waits for nothing.
            async with pool.connection() as other, other.transaction():
                await other.execute("SET LOCAL lock_timeout = '200ms'")
                await other.execute("SELECT id FROM desktop_clients WHERE id = %s FOR UPDATE", (w.clients[0],))
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    await other.execute("SELECT id FROM desktop_clients WHERE id = %s FOR UPDATE", (w.clients[1],))
        assert set(claim.tasks) == {s.ready_normal, s.high}
        assert claim.clients_with_high == frozenset({w.clients[1]})
        high = claim.tasks[s.high]
        assert (high.dispatch_lane, high.target_client_id, high.execution_owner) == ("high", w.clients[1],
                                                                                      "desktop_tasks")
        assert isinstance(high.row_ref, str) and isinstance(high.enqueued_at, datetime)

        async with conn.transaction():
            read = await dispatch_reads.read_high_pass(conn, limit=10, window_seconds=60, heartbeat_timeout_s=30)
        assert read is not None
        assert [c.id for c in read.candidates] == [s.high] and set(read.tasks) == {s.high}
        assert read.tasks[s.high].enqueued_at == high.enqueued_at  # the timestamp, not the candidate's epoch
        assert read.locked_clients == frozenset({w.clients[1]})
        assert w.clients[1] in {c.id for c in read.snapshot.clients}
        assert read.snapshot.ts.tzinfo is not None

        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_lane = 'normal' WHERE id = %s", (s.high,))
        async with conn.transaction():
            assert await dispatch_reads.read_high_pass(conn, limit=10, window_seconds=60,
                                                       heartbeat_timeout_s=30) is None


async def test_backlog_reads_count_the_ready_backlog_exactly(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        s = await _seed(conn)
        w = s.world
        assert (await backlog_reads.high_backlog(conn)).n == 1
        exact = {(r.tenant_id, r.lane): r.n for r in await backlog_reads.backlog_exact(conn)}
        assert exact == {(w.tenant_id, "normal"): 1, (w.tenant_id, "high"): 1}
        census = await backlog_reads.census_slice(conn, after_id=0, rows=100, reference=time.time())
        assert census.lanes == {"normal": {w.tenant_id: 1}}  # high is not in the census, zeros are left out
        assert census.owners == {"desktop_tasks": 3} and sum(census.waits.values()) == 1
        assert (census.pending, census.last_id) == (3, max(s.ready_normal, s.busy, s.high))
        assert await backlog_reads.pending_by_owner(conn) == {"desktop_tasks": 3}
        assert await backlog_reads.client_queue_depths(conn) == {str(c): 0 for c in w.clients}
        paths = await backlog_reads.paths_in_flight(conn, default_rollout=100)
        assert (paths.desktop_tasks, paths.legacy) == (1, 0)

        assert await backlog_reads.ready_normal_count(conn) == 1
        aged = await backlog_reads.aging_candidates(conn, cap=10, after=(datetime(1970, 1, 1, tzinfo=UTC), 0),
                                                    share=2, batch=10)
        assert [(a.id, a.lane, a.walked) for a in aged] == [(s.ready_normal, "normal", 1)] and aged[0].wait_minutes >= 0
        assert await backlog_reads.aging_candidates(conn, cap=0, after=(datetime(1970, 1, 1, tzinfo=UTC), 0),
                                                    share=2, batch=10) == []  # at the cap
        cur = await conn.execute("SELECT ctid::text AS tid FROM monitoring_collect_tasks WHERE id = %s",
                                 (s.ready_normal,))
        assert aged[0].tid == (await cur.fetchone() or {})["tid"]


async def test_consistency_reads_share_the_coordinators_ready_rule(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        s = await _seed(conn, questions=7)
        w = s.world
        await conn.execute("UPDATE monitoring_collect_tasks SET enqueued_at = now() - interval '1 hour'")
        # The two READY tasks waited an hour; the one with an active execution is not READY, on either reading.
        assert await consistency_reads.stalled_ready_count(conn, stall_s=60) == 2
        assert await consistency_reads.stalled_ready_count(conn, stall_s=7200) == 0
        assert await backlog_reads.ready_normal_count(conn) + (await backlog_reads.high_backlog(conn)).n == 2

        assert await consistency_reads.in_flight_by_path(conn) == consistency_reads.PathsInFlight(1, 0)
        assert await consistency_reads.path_mismatches(conn) == []
        wrong = await insert_task(conn, w, question_index=3, execution_owner="legacy")
        await insert_execution(conn, w, wrong, w.clients[1])
        assert [(m.id, m.problem) for m in await consistency_reads.path_mismatches(conn)] == [
            (wrong, "active execution on a legacy-owned task")]

        orphan = await insert_task(conn, w, question_index=4, status="completed")
        problems = {m.id: m.problem for m in await consistency_reads.orphans(conn, lookback_days=7)}
        assert problems == {orphan: "executed without an execution record",
                            wrong: "active execution on a legacy-owned task"}

        zombie = await insert_task(conn, w, question_index=5, execution_owner="legacy", legacy_lease_expires_in=-10)
        await conn.execute("UPDATE monitoring_collect_tasks SET status = 'leased' WHERE id = %s", (zombie,))
        async with conn.transaction():
            cleared = await consistency_reads.clear_zombie_leases(conn)
        assert [(z.id, z.execution_owner) for z in cleared] == [(zombie, "legacy")]

        lost_task = await insert_task(conn, w, question_index=6, execution_owner="legacy")
        lease = await insert_legacy_lease(conn, w, lost_task, w.clients[0], result_received_ago=600)
        async with conn.transaction():
            lost = await consistency_reads.legacy_results_lost(conn, grace_s=60, limit=10)
        assert [(r.id, r.monitor_task_id, r.lease_epoch) for r in lost] == [(lease, lost_task, 1)]


async def test_explain_reads_one_task_and_where_it_stands(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        s = await _seed(conn, questions=4)
        w = s.world
        task = await explain_reads.task(conn, s.ready_normal)
        assert task is not None and (task.lane, task.status, task.not_due) == ("normal", "pending", False)
        assert await explain_reads.task(conn, 2**62) is None
        assert await explain_reads.task_of_execution(conn, s.execution) == s.busy
        assert await explain_reads.task_of_execution(conn, uuid.uuid4()) is None
        active = await explain_reads.active_execution(conn, s.busy)
        assert active is not None and (active.id, active.status) == (s.execution, "in_progress")
        assert await explain_reads.active_execution(conn, s.ready_normal) is None
        position = await explain_reads.lane_position(conn, task, higher_lanes=["high"])
        assert position == explain_reads.LanePosition(ahead_in_lane=0, ahead_in_lane_same_tenant=0,
                                                      in_higher_lanes=1, tenants_in_lane=1)
        assert await explain_reads.tenant_ready_backlog(conn, w.tenant_id) == {"normal": 1, "high": 1}
        assert await explain_reads.high_ready_count(conn) == 1
        assert await explain_reads.normal_has_work(conn)

        held = await insert_task(conn, w, question_index=3, execution_owner="legacy")
        lease = await insert_legacy_lease(conn, w, held, w.clients[0])
        found = await explain_reads.legacy_lease(conn, held)
        assert found is not None and (found.id, found.status) == (lease, "in_progress")


async def test_admin_ops_status_rollout_and_rollback_reads(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        s = await _seed(conn, questions=4)
        w = s.world
        assert {r.lane: r.ready for r in await admin_ops.lane_backlog(conn)} == {"normal": 1, "high": 1}
        assert await admin_ops.active_executions_by_status(conn) == {"in_progress": 1}
        assert await admin_ops.active_execution_count(conn) == 1
        clients = await admin_ops.client_counts(conn, heartbeat_timeout_s=30)
        assert clients.eligible == clients.online >= 2 and clients.registered >= clients.online

        held = await insert_task(conn, w, question_index=3, execution_owner="legacy")
        await insert_legacy_lease(conn, w, held, w.clients[0], status="queued")
        paths = await admin_ops.path_tasks(conn)
        assert (paths.pending_rows, paths.pending_with_execution) == ({"desktop_tasks": 3}, {"desktop_tasks": 1})
        assert (paths.leased, paths.received, paths.live_leases) == ({"legacy": 1}, {"legacy": 0}, {"queued": 1})
        assert await admin_ops.rollback_preview(conn) == admin_ops.RollbackPreview(1, 3, 2)

        active = await admin_ops.active_monitor_executions(conn)
        assert [(a.id, a.monitor_task_id, a.target_client_id) for a in active] == [(s.execution, s.busy,
                                                                                   w.clients[0])]
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_attempts = 1 WHERE id = %s", (s.busy,))
        await admin_ops.give_back_dispatch_attempts(conn, [s.busy, s.busy])
        cur = await conn.execute("SELECT dispatch_attempts FROM monitoring_collect_tasks WHERE id = %s", (s.busy,))
        assert (await cur.fetchone() or {})["dispatch_attempts"] == 0

        since = datetime.now(UTC) - timedelta(hours=1)
        assert await admin_ops.preemption_outcomes(conn, since=since) == admin_ops.PreemptionOutcomes(0, 0)
        await conn.execute("UPDATE desktop_tasks SET interrupted_at = now(), "
                           "interrupt_reason = 'interrupt_hard_timeout' WHERE id = %s", (s.execution,))
        assert await admin_ops.preemption_outcomes(conn, since=since) == admin_ops.PreemptionOutcomes(0, 1)


async def test_business_operations_of_the_reconciler_move_high_work_and_expire(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        s = await _seed(conn, questions=5)
        w = s.world
        assert await business.rebind_high(conn, tenant_id=w.tenant_id, client_id=w.clients[1],
                                          new_client_id=w.clients[0]) == 1
        assert await business.rebind_high(conn, tenant_id=w.tenant_id, client_id=w.clients[1],
                                          new_client_id=w.clients[0]) == 0
        await heartbeat(conn, w.clients[0], seconds_ago=120)
        assert await business.unbind_high_of_stale_clients(conn, heartbeat_timeout_s=30) == [
            business.Unbound(s.high, w.tenant_id, w.clients[0], None)]

        request = await insert_request(conn, w, client_id=w.clients[1])
        clicked = await insert_task(conn, w, question_index=3, lane="high", target_client_id=w.clients[1],
                                    collect_request_id=request)
        assert await business.demote_timed_out(conn, request_id=request, tenant_id=w.tenant_id,
                                               normal_priority=100) == 1
        cur = await conn.execute("SELECT dispatch_lane, target_client_id FROM monitoring_collect_tasks WHERE id = %s",
                                 (clicked,))
        assert await cur.fetchone() == {"dispatch_lane": "normal", "target_client_id": None}

        assert await business.expire(conn, s.ready_normal)
        assert not await business.expire(conn, s.ready_normal)  # no longer pending
