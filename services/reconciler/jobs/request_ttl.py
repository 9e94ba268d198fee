"""Job 2 — collect-request TTL (docs/architecture.md §10.6): requests nobody could serve in time end `timed_out`;
requests accepted without any dispatch for `request_no_dispatch_warn_seconds` raise a warning once.

Decisions: `accepted` / `dispatching` requests past `ttl_expires_at` time out. A `running` request
past its TTL times out only when none of its tasks has an active execution any more (its work
stalled, e.g. every client went away after the first lease); one still executing is left to finish.
The timed-out request's pending tasks that are not executing leave the high lane (normal, unbound):
they are still collected for the day, but no longer preempt anyone for a request the user saw end.
"""

from __future__ import annotations

import uuid

from libs.domain.lanes import NORMAL_PRIORITY
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, ACTIVE_LEASE_SQL
from libs.telemetry import metrics
from services.reconciler.jobs.base import (
    Job,
    JobContext,
    JobResult,
    candidates,
    configured_interval,
    fix_each,
    log,
)

NAME = "request_ttl"

# A task of the request still running, on either path: an active execution, or a live legacy lease.
_ACTIVE_EXECUTION_OF_REQUEST = f"""
(EXISTS (SELECT 1 FROM monitoring_collect_tasks t JOIN desktop_tasks d ON d.monitor_task_id = t.id
         WHERE t.collect_request_id = r.id AND t.tenant_id = r.tenant_id
           AND d.status IN {ACTIVE_EXECUTION_SQL})
 OR EXISTS (SELECT 1 FROM monitoring_collect_tasks t JOIN legacy_leases l ON l.monitor_task_id = t.id
            WHERE t.collect_request_id = r.id AND t.tenant_id = r.tenant_id AND l.status IN {ACTIVE_LEASE_SQL}))
"""

_CANDIDATES = f"""
SELECT r.id FROM monitoring_collect_requests r
WHERE r.status IN ('accepted', 'dispatching', 'running') AND r.ttl_expires_at < now()
  AND (r.status <> 'running' OR NOT {_ACTIVE_EXECUTION_OF_REQUEST})
ORDER BY r.ttl_expires_at
LIMIT %(limit)s
"""

_TIME_OUT = f"""
UPDATE monitoring_collect_requests r
SET status = 'timed_out', finished_at = now(), updated_at = now()
WHERE r.id = %(id)s AND r.status IN ('accepted', 'dispatching', 'running') AND r.ttl_expires_at < now()
  AND (r.status <> 'running' OR NOT {_ACTIVE_EXECUTION_OF_REQUEST})
RETURNING r.id, r.tenant_id, r.status, r.target_client_id, r.requested_task_count, r.dispatched_task_count
"""

_DEMOTE_TASKS = f"""
UPDATE monitoring_collect_tasks t
SET dispatch_lane = 'normal', dispatch_priority = %(normal_priority)s, target_client_id = NULL, updated_at = now()
WHERE t.collect_request_id = %(id)s AND t.tenant_id = %(tenant_id)s AND t.status = 'pending'
  AND t.dispatch_lane = 'high'
  AND NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id
                  AND d.status IN {ACTIVE_EXECUTION_SQL})
"""

_WARN_NO_DISPATCH = """
UPDATE monitoring_collect_requests
SET no_dispatch_warned_at = now(), updated_at = now()
WHERE status = 'accepted' AND dispatched_task_count = 0 AND first_dispatched_at IS NULL
  AND no_dispatch_warned_at IS NULL
  AND created_at < now() - make_interval(secs => %(warn_s)s)
RETURNING id, tenant_id, target_client_id, created_at
"""


async def time_out_one(ctx: JobContext, request_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        cur = await conn.execute(_TIME_OUT, {"id": request_id})
        row = await cur.fetchone()
        if row is None:
            return
        cur = await conn.execute(_DEMOTE_TASKS, {"id": request_id, "tenant_id": row["tenant_id"],
                                                 "normal_priority": NORMAL_PRIORITY})
        result.add("tasks_demoted", cur.rowcount)
    result.fixed += 1
    result.add("timed_out")
    metrics.collect_request_ttl_expired_count.inc()
    log.warning("collect request timed out", extra={
        "collect_request_id": str(request_id), "tenant_id": row["tenant_id"],
        "client_id": str(row["target_client_id"]), "requested": row["requested_task_count"],
        "dispatched": row["dispatched_task_count"]})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    await fix_each(ctx, await candidates(ctx, _CANDIDATES, {}), time_out_one, result, what="request timeout",
                   id_field="collect_request_id")
    async with ctx.conn.transaction():
        cur = await ctx.conn.execute(_WARN_NO_DISPATCH, {"warn_s": ctx.settings.request_no_dispatch_warn_seconds})
        warned = await cur.fetchall()
    for row in warned:
        metrics.collect_request_no_dispatch_warning_count.inc()
        log.warning("collect request accepted but nothing dispatched", extra={
            "collect_request_id": str(row["id"]), "tenant_id": row["tenant_id"],
            "client_id": str(row["target_client_id"]), "created_at": row["created_at"].isoformat(),
            "warn_after_s": ctx.settings.request_no_dispatch_warn_seconds})
    result.add("no_dispatch_warned", len(warned))
    return result


JOB = Job(NAME, "requests past ttl_expires_at -> timed_out; accepted without dispatch -> warning once",
          run, configured_interval(NAME))
