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

from libs.tasks import business, fragments
from libs.tasks.transitions import emit_lifecycle, end_execution, yield_business_task
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, fix_candidates, log

NAME = "offline_clients"

_MARK_OFFLINE = f"""
UPDATE desktop_clients c
SET online = false, offline_since = coalesce(c.offline_since, now()), updated_at = now()
WHERE c.id IN (SELECT c.id FROM desktop_clients c WHERE c.online AND {fragments.STALE_CLIENT_SQL}
               ORDER BY c.last_heartbeat_at NULLS FIRST LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
  AND c.online AND {fragments.STALE_CLIENT_SQL}
RETURNING c.id, c.tenant_id, c.last_heartbeat_at, c.connected_hub
"""

_QUEUED_CANDIDATES = f"""
SELECT d.id FROM desktop_tasks d JOIN desktop_clients c ON c.id = d.target_client_id
WHERE d.kind = 'monitor' AND d.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
ORDER BY d.created_at
LIMIT %(limit)s
"""

# Legacy offers (not pulled) to such a client, likewise.
_LEGACY_QUEUED_CANDIDATES = f"""
SELECT l.id FROM legacy_leases l JOIN desktop_clients c ON c.id = l.target_client_id
WHERE l.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
ORDER BY l.created_at
LIMIT %(limit)s
"""

_LOCK_LEGACY_QUEUED = f"""
SELECT l.id, l.tenant_id, l.monitor_task_id, l.target_client_id, l.lane, l.ai_platform_id, l.collect_request_id
FROM legacy_leases l JOIN desktop_clients c ON c.id = l.target_client_id
WHERE l.id = %(id)s AND l.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
FOR UPDATE OF l SKIP LOCKED
"""

_LOCK_QUEUED = f"""
SELECT d.id, d.tenant_id, d.monitor_task_id, d.target_client_id, d.lane, d.ai_platform_id, d.collect_request_id
FROM desktop_tasks d JOIN desktop_clients c ON c.id = d.target_client_id
WHERE d.id = %(id)s AND d.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
FOR UPDATE OF d SKIP LOCKED
"""


async def release_queued(ctx: JobContext, task_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        params = {"id": task_id, "timeout_s": ctx.settings.heartbeat_timeout_seconds}
        cur = await conn.execute(_LOCK_QUEUED, params)
        row = await cur.fetchone()
        if row is None:  # a legacy offer?
            cur = await conn.execute(_LOCK_LEGACY_QUEUED, params)
            row = await cur.fetchone()
        if row is None:
            return
        ended = await end_execution(conn, task_id=task_id, outcome="aborted", reason="client_offline")
        if ended is None:
            return
        await yield_business_task(conn, row["monitor_task_id"])
        await emit_lifecycle(conn, "task.released", tenant_id=row["tenant_id"], client_id=row["target_client_id"],
                             task_id=task_id, monitor_task_id=row["monitor_task_id"],
                             ai_platform_id=row["ai_platform_id"], lane=row["lane"], reason="client_offline",
                             collect_request_id=row["collect_request_id"])
    result.fixed += 1
    result.add("queued_released")
    log.info("queued execution released from an offline client", extra={
        "task_id": str(task_id), "client_id": str(row["target_client_id"]), "tenant_id": row["tenant_id"],
        "monitor_task_id": row["monitor_task_id"]})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    conn = ctx.conn
    params = {"timeout_s": ctx.settings.heartbeat_timeout_seconds, "limit": ctx.config.batch_size}
    async with conn.transaction():
        cur = await conn.execute(_MARK_OFFLINE, params)
        offline = await cur.fetchall()
        for row in offline:
            await emit_lifecycle(conn, "client.offline", tenant_id=row["tenant_id"], client_id=row["id"],
                                 reason="heartbeat_timeout")
    for row in offline:
        log.info("client offline: no heartbeat", extra={
            "client_id": str(row["id"]), "tenant_id": row["tenant_id"], "connected_hub": row["connected_hub"],
            "last_heartbeat_at": row["last_heartbeat_at"].isoformat() if row["last_heartbeat_at"] else None})
    result.add("clients_offline", len(offline))
    async with conn.transaction():
        cur = await conn.execute(business.UNBIND_HIGH_OF_STALE_CLIENTS, params)
        unbound = await cur.fetchall()
    for row in unbound:
        log.info("high task unbound from an offline client", extra={
            "monitor_task_id": row["id"], "tenant_id": row["tenant_id"], "client_id": str(row["client_id"]),
            "collect_request_id": str(row["collect_request_id"]) if row["collect_request_id"] else None})
    result.add("high_unbound", len(unbound))
    result.fixed += len(offline) + len(unbound)
    await fix_candidates(ctx, result, release_queued, _QUEUED_CANDIDATES, _LEGACY_QUEUED_CANDIDATES,
                         what="queued release", params={"timeout_s": ctx.settings.heartbeat_timeout_seconds})
    return result


JOB = configured_job(
    NAME, "stale heartbeats -> client.offline; their high tasks unbound, their queued executions released", run)
