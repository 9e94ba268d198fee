"""Job — history retention: finished executions (with their attempts), finished legacy leases, finished collect-now
requests and finished business tasks past their retention are deleted in batches (libs/tasks/retention.py), oldest
first, so the task tables hold a bounded window of history instead of growing with every scan, dispatch and click
(docs/architecture.md "History retention")."""

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
                                           business_days=config.business_task_retention_days,
                                           batch=config.retention_batch_rows)
        for key in ("executions", "attempts", "legacy_leases", "collect_requests", "business_tasks"):
            if n := getattr(purged, key):
                result.add(key, n)
        result.fixed += purged.total
        if max(purged.executions, purged.legacy_leases, purged.collect_requests,
               purged.business_tasks) < config.retention_batch_rows:
            break  # every table is down to its retention
    return result


JOB = configured_job(NAME, "delete finished executions, attempts, legacy leases, collect-now requests and business "
                           "tasks past their retention", run)
