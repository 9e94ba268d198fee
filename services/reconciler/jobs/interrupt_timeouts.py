"""Job 4 — interrupt hard timeouts (docs/architecture.md §10.5 level 3).

An in_progress execution asked to yield (`control_flags.interrupt_requested`) that is still running
past its platform's `interrupt_hard_timeout_ms` (from `interrupted_at`):
- alert: `monitor_preempt_timeout_count{client_id}` and a warning log;
- its lease is force-cancelled: the execution ends `aborted` (reason `interrupt_hard_timeout`), a
  `TaskControl(lease_revoked)` tells the client to stop (its token is fenced off either way);
- the scheduled business task goes back to pending in its lane with the dispatch attempt given back
  (`yield_business_task`): the client failed to yield, the task itself did not fail, so it must not
  burn a retry; it is counted in `collect_now_preempt_induced_retry_count` since it runs again
  because of the preemption;
- the collect-now's high tasks bound to that client move to another eligible client of the same
  tenant and workspace (the least loaded), or are unbound when none is online; their executions
  still queued on the stuck client are cancelled so the coordinator re-dispatches them there.

The soft timeout (level 1: no new normal work to that client) is read by the coordinator.
"""

from __future__ import annotations

import uuid
from typing import assert_never

from libs.tasks import business, execution_paths, lease_context
from libs.tasks.outcomes import NotFound, Stale
from libs.tasks.records import EndedExecution, ExecutionEnd, OverdueInterrupt
from libs.tasks.transitions import emit_lifecycle, yield_business_task
from libs.telemetry import metrics
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, fix_each, log, send_control

NAME = "interrupt_timeouts"
DEFAULT_HARD_TIMEOUT_MS = 45_000


async def force_cancel_one(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        match await execution_paths.lock_overdue_interrupt(conn, task_id, default_hard_ms=DEFAULT_HARD_TIMEOUT_MS):
            case OverdueInterrupt() as row:
                pass
            case Stale():  # yielded, resulted, ended or locked by another writer since it was read
                return
            case unhandled_lock:
                assert_never(unhandled_lock)
        client_id = row.target_client_id
        flags = row.control_flags or {}
        request_id = flags.get("collect_request_id")
        match await execution_paths.end(conn, ExecutionEnd(
                task_id=task_id, outcome="aborted", lease_epoch=row.lease_epoch, reason="interrupt_hard_timeout",
                error="did not yield before the hard timeout", phase=row.execution_phase)):
            case EndedExecution():
                pass
            case Stale() | NotFound():  # cannot happen under the row lock; left as it is if it did
                return
            case unhandled_end:
                assert_never(unhandled_end)
        await yield_business_task(conn, row.monitor_task_id)
        await send_control(conn, task_id=task_id, client_id=client_id, control="lease_revoked",
                           reason="interrupt_hard_timeout", interrupt_generation=row.interrupt_generation,
                           tenant_id=row.tenant_id,
                           collect_request_id=uuid.UUID(request_id) if request_id else None)
        await emit_lifecycle(conn, "task.aborted", tenant_id=row.tenant_id, client_id=client_id, task_id=task_id,
                             monitor_task_id=row.monitor_task_id, ai_platform_id=row.ai_platform_id,
                             lane=row.lane, reason="interrupt_hard_timeout")
        new_client = await lease_context.other_eligible_client(
            conn, tenant_id=row.tenant_id, workspace_id=row.workspace_id, client_id=client_id,
            heartbeat_timeout_s=ctx.settings.heartbeat_timeout_seconds)
        queued_high = await execution_paths.queued_high_of_client(conn, client_id)
        for q in queued_high:
            match await execution_paths.end(conn, ExecutionEnd(task_id=q.id, outcome="aborted",
                                                               reason="interrupt_hard_timeout")):
                case EndedExecution():
                    pass
                case Stale() | NotFound():
                    continue
                case unhandled_cancel:
                    assert_never(unhandled_cancel)
            await yield_business_task(conn, q.monitor_task_id)
            await send_control(conn, task_id=q.id, client_id=client_id, control="cancelled",
                               reason="interrupt_hard_timeout", interrupt_generation=row.interrupt_generation,
                               tenant_id=row.tenant_id, collect_request_id=q.collect_request_id)
            await emit_lifecycle(conn, "task.released", tenant_id=row.tenant_id, client_id=client_id,
                                 task_id=q.id, monitor_task_id=q.monitor_task_id,
                                 ai_platform_id=q.ai_platform_id, lane=q.lane, reason="interrupt_hard_timeout",
                                 collect_request_id=q.collect_request_id)
        moved = await business.rebind_high(conn, tenant_id=row.tenant_id, client_id=client_id,
                                           new_client_id=new_client)
    metrics.monitor_preempt_timeout_count.inc(client_id=str(client_id))
    metrics.collect_now_preempt_induced_retry_count.inc()
    result.fixed += 1
    result.add("leases_revoked")
    result.add("high_moved", moved)
    result.add("queued_high_cancelled", len(queued_high))
    log.warning("interrupt passed the hard timeout; lease force-cancelled", extra={
        "task_id": str(task_id), "client_id": str(client_id), "tenant_id": row.tenant_id,
        "monitor_task_id": row.monitor_task_id, "hard_timeout_ms": row.hard_timeout_ms,
        "overdue_ms": row.overdue_ms, "collect_request_id": request_id,
        "high_moved_to": str(new_client) if new_client else None, "high_moved": moved})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    ids = await execution_paths.overdue_interrupts(ctx.conn, default_hard_ms=DEFAULT_HARD_TIMEOUT_MS,
                                                   limit=ctx.config.batch_size)
    await fix_each(ctx, result, force_cancel_one, ids, what="interrupt timeout")
    return result


JOB = configured_job(
    NAME, "interrupts past the platform's hard timeout -> lease revoked, high work moved to another client", run)
