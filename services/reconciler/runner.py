"""Running jobs: one run with metrics and logs (`run_job`), and the leader's schedule (`JobScheduler`):
each job in its own loop on its own interval, so a slow or failing job never delays the others."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings, load_settings
from libs.telemetry import metrics
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import Job, JobContext, JobResult

log = logging.getLogger("reconciler")

# After a failed run (database away...), wait at least this long before the next attempt.
ERROR_BACKOFF_SECONDS = 2.0


async def run_job(job: Job, conn: Conn, config: ReconcilerConfig,
                  settings: DispatchSettings | None = None) -> JobResult:
    """One run of one job on `conn`, with its metrics (duration, rows fixed, outcome) and a log line."""
    if settings is None:
        settings = await load_settings(conn)
    started = time.perf_counter()
    try:
        result = await job.run(JobContext(conn=conn, settings=settings, config=config))
    except Exception:
        metrics.reconciler_job_runs_count.inc(reconcile_job=job.name, outcome="error")
        elapsed_ms = (time.perf_counter() - started) * 1000
        metrics.reconciler_job_duration_ms.labels(reconcile_job=job.name).observe(elapsed_ms)
        raise
    duration_ms = (time.perf_counter() - started) * 1000
    metrics.reconciler_job_duration_ms.labels(reconcile_job=job.name).observe(duration_ms)
    metrics.reconciler_job_runs_count.inc(reconcile_job=job.name, outcome="ok")
    metrics.reconciler_job_last_rows_fixed.labels(reconcile_job=job.name).set(result.fixed)
    metrics.reconciler_job_last_success_timestamp.labels(reconcile_job=job.name).set(time.time())
    if result.fixed:
        metrics.reconciler_job_rows_fixed_count.inc(result.fixed, reconcile_job=job.name)
        if job.phase2_consistency:
            metrics.phase2_reconcile_fixed_count.inc(result.fixed, check=job.name)
    level = logging.INFO if result.fixed or any(result.details.values()) else logging.DEBUG
    log.log(level, "reconcile job ran", extra={"job": job.name, "fixed": result.fixed,
                                               "duration_ms": round(duration_ms, 2), **result.details})
    return result


class JobScheduler:
    """Runs every job in its own loop while this replica leads."""

    def __init__(self, pool: AsyncConnectionPool[Conn], config: ReconcilerConfig, jobs: Iterable[Job]) -> None:
        self._pool = pool
        self._config = config
        self._jobs = list(jobs)
        self._wake = {job.name: asyncio.Event() for job in self._jobs}

    def wake(self, name: str) -> None:
        """Run job `name` now instead of at its next interval."""
        event = self._wake.get(name)
        if event is not None:
            event.set()

    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as group:
            for job in self._jobs:
                group.create_task(self._loop(job, stop), name=f"reconcile-{job.name}")

    async def _loop(self, job: Job, stop: asyncio.Event) -> None:
        wake = self._wake[job.name]
        while not stop.is_set():
            wake.clear()
            delay = self._config.intervals.get(job.name, 5.0)
            try:
                async with self._pool.connection() as conn:
                    settings = await load_settings(conn)
                    delay = job.interval(self._config, settings)
                    await run_job(job, conn, self._config, settings)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile job failed; retried at its next interval", extra={"job": job.name})
                delay = max(delay, ERROR_BACKOFF_SECONDS)
            await _wait_any(stop, wake, delay)


async def _wait_any(stop: asyncio.Event, wake: asyncio.Event, timeout: float) -> None:
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(wake.wait())]
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED), timeout)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
