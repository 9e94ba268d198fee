"""Job 5 — unknown executions (docs/architecture.md §8.2, contract #9).

1. An in_progress execution whose result the hub accepted (`result_received_at`) but ingest has not
   applied after `unknown_grace_seconds` becomes `unknown` (still active: it blocks a second one).
2. Every `unknown` execution converges from the evidence (rules.converge_unknown):
   a run row written for this lease -> succeeded / failed (business completed / retried);
   no evidence and the lease expired -> aborted, business task retried (the attempt is consumed);
   no evidence, lease still held -> back to `queued` on the same row (the attempt is closed, a new
   lease gets a new epoch, so the old token is fenced off).
   A late result is still applied by ingest (end_execution is a no-op then; the business task is
   completed by the success-priority rule), so converging early never loses data.
"""

from __future__ import annotations

import uuid

from libs.tasks import executions
from libs.tasks.requests import refresh_progress
from libs.tasks.transitions import (
    emit_lifecycle,
    end_execution,
    finish_business_task,
    retry_business_task,
)
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, fix_candidates, log
from services.reconciler.rules import UnknownEvidence, converge_unknown

NAME = "unknown_executions"

_CANDIDATES = """
SELECT id FROM desktop_tasks WHERE kind = 'monitor' AND status = 'unknown' ORDER BY updated_at LIMIT %(limit)s
"""

_LOCK = """
SELECT d.id, d.tenant_id, d.monitor_task_id, d.target_client_id, d.lease_epoch, d.lane, d.ai_platform_id,
       d.collect_request_id, d.leased_at, d.execution_phase,
       coalesce(d.lease_expires_at > now(), false) AS lease_alive
FROM desktop_tasks d
WHERE d.id = %(id)s AND d.status = 'unknown'
FOR UPDATE SKIP LOCKED
"""

# The run row of the business key, if it was written by this execution or after its lease began.
_EVIDENCE = """
SELECT r.status FROM monitoring_collect_tasks t
JOIN question_monitor_runs r
  ON r.tenant_id = t.tenant_id AND r.brand_id = t.brand_id AND r.question_id = t.question_id
 AND r.ai_platform_id = t.ai_platform_id AND r.collector_type = t.collector_type AND r.run_mode = t.run_mode
 AND r.business_date = t.business_date
WHERE t.id = %(monitor_task_id)s
  AND (r.desktop_task_id = %(task_id)s OR (%(leased_at)s::timestamptz IS NOT NULL AND r.updated_at >= %(leased_at)s))
"""


async def converge_one(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        cur = await conn.execute(_LOCK, {"id": task_id})
        row = await cur.fetchone()
        if row is None:
            return
        cur = await conn.execute(_EVIDENCE, {"monitor_task_id": row["monitor_task_id"], "task_id": task_id,
                                             "leased_at": row["leased_at"]})
        statuses = {r["status"] for r in await cur.fetchall()}
        run_status = "succeeded" if "succeeded" in statuses else ("failed" if "failed" in statuses else None)
        verdict = converge_unknown(UnknownEvidence(run_status=run_status, lease_alive=bool(row["lease_alive"])))
        monitor_task_id = row["monitor_task_id"]
        business: str | None = None
        if verdict == "queued":
            await conn.execute(executions.REQUEUE_UNKNOWN, {"id": task_id})
            await conn.execute(executions.CLOSE_REQUEUED_ATTEMPT, {"id": task_id, "lease_epoch": row["lease_epoch"]})
        elif verdict == "succeeded":
            await end_execution(conn, task_id=task_id, outcome="succeeded", reason="reconciled_from_unknown",
                                phase=row["execution_phase"])
            if await finish_business_task(conn, monitor_task_id, status="completed"):
                business = "completed"
            await emit_lifecycle(conn, "task.completed", tenant_id=row["tenant_id"], client_id=row["target_client_id"],
                                 task_id=task_id, monitor_task_id=monitor_task_id,
                                 ai_platform_id=row["ai_platform_id"], lane=row["lane"],
                                 reason="reconciled_from_unknown", collect_request_id=row["collect_request_id"])
        else:
            failed = verdict == "failed"
            error = "result failed" if failed else "result accepted but never ingested"
            await end_execution(conn, task_id=task_id, outcome="failed" if failed else "expired",
                                reason="reconciled_from_unknown", error=error,
                                phase=row["execution_phase"])
            business = await retry_business_task(conn, monitor_task_id,
                                                 max_attempts=ctx.settings.max_dispatch_attempts, error=error)
            await emit_lifecycle(conn, "task.failed" if failed else "task.aborted", tenant_id=row["tenant_id"],
                                 client_id=row["target_client_id"],
                                 task_id=task_id, monitor_task_id=monitor_task_id,
                                 ai_platform_id=row["ai_platform_id"], lane=row["lane"],
                                 reason="reconciled_from_unknown", collect_request_id=row["collect_request_id"])
        if business in ("completed", "failed"):
            await refresh_progress(conn, row["collect_request_id"])
    result.fixed += 1
    result.add(f"converged_{verdict}")
    log.info("unknown execution converged", extra={
        "task_id": str(task_id), "monitor_task_id": monitor_task_id, "tenant_id": row["tenant_id"],
        "client_id": str(row["target_client_id"]), "verdict": verdict, "business_status": business})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    async with ctx.conn.transaction():
        cur = await ctx.conn.execute(executions.MARK_UNKNOWN, {"grace_s": ctx.settings.unknown_grace_seconds,
                                                     "limit": ctx.config.batch_size})
        marked = await cur.fetchall()
    for row in marked:
        log.warning("result accepted but not ingested within the grace period; execution unknown", extra={
            "task_id": str(row["id"]), "monitor_task_id": row["monitor_task_id"], "tenant_id": row["tenant_id"],
            "client_id": str(row["target_client_id"])})
    result.add("marked_unknown", len(marked))
    await fix_candidates(ctx, result, converge_one, _CANDIDATES, what="unknown convergence")
    return result


JOB = configured_job(NAME, "results accepted but not ingested -> unknown; unknown converged from the evidence", run)
