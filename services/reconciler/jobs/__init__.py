"""The registry of reconcile jobs: the service schedules each one on its own interval, and
`monitorctl reconcile --once [--job NAME]` runs them on demand."""

from __future__ import annotations

from services.reconciler.jobs import (
    business_day,
    expired_leases,
    history_retention,
    interrupt_timeouts,
    migration,
    offline_clients,
    request_ttl,
    safe_point_tuning,
    unknown_executions,
)
from services.reconciler.jobs.base import Job, JobContext, JobResult

JOBS: dict[str, Job] = {job.name: job for job in (
    expired_leases.JOB,
    request_ttl.JOB,
    offline_clients.JOB,
    interrupt_timeouts.JOB,
    unknown_executions.JOB,
    business_day.JOB,
    migration.JOB,
    safe_point_tuning.JOB,
    history_retention.JOB,
)}

__all__ = ["JOBS", "Job", "JobContext", "JobResult"]
