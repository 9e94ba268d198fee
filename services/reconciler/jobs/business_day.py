"""Job 6 — business-day expiry: pending (or, on the legacy path, leased) business tasks of a business date that is
over in the tenant's time zone end `expired`; their active executions are aborted (a client still holding one is told
with TaskControl(cancelled)), and their collect-now requests count them as not collected."""

from __future__ import annotations

from libs.tasks import business
from libs.tasks.requests import refresh_progress
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL
from libs.tasks.transitions import emit_lifecycle, end_execution
from services.reconciler.jobs.base import RETRYABLE_ERRORS, JobContext, JobResult, configured_job, log, send_control

NAME = "business_day_expiry"

# The tenant's "today" is computed by Postgres from tenants.time_zone (IANA name).
_CANDIDATES = """
SELECT t.id FROM monitoring_collect_tasks t JOIN tenants tn ON tn.id = t.tenant_id
WHERE t.status IN ('pending', 'leased', 'received') AND t.business_date < (now() AT TIME ZONE tn.time_zone)::date
ORDER BY t.business_date, t.id
LIMIT %(limit)s
"""

_LOCK = """
SELECT t.id, t.tenant_id, t.business_date, t.collect_request_id, t.execution_owner
FROM monitoring_collect_tasks t JOIN tenants tn ON tn.id = t.tenant_id
WHERE t.id = %(id)s AND t.status IN ('pending', 'leased', 'received')
  AND t.business_date < (now() AT TIME ZONE tn.time_zone)::date
FOR UPDATE OF t SKIP LOCKED
"""

_ACTIVE = f"""
SELECT id, target_client_id, status, interrupt_generation, lane, ai_platform_id, collect_request_id
FROM desktop_tasks
WHERE monitor_task_id = %(id)s AND status IN {ACTIVE_EXECUTION_SQL}
FOR UPDATE
"""

# On the legacy path: its live lease (ending it puts the business row back to pending, then it expires).
_ACTIVE_LEGACY = """
SELECT id, target_client_id, status, interrupt_generation, lane, ai_platform_id, collect_request_id
FROM legacy_leases
WHERE monitor_task_id = %(id)s AND status IN ('queued', 'in_progress')
FOR UPDATE
"""


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    conn = ctx.conn
    cur = await conn.execute(_CANDIDATES, {"limit": ctx.config.batch_size})
    for candidate in await cur.fetchall():
        try:
            async with conn.transaction():
                cur = await conn.execute(_LOCK, {"id": candidate["id"]})
                task = await cur.fetchone()
                if task is None:
                    continue
                cur = await conn.execute(_ACTIVE, {"id": task["id"]})
                active = await cur.fetchall()
                cur = await conn.execute(_ACTIVE_LEGACY, {"id": task["id"]})
                for d in active + await cur.fetchall():
                    if await end_execution(conn, task_id=d["id"], outcome="aborted",
                                           reason="business_day_expired") is None:
                        continue
                    result.add("executions_aborted")
                    if d["status"] != "unknown":
                        await send_control(conn, task_id=d["id"], client_id=d["target_client_id"],
                                           control="cancelled", reason="business_day_expired",
                                           interrupt_generation=d["interrupt_generation"],
                                           collect_request_id=d["collect_request_id"], tenant_id=task["tenant_id"])
                    await emit_lifecycle(conn, "task.aborted", tenant_id=task["tenant_id"],
                                         client_id=d["target_client_id"], task_id=d["id"],
                                         monitor_task_id=task["id"], ai_platform_id=d["ai_platform_id"],
                                         lane=d["lane"], reason="business_day_expired",
                                         collect_request_id=d["collect_request_id"])
                await conn.execute(business.EXPIRE, {"id": task["id"]})
                await refresh_progress(conn, task["collect_request_id"])
        except RETRYABLE_ERRORS as exc:
            result.add("skipped_conflict")
            log.warning("business-day expiry lost a race", extra={"monitor_task_id": candidate["id"],
                                                                   "error": str(exc)})
            continue
        result.fixed += 1
        result.add("tasks_expired")
        log.info("business task expired", extra={"monitor_task_id": task["id"], "tenant_id": task["tenant_id"],
                                                 "business_date": task["business_date"].isoformat(),
                                                 "execution_owner": task["execution_owner"]})
    return result


JOB = configured_job(
    NAME, "pending tasks of a past business date (tenant time zone) -> expired, executions aborted", run)
