"""Job — history retention: finished executions (with their attempts), finished legacy leases and finished collect-now
requests past their retention are deleted in batches (libs/tasks/retention.py), oldest first, so the execution tables
hold a bounded window of history instead of growing with every dispatch and click."""

from __future__ import annotations

from libs.tasks.retention import purge_history_batch
from services.reconciler.jobs.base import JobContext, JobResult, configured_job

NAME = "history_retention"


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    config = ctx.config
    for _ in range(config.retention_batches_per_run):
        purged = await purge_history_batch(ctx.conn, execution_days=config.history_retention_days,
                                           request_days=config.request_retention_days,
                                           batch=config.retention_batch_rows)
        for key in ("executions", "attempts", "legacy_leases", "collect_requests"):
            if n := getattr(purged, key):
                result.add(key, n)
        result.fixed += purged.total
        if max(purged.executions, purged.legacy_leases, purged.collect_requests) < config.retention_batch_rows:
            break  # every table is down to its retention
    return result


JOB = configured_job(NAME, "delete finished executions, attempts, legacy leases and collect-now requests past their "
                           "retention", run)
