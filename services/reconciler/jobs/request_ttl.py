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
from libs.tasks import business
from libs.tasks import requests as collect_requests
from libs.telemetry import metrics
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, fix_candidates, log

NAME = "request_ttl"

_CANDIDATES = f"""
SELECT r.id FROM monitoring_collect_requests r
WHERE r.status IN ('accepted', 'dispatching', 'running') AND r.ttl_expires_at < now()
  AND (r.status <> 'running' OR NOT {collect_requests.ACTIVE_WORK_OF_REQUEST_SQL})
ORDER BY r.ttl_expires_at
LIMIT %(limit)s
"""


async def time_out_one(ctx: JobContext, request_id: uuid.UUID, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        cur = await conn.execute(collect_requests.TIME_OUT, {"id": request_id})
        row = await cur.fetchone()
        if row is None:
            return
        cur = await conn.execute(business.DEMOTE_TIMED_OUT, {"id": request_id, "tenant_id": row["tenant_id"],
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
    await fix_candidates(ctx, result, time_out_one, _CANDIDATES, what="request timeout", id_field="collect_request_id")
    async with ctx.conn.transaction():
        cur = await ctx.conn.execute(collect_requests.WARN_NO_DISPATCH,
                                     {"warn_s": ctx.settings.request_no_dispatch_warn_seconds})
        warned = await cur.fetchall()
    for row in warned:
        metrics.collect_request_no_dispatch_warning_count.inc()
        log.warning("collect request accepted but nothing dispatched", extra={
            "collect_request_id": str(row["id"]), "tenant_id": row["tenant_id"],
            "client_id": str(row["target_client_id"]), "created_at": row["created_at"].isoformat(),
            "warn_after_s": ctx.settings.request_no_dispatch_warn_seconds})
    result.add("no_dispatch_warned", len(warned))
    return result


JOB = configured_job(NAME, "requests past ttl_expires_at -> timed_out; accepted without dispatch -> warning once", run)
