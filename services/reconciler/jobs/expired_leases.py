"""Job 1 — expired leases (contract #9): the holder is gone or too slow; the attempt ends `expired`,
the business task goes back to pending in the retry lane (high stays high), or `failed` once
`max_dispatch_attempts` dispatches were used. On both paths: executions, and legacy leases on the business row."""

from __future__ import annotations

import uuid
from typing import assert_never

import msgspec

from libs.tasks import execution_paths
from libs.tasks.outcomes import Stale
from libs.tasks.records import ExpiringLease
from libs.telemetry import metrics
from services.reconciler.jobs.base import (
    JobContext,
    JobResult,
    configured_job,
    expire_and_retry,
    fix_each,
    log,
    send_control,
)

NAME = "expired_leases"


async def expire_one(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        match await execution_paths.lock_expired(conn, task_id):
            case ExpiringLease() as lease:
                pass
            case Stale():  # extended, resulted, ended or locked by another writer since it was read
                return
            case unhandled:
                assert_never(unhandled)
        expired = await expire_and_retry(ctx, msgspec.structs.asdict(lease), reason="lease_expired",
                                         error="lease expired without a result", retry_error="lease expired",
                                         phase=lease.execution_phase)
        if not expired.ended:
            return
        status = expired.business_status
        # If the holder is still alive (e.g. paused), tell it to stop: its token is fenced off anyway.
        await send_control(conn, task_id=task_id, client_id=lease.target_client_id, control="lease_revoked",
                           reason="lease_expired", interrupt_generation=lease.interrupt_generation,
                           collect_request_id=lease.collect_request_id, tenant_id=lease.tenant_id)
        if status == "failed":
            result.add("business_failed")
        elif status == "pending":
            result.add("business_retried")
    result.fixed += 1
    if lease.interrupted_at is not None:
        # The expiry followed a collect-now interrupt: the scheduled task has to run again because of it.
        metrics.collect_now_preempt_induced_retry_count.inc()
        result.add("preempt_induced_retry")
    log.info("lease expired", extra={"task_id": str(task_id), "monitor_task_id": lease.monitor_task_id,
                                     "client_id": str(lease.target_client_id), "tenant_id": lease.tenant_id,
                                     "business_status": status})


async def run(ctx: JobContext) -> JobResult:
    """The candidates of both paths (read without locks), each expired in its own transaction."""
    result = JobResult()
    ids = await execution_paths.expired(ctx.conn, limit=ctx.config.batch_size)
    await fix_each(ctx, result, expire_one, ids, what="lease expiry")
    return result


JOB = configured_job(
    NAME, "in_progress executions and legacy leases past lease_expires_at -> expired, business retry/failed", run)
