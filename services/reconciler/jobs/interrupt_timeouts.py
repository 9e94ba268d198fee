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

from libs.tasks import business
from libs.tasks.fragments import interrupt_timeout_ms_sql
from libs.tasks.transitions import (
    ELIGIBLE_CLIENT_SQL,
    emit_lifecycle,
    end_execution,
    yield_business_task,
)
from libs.telemetry import metrics
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, fix_candidates, log, send_control

NAME = "interrupt_timeouts"
DEFAULT_HARD_TIMEOUT_MS = 45_000

# The execution's hard timeout: its mode's (§10.5 OpenAI deep reasoning 180 s), else its platform's.
HARD_TIMEOUT_MS = interrupt_timeout_ms_sql("hard", "d", "ps", "%(default_hard_ms)s")

_OVERDUE = f"""
d.kind = 'monitor' AND d.status = 'in_progress' AND d.result_received_at IS NULL
  AND coalesce((d.control_flags ->> 'interrupt_requested')::boolean, false)
  AND d.interrupted_at IS NOT NULL
  AND d.interrupted_at < now() - make_interval(secs => {HARD_TIMEOUT_MS} / 1000.0)
"""

_CANDIDATES = f"""
SELECT d.id FROM desktop_tasks d LEFT JOIN platform_settings ps ON ps.ai_platform_id = d.ai_platform_id
WHERE {_OVERDUE}
ORDER BY d.interrupted_at
LIMIT %(limit)s
"""

_LOCK = f"""
SELECT d.id, d.tenant_id, d.workspace_id, d.monitor_task_id, d.target_client_id, d.lease_epoch, d.lane,
       d.ai_platform_id, d.interrupt_generation, d.interrupted_at, d.execution_phase, d.control_flags,
       {HARD_TIMEOUT_MS} AS hard_timeout_ms,
       extract(epoch FROM now() - d.interrupted_at) * 1000 AS overdue_ms
FROM desktop_tasks d LEFT JOIN platform_settings ps ON ps.ai_platform_id = d.ai_platform_id
WHERE d.id = %(id)s AND {_OVERDUE}
FOR UPDATE OF d SKIP LOCKED
"""

_OTHER_CLIENT = f"""
SELECT c.id, c.interrupt_generation FROM desktop_clients c
WHERE c.tenant_id = %(tenant_id)s AND c.workspace_id = %(workspace_id)s AND c.id <> %(client_id)s
  AND {ELIGIBLE_CLIENT_SQL}
ORDER BY (SELECT count(*) FROM desktop_tasks d
          WHERE d.target_client_id = c.id AND d.status IN ('queued', 'in_progress')) ASC,
         c.last_heartbeat_at DESC
LIMIT 1
"""

# High work of the stuck client that has not started: queued executions are taken back.
_QUEUED_HIGH_OF_CLIENT = """
SELECT id, monitor_task_id, lane, ai_platform_id, collect_request_id FROM desktop_tasks
WHERE target_client_id = %(client_id)s AND kind = 'monitor' AND status = 'queued' AND lane = 'high'
FOR UPDATE SKIP LOCKED
"""


async def force_cancel_one(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        cur = await conn.execute(_LOCK, {"id": task_id, "default_hard_ms": DEFAULT_HARD_TIMEOUT_MS})
        row = await cur.fetchone()
        if row is None:
            return
        client_id: uuid.UUID = row["target_client_id"]
        flags = row["control_flags"] or {}
        request_id = flags.get("collect_request_id")
        ended = await end_execution(conn, task_id=task_id, outcome="aborted", lease_epoch=row["lease_epoch"],
                                    reason="interrupt_hard_timeout", error="did not yield before the hard timeout",
                                    phase=row["execution_phase"])
        if ended is None:
            return
        await yield_business_task(conn, row["monitor_task_id"])
        await send_control(conn, task_id=task_id, client_id=client_id, control="lease_revoked",
                           reason="interrupt_hard_timeout", interrupt_generation=row["interrupt_generation"],
                           tenant_id=row["tenant_id"],
                           collect_request_id=uuid.UUID(request_id) if request_id else None)
        await emit_lifecycle(conn, "task.aborted", tenant_id=row["tenant_id"], client_id=client_id, task_id=task_id,
                             monitor_task_id=row["monitor_task_id"], ai_platform_id=row["ai_platform_id"],
                             lane=row["lane"], reason="interrupt_hard_timeout")
        cur = await conn.execute(_OTHER_CLIENT, {"tenant_id": row["tenant_id"], "workspace_id": row["workspace_id"],
                                                 "client_id": client_id,
                                                 "heartbeat_timeout_s": ctx.settings.heartbeat_timeout_seconds})
        other = await cur.fetchone()
        new_client = other["id"] if other else None
        cur = await conn.execute(_QUEUED_HIGH_OF_CLIENT, {"client_id": client_id})
        queued_high = await cur.fetchall()
        for q in queued_high:
            if await end_execution(conn, task_id=q["id"], outcome="aborted", reason="interrupt_hard_timeout") is None:
                continue
            await yield_business_task(conn, q["monitor_task_id"])
            await send_control(conn, task_id=q["id"], client_id=client_id, control="cancelled",
                               reason="interrupt_hard_timeout", interrupt_generation=row["interrupt_generation"],
                               tenant_id=row["tenant_id"], collect_request_id=q["collect_request_id"])
            await emit_lifecycle(conn, "task.released", tenant_id=row["tenant_id"], client_id=client_id,
                                 task_id=q["id"], monitor_task_id=q["monitor_task_id"],
                                 ai_platform_id=q["ai_platform_id"], lane=q["lane"], reason="interrupt_hard_timeout",
                                 collect_request_id=q["collect_request_id"])
        cur = await conn.execute(business.REBIND_HIGH, {"tenant_id": row["tenant_id"], "client_id": client_id,
                                                "new_client_id": new_client})
        moved = cur.rowcount
    metrics.monitor_preempt_timeout_count.inc(client_id=str(client_id))
    metrics.collect_now_preempt_induced_retry_count.inc()
    result.fixed += 1
    result.add("leases_revoked")
    result.add("high_moved", moved)
    result.add("queued_high_cancelled", len(queued_high))
    log.warning("interrupt passed the hard timeout; lease force-cancelled", extra={
        "task_id": str(task_id), "client_id": str(client_id), "tenant_id": row["tenant_id"],
        "monitor_task_id": row["monitor_task_id"], "hard_timeout_ms": row["hard_timeout_ms"],
        "overdue_ms": float(row["overdue_ms"]), "collect_request_id": request_id,
        "high_moved_to": str(new_client) if new_client else None, "high_moved": moved})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    await fix_candidates(ctx, result, force_cancel_one, _CANDIDATES, what="interrupt timeout",
                         params={"default_hard_ms": DEFAULT_HARD_TIMEOUT_MS})
    return result


JOB = configured_job(
    NAME, "interrupts past the platform's hard timeout -> lease revoked, high work moved to another client", run)
