"""Job 6 — business-day expiry: pending (or, on the legacy path, leased) business tasks of a business date that is
over in the tenant's time zone end `expired`; their active executions are aborted (a client still holding one is told
with TaskControl(cancelled)), and their collect-now requests count them as not collected. The reads and the move are
libs/tasks/business_day.py's operations."""

from __future__ import annotations

from typing import assert_never

from libs.tasks import business_day, execution_paths
from libs.tasks.outcomes import NotFound, Stale
from libs.tasks.records import EndedExecution, ExecutionEnd
from libs.tasks.requests import refresh_progress
from libs.tasks.transitions import emit_lifecycle
from services.reconciler.jobs.base import RETRYABLE_ERRORS, JobContext, JobResult, configured_job, log, send_control

NAME = "business_day_expiry"


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    conn = ctx.conn
    for candidate in await business_day.expiring_task_ids(conn, limit=ctx.config.batch_size):
        try:
            async with conn.transaction():
                task = await business_day.lock_expiring_task(conn, candidate)
                if task is None:
                    continue
                for d in await business_day.live_work(conn, task.id):
                    match await execution_paths.end(conn, ExecutionEnd(task_id=d.id, outcome="aborted",
                                                                       reason="business_day_expired")):
                        case EndedExecution():
                            pass
                        case Stale() | NotFound():  # ended by another writer since it was read
                            continue
                        case unhandled:
                            assert_never(unhandled)
                    result.add("executions_aborted")
                    if d.status != "unknown":
                        await send_control(conn, task_id=d.id, client_id=d.target_client_id,
                                           control="cancelled", reason="business_day_expired",
                                           interrupt_generation=d.interrupt_generation,
                                           collect_request_id=d.collect_request_id, tenant_id=task.tenant_id)
                    await emit_lifecycle(conn, "task.aborted", tenant_id=task.tenant_id,
                                         client_id=d.target_client_id, task_id=d.id,
                                         monitor_task_id=task.id, ai_platform_id=d.ai_platform_id,
                                         lane=d.lane, reason="business_day_expired",
                                         collect_request_id=d.collect_request_id)
                await business_day.expire(conn, task.id)
                await refresh_progress(conn, task.collect_request_id)
        except RETRYABLE_ERRORS as exc:
            result.add("skipped_conflict")
            log.warning("business-day expiry lost a race", extra={"monitor_task_id": candidate,
                                                                   "error": str(exc)})
            continue
        result.fixed += 1
        result.add("tasks_expired")
        log.info("business task expired", extra={"monitor_task_id": task.id, "tenant_id": task.tenant_id,
                                                 "business_date": task.business_date.isoformat(),
                                                 "execution_owner": task.execution_owner})
    return result


JOB = configured_job(
    NAME, "pending tasks of a past business date (tenant time zone) -> expired, executions aborted", run)
