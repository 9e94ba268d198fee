"""Job 7 — the §16.2.4 dual-path consistency reconcile, every `reconcile_interval_seconds` (and once when the
reconciler starts).

1. Zombie leases are cleared: legacy lease columns on a business row that no live legacy lease backs (the row says
   `leased` / `received` but its `legacy_leases` row ended, or there is none), and legacy lease columns left on a
   desktop_tasks-owned row; a `leased` / `received` row goes back to `pending`. A legacy lease whose result the hub
   accepted but ingest never applied within `unknown_grace_seconds` (the result was dead-lettered) is ended and its
   business task retried, as the unknown-execution job does for an execution.
2. READY tasks of either path (contract #1) waiting longer than the interval without an execution or a lease are
   counted (`reconciler_migration_stalled_ready_tasks`) and the coordinator is woken (`pg_notify('dispatch_wakeup')`)
   to dispatch them.
3. Owner / execution mismatches are alerts for a human, logged one by one and counted in
   `reconciler_migration_orphan_tasks`: a desktop_tasks-owned task that looks executed (dispatched, or completed /
   failed) with no execution and no legacy lease at all, and a task with live work on the path it is not owned by (a
   live legacy lease on a desktop_tasks-owned task, an active execution on a legacy-owned one).
"""

from __future__ import annotations

import msgspec

from libs.dispatch_settings import DispatchSettings
from libs.ingest.lag import ingest_lag_ms
from libs.tasks import consistency_reads
from libs.tasks.transitions import DISPATCH_WAKE_CHANNEL
from libs.telemetry import metrics
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs.base import Job, JobContext, JobResult, expire_and_retry, log

NAME = "migration_reconcile"
ORPHAN_LOOKBACK_DAYS = 7
ORPHANS_LOGGED = 100

async def _end_lost_legacy_results(ctx: JobContext, result: JobResult) -> None:
    conn = ctx.conn
    async with conn.transaction():
        for lost in await consistency_reads.legacy_results_lost(conn, grace_s=ctx.settings.unknown_grace_seconds,
                                                                limit=ctx.config.batch_size):
            expired = await expire_and_retry(ctx, msgspec.structs.asdict(lost), reason="result_not_applied",
                                             error="the accepted result was never applied")
            if not expired.ended:
                continue
            status = expired.business_status
            result.fixed += 1
            result.add("legacy_results_lost")
            log.warning("legacy lease ended: its accepted result was never applied", extra={
                "task_id": str(lost.id), "monitor_task_id": lost.monitor_task_id, "tenant_id": lost.tenant_id,
                "business_status": status})


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    conn = ctx.conn
    async with conn.transaction():
        cleared = await consistency_reads.clear_zombie_leases(conn)
    for zombie in cleared:
        log.warning("zombie lease cleared", extra={"monitor_task_id": zombie.id, "tenant_id": zombie.tenant_id,
                                                   "execution_owner": zombie.execution_owner,
                                                   "executor": str(zombie.leased_to_executor)})
    result.fixed += len(cleared)
    result.add("zombie_leases_cleared", len(cleared))
    await _end_lost_legacy_results(ctx, result)

    stalled = await consistency_reads.stalled_ready_count(conn, stall_s=ctx.settings.reconcile_interval_seconds)
    metrics.reconciler_migration_stalled_ready_tasks.set(stalled)
    result.add("stalled_ready", stalled)
    if stalled:
        await conn.execute("SELECT pg_notify(%(channel)s, '')", {"channel": DISPATCH_WAKE_CHANNEL})
        log.warning("ready tasks waiting longer than the reconcile interval; coordinator woken",
                    extra={"count": stalled})

    orphans = await consistency_reads.orphans(conn, lookback_days=ORPHAN_LOOKBACK_DAYS)
    metrics.reconciler_migration_orphan_tasks.set(len(orphans))
    result.add("orphans", len(orphans))
    for orphan in orphans[:ORPHANS_LOGGED]:
        log.error(f"ALERT: {orphan.problem}; needs a human", extra={
            "monitor_task_id": orphan.id, "tenant_id": orphan.tenant_id, "status": orphan.status,
            "execution_owner": orphan.execution_owner, "dispatch_attempts": orphan.dispatch_attempts,
            "business_date": orphan.business_date.isoformat()})
    await _observe_for_rollout(ctx, result, orphans=len(orphans))
    return result


# The figures `monitorctl rollout advance` gates a ramp step on (libs/domain/rollout.py), one row a run.
_OBSERVE = """
WITH old AS (DELETE FROM rollout_observations WHERE observed_at < now() - interval '60 days')
INSERT INTO rollout_observations (rollout_percentage, ingest_lag_ms, reconcile_fixes, orphans)
VALUES (%(pct)s, %(lag_ms)s, %(fixed)s, %(orphans)s)
"""


async def _observe_for_rollout(ctx: JobContext, result: JobResult, *, orphans: int) -> None:
    await ctx.conn.execute(_OBSERVE, {"pct": ctx.settings.rollout_percentage, "lag_ms": await ingest_lag_ms(ctx.conn),
                                      "fixed": result.fixed, "orphans": orphans})


def interval(_: ReconcilerConfig, settings: DispatchSettings) -> float:
    return float(max(settings.reconcile_interval_seconds, 1))


JOB = Job(NAME, "§16.2.4: zombie leases cleared, lost legacy results retried, stalled ready tasks woken, "
          "owner/execution mismatches alerted",
          run, interval, phase2_consistency=True)
