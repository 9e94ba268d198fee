"""Job 5 — unknown executions (docs/architecture.md §8.2, contract #9).

1. An in_progress execution whose result the hub accepted (`result_received_at`) but ingest has not
   applied after `unknown_grace_seconds` becomes `unknown` (still active: it blocks a second one).
2. Every `unknown` execution converges from the evidence (rules.converge_unknown):
   a run row written for this lease -> succeeded / failed (business completed / retried);
   no evidence and the lease expired -> aborted, business task retried (the attempt is consumed);
   no evidence, lease still held -> back to `queued` on the same row (the attempt is closed, a new
   lease gets a new epoch, so the old token is fenced off).
   A late result is still applied by ingest (ending the execution answers Stale then; the business task is
   completed by the success-priority rule), so converging early never loses data.
"""

from __future__ import annotations

import uuid
from typing import assert_never

from libs.tasks import execution_paths, lease_context
from libs.tasks.outcomes import NotFound, Stale
from libs.tasks.records import Done, EndedExecution, ExecutionEnd, UnknownExecution
from libs.tasks.requests import refresh_progress
from libs.tasks.transitions import emit_lifecycle, finish_business_task, retry_business_task
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, fix_each, log
from services.reconciler.rules import UnknownEvidence, converge_unknown

NAME = "unknown_executions"


async def _end(ctx: JobContext, request: ExecutionEnd) -> bool:
    """The unknown execution ended; False: it is not live any more (cannot happen under its row lock)."""
    match await execution_paths.end(ctx.conn, request):
        case EndedExecution():
            return True
        case Stale() | NotFound():
            log.warning("an unknown execution under its row lock was not live", extra={"task_id": str(request.task_id)})
            return False
        case unhandled:
            assert_never(unhandled)


async def converge_one(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        match await execution_paths.lock_unknown(conn, task_id):
            case UnknownExecution() as row:
                pass
            case Stale():  # converged, applied or locked by another writer since it was read
                return
            case unhandled_lock:
                assert_never(unhandled_lock)
        statuses = await lease_context.run_evidence(conn, monitor_task_id=row.monitor_task_id, task_id=task_id,
                                                    leased_at=row.leased_at)
        run_status = "succeeded" if "succeeded" in statuses else ("failed" if "failed" in statuses else None)
        verdict = converge_unknown(UnknownEvidence(run_status=run_status, lease_alive=row.lease_alive))
        monitor_task_id = row.monitor_task_id
        business: str | None = None
        if verdict == "queued":
            match await execution_paths.requeue_unknown(conn, task_id, lease_epoch=row.lease_epoch):
                case Done():
                    pass
                case Stale():  # cannot happen under the row lock
                    return
                case unhandled_requeue:
                    assert_never(unhandled_requeue)
        elif verdict == "succeeded":
            await _end(ctx, ExecutionEnd(task_id=task_id, outcome="succeeded", reason="reconciled_from_unknown",
                                         phase=row.execution_phase))
            if await finish_business_task(conn, monitor_task_id, status="completed"):
                business = "completed"
            await emit_lifecycle(conn, "task.completed", tenant_id=row.tenant_id, client_id=row.target_client_id,
                                 task_id=task_id, monitor_task_id=monitor_task_id,
                                 ai_platform_id=row.ai_platform_id, lane=row.lane,
                                 reason="reconciled_from_unknown", collect_request_id=row.collect_request_id)
        else:
            failed = verdict == "failed"
            error = "result failed" if failed else "result accepted but never ingested"
            await _end(ctx, ExecutionEnd(task_id=task_id, outcome="failed" if failed else "expired",
                                         reason="reconciled_from_unknown", error=error, phase=row.execution_phase))
            retried = await retry_business_task(conn, monitor_task_id,
                                                max_attempts=ctx.settings.max_dispatch_attempts, error=error)
            business = None if isinstance(retried, Stale) else retried  # Stale: a late result finished it
            await emit_lifecycle(conn, "task.failed" if failed else "task.aborted", tenant_id=row.tenant_id,
                                 client_id=row.target_client_id,
                                 task_id=task_id, monitor_task_id=monitor_task_id,
                                 ai_platform_id=row.ai_platform_id, lane=row.lane,
                                 reason="reconciled_from_unknown", collect_request_id=row.collect_request_id)
        if business in ("completed", "failed"):
            await refresh_progress(conn, row.collect_request_id)
    result.fixed += 1
    result.add(f"converged_{verdict}")
    log.info("unknown execution converged", extra={
        "task_id": str(task_id), "monitor_task_id": monitor_task_id, "tenant_id": row.tenant_id,
        "client_id": str(row.target_client_id), "verdict": verdict, "business_status": business})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    async with ctx.conn.transaction():
        marked = await execution_paths.mark_unknown(ctx.conn, grace_s=ctx.settings.unknown_grace_seconds,
                                                    limit=ctx.config.batch_size)
    for m in marked:
        log.warning("result accepted but not ingested within the grace period; execution unknown", extra={
            "task_id": str(m.id), "monitor_task_id": m.monitor_task_id, "tenant_id": m.tenant_id,
            "client_id": str(m.target_client_id)})
    result.add("marked_unknown", len(marked))
    ids = await execution_paths.unknown(ctx.conn, limit=ctx.config.batch_size)
    await fix_each(ctx, result, converge_one, ids, what="unknown convergence")
    return result


JOB = configured_job(NAME, "results accepted but not ingested -> unknown; unknown converged from the evidence", run)
