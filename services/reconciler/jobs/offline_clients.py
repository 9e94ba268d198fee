"""Job 3 — offline clients (docs/architecture.md §10.6, contract #9).

- `online` clients whose last heartbeat is older than `heartbeat_timeout_seconds` -> online=false,
  lifecycle `client.offline`.
- Pending high business tasks bound to a client without a fresh heartbeat are unbound
  (target_client_id = NULL, lane stays high), so the coordinator can give them to any online
  client of the tenant. The rule keys on the heartbeat, not on `online`: a socket that drops and
  reconnects within the timeout keeps its binding.
- Queued (never leased) executions waiting for such a client are aborted and their business tasks
  released with the dispatch attempt given back: they never ran, and otherwise the active execution
  would block the business task until the client returns; legacy offers not pulled yet, likewise. In-progress
  ones are left to their lease (job `expired_leases`).
"""

from __future__ import annotations

import uuid
from typing import assert_never

from libs.tasks import business, execution_paths, lease_context
from libs.tasks.outcomes import NotFound, Stale
from libs.tasks.records import EndedExecution, ExecutionEnd, QueuedWork
from libs.tasks.transitions import emit_lifecycle, yield_business_task
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, fix_each, log

NAME = "offline_clients"


async def release_queued(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        match await execution_paths.lock_offline_queued(conn, task_id,
                                                        timeout_s=ctx.settings.heartbeat_timeout_seconds):
            case QueuedWork() as work:
                pass
            case Stale():  # leased, ended, its client back or locked by another writer since it was read
                return
            case unhandled_lock:
                assert_never(unhandled_lock)
        match await execution_paths.end(conn, ExecutionEnd(task_id=task_id, outcome="aborted",
                                                           reason="client_offline")):
            case EndedExecution():
                pass
            case Stale() | NotFound():  # cannot happen under the row lock; left as it is if it did
                return
            case unhandled_end:
                assert_never(unhandled_end)
        await yield_business_task(conn, work.monitor_task_id)
        await emit_lifecycle(conn, "task.released", tenant_id=work.tenant_id, client_id=work.target_client_id,
                             task_id=task_id, monitor_task_id=work.monitor_task_id,
                             ai_platform_id=work.ai_platform_id, lane=work.lane, reason="client_offline",
                             collect_request_id=work.collect_request_id)
    result.fixed += 1
    result.add("queued_released")
    log.info("queued execution released from an offline client", extra={
        "task_id": str(task_id), "client_id": str(work.target_client_id), "tenant_id": work.tenant_id,
        "monitor_task_id": work.monitor_task_id})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    conn = ctx.conn
    timeout_s = ctx.settings.heartbeat_timeout_seconds
    async with conn.transaction():
        offline = await lease_context.mark_stale_clients_offline(conn, timeout_s=timeout_s,
                                                                 limit=ctx.config.batch_size)
        for client in offline:
            await emit_lifecycle(conn, "client.offline", tenant_id=client.tenant_id, client_id=client.id,
                                 reason="heartbeat_timeout")
    for client in offline:
        log.info("client offline: no heartbeat", extra={
            "client_id": str(client.id), "tenant_id": client.tenant_id, "connected_hub": client.connected_hub,
            "last_heartbeat_at": client.last_heartbeat_at.isoformat() if client.last_heartbeat_at else None})
    result.add("clients_offline", len(offline))
    async with conn.transaction():
        unbound = await business.unbind_high_of_stale_clients(conn, heartbeat_timeout_s=timeout_s)
    for task in unbound:
        log.info("high task unbound from an offline client", extra={
            "monitor_task_id": task.id, "tenant_id": task.tenant_id, "client_id": str(task.client_id),
            "collect_request_id": str(task.collect_request_id) if task.collect_request_id else None})
    result.add("high_unbound", len(unbound))
    result.fixed += len(offline) + len(unbound)
    ids = await execution_paths.offline_queued(conn, timeout_s=timeout_s, limit=ctx.config.batch_size)
    await fix_each(ctx, result, release_queued, ids, what="queued release")
    return result


JOB = configured_job(
    NAME, "stale heartbeats -> client.offline; their high tasks unbound, their queued executions released", run)
