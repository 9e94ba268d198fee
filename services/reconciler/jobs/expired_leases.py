"""Job 1 — expired leases (contract #9): the holder is gone or too slow; the attempt ends `expired`,
the business task goes back to pending in the retry lane (high stays high), or `failed` once
`max_dispatch_attempts` dispatches were used. On both paths: executions, and legacy leases on the business row."""

from __future__ import annotations

import uuid

from libs.telemetry import metrics
from services.reconciler.jobs.base import (
    JobContext,
    JobResult,
    configured_job,
    expire_and_retry,
    fix_candidates,
    log,
    send_control,
)

NAME = "expired_leases"

_CANDIDATES = """
SELECT id FROM desktop_tasks
WHERE kind = 'monitor' AND status = 'in_progress' AND lease_expires_at < now() AND result_received_at IS NULL
ORDER BY lease_expires_at
LIMIT %(limit)s
"""

# Legacy leases (the lease on the business row, libs/tasks/legacy.py) past their expiry, likewise.
_LEGACY_CANDIDATES = """
SELECT l.id FROM monitoring_collect_tasks t JOIN legacy_leases l ON l.id = t.legacy_lease_id
WHERE t.status = 'leased' AND t.execution_owner = 'legacy' AND t.lease_expires_at < now()
  AND l.status = 'in_progress' AND l.result_received_at IS NULL
ORDER BY t.lease_expires_at
LIMIT %(limit)s
"""

# Re-checked under the row lock: an extend or a result that landed meanwhile wins.
_LOCK = """
SELECT id, tenant_id, monitor_task_id, target_client_id, lease_epoch, interrupted_at, interrupt_generation,
       collect_request_id, lane, ai_platform_id, execution_phase
FROM desktop_tasks
WHERE id = %(id)s AND status = 'in_progress' AND lease_expires_at < now() AND result_received_at IS NULL
FOR UPDATE SKIP LOCKED
"""

_LOCK_LEGACY = """
SELECT l.id, l.tenant_id, l.monitor_task_id, l.target_client_id, l.lease_epoch,
       CASE WHEN (l.control_flags ->> 'interrupt_requested') = 'true' THEN l.updated_at END AS interrupted_at,
       l.interrupt_generation, l.collect_request_id, l.lane, l.ai_platform_id, l.execution_phase
FROM legacy_leases l JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id AND t.legacy_lease_id = l.id
WHERE l.id = %(id)s AND l.status = 'in_progress' AND l.result_received_at IS NULL AND t.status = 'leased'
  AND t.lease_expires_at < now()
FOR UPDATE OF l SKIP LOCKED
"""
# The business row first (the lock order of libs/tasks/legacy.py).
_LOCK_LEGACY_BUSINESS = """
SELECT t.id FROM monitoring_collect_tasks t
WHERE t.id = (SELECT l.monitor_task_id FROM legacy_leases l WHERE l.id = %(id)s) AND t.status = 'leased'
FOR UPDATE OF t SKIP LOCKED
"""


async def expire_one(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        cur = await conn.execute(_LOCK, {"id": task_id})
        row = await cur.fetchone()
        if row is None:  # a legacy lease?
            cur = await conn.execute(_LOCK_LEGACY_BUSINESS, {"id": task_id})
            if await cur.fetchone() is not None:
                cur = await conn.execute(_LOCK_LEGACY, {"id": task_id})
                row = await cur.fetchone()
        if row is None:
            return
        expired = await expire_and_retry(ctx, row, reason="lease_expired", error="lease expired without a result",
                                         retry_error="lease expired", phase=row["execution_phase"])
        if not expired.ended:
            return
        status = expired.business_status
        # If the holder is still alive (e.g. paused), tell it to stop: its token is fenced off anyway.
        await send_control(conn, task_id=task_id, client_id=row["target_client_id"], control="lease_revoked",
                           reason="lease_expired", interrupt_generation=row["interrupt_generation"],
                           collect_request_id=row["collect_request_id"], tenant_id=row["tenant_id"])
        if status == "failed":
            result.add("business_failed")
        elif status == "pending":
            result.add("business_retried")
    result.fixed += 1
    if row["interrupted_at"] is not None:
        # The expiry followed a collect-now interrupt: the scheduled task has to run again because of it.
        metrics.collect_now_preempt_induced_retry_count.inc()
        result.add("preempt_induced_retry")
    log.info("lease expired", extra={"task_id": str(task_id), "monitor_task_id": row["monitor_task_id"],
                                     "client_id": str(row["target_client_id"]), "tenant_id": row["tenant_id"],
                                     "business_status": status})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    await fix_candidates(ctx, result, expire_one, _CANDIDATES, _LEGACY_CANDIDATES, what="lease expiry")
    return result


JOB = configured_job(
    NAME, "in_progress executions and legacy leases past lease_expires_at -> expired, business retry/failed", run)
