"""Job 2 — collect-request TTL (docs/architecture.md §10.6): requests nobody could serve in time end `timed_out`;
requests accepted without any dispatch for `request_no_dispatch_warn_seconds` raise a warning once.

Decisions: `accepted` / `dispatching` requests past `ttl_expires_at` time out. A `running` request
past its TTL times out only when none of its tasks has an active execution any more (its work
stalled, e.g. every client went away after the first lease); one still executing is left to finish.
The timed-out request's pending tasks that are not executing leave the high lane (normal, unbound):
they are still collected for the day, but no longer preempt anyone for a request the user saw end.
The reads and moves are libs/tasks/requests.py's operations.
"""

from __future__ import annotations

import uuid

from libs.tasks import requests as collect_requests
from libs.telemetry import metrics
from services.reconciler.jobs.base import RETRYABLE_ERRORS, JobContext, JobResult, configured_job, log

NAME = "request_ttl"


async def time_out_one(ctx: JobContext, request_id: uuid.UUID, result: JobResult) -> None:
    async with ctx.conn.transaction():
        timed_out = await collect_requests.time_out(ctx.conn, request_id)
        if timed_out is None:
            return
        result.add("tasks_demoted", timed_out.tasks_demoted)
    result.fixed += 1
    result.add("timed_out")
    metrics.collect_request_ttl_expired_count.inc()
    log.warning("collect request timed out", extra={
        "collect_request_id": str(request_id), "tenant_id": timed_out.tenant_id,
        "client_id": str(timed_out.target_client_id), "requested": timed_out.requested_task_count,
        "dispatched": timed_out.dispatched_task_count})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    # Read without locks, then each one re-checked and timed out in its own transaction; one that lost a race with
    # another writer is left for the next run (base.fix_candidates' rule).
    for request_id in await collect_requests.timed_out_candidates(ctx.conn, limit=ctx.config.batch_size):
        try:
            await time_out_one(ctx, request_id, result)
        except RETRYABLE_ERRORS as exc:
            result.add("skipped_conflict")
            log.warning("request timeout lost a race; retried next run",
                        extra={"collect_request_id": str(request_id), "error": str(exc)})
    async with ctx.conn.transaction():
        warned = await collect_requests.warn_no_dispatch(ctx.conn, warn_s=ctx.settings.request_no_dispatch_warn_seconds)
    for warning in warned:
        metrics.collect_request_no_dispatch_warning_count.inc()
        log.warning("collect request accepted but nothing dispatched", extra={
            "collect_request_id": str(warning.id), "tenant_id": warning.tenant_id,
            "client_id": str(warning.target_client_id), "created_at": warning.created_at.isoformat(),
            "warn_after_s": ctx.settings.request_no_dispatch_warn_seconds})
    result.add("no_dispatch_warned", len(warned))
    return result


JOB = configured_job(NAME, "requests past ttl_expires_at -> timed_out; accepted without dispatch -> warning once", run)
