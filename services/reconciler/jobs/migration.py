"""Job 7 — the §16.2.4 dual-path consistency reconcile, every `reconcile_interval_seconds`.

1. Legacy zombie leases (`execution_owner='legacy'`, lease expired) are cleared; a `leased` row goes
   back to `pending`. Legacy lease columns left on a desktop_tasks-owned row (the legacy path leased
   after the owner switched: forbidden) are cleared too.
2. desktop_tasks-owned READY tasks (contract #1) waiting longer than the interval without an active
   execution are counted (`reconciler_migration_stalled_ready_tasks`) and the coordinator is woken
   (`pg_notify('dispatch_wakeup')`) to dispatch them.
3. desktop_tasks-owned tasks that look executed (dispatched or terminal completed/failed) but have
   no desktop_tasks row at all are alerts for a human: logged one by one and counted in
   `reconciler_migration_orphan_tasks`.
"""

from __future__ import annotations

from libs.dispatch_settings import DispatchSettings
from libs.tasks.transitions import DISPATCH_WAKE_CHANNEL
from libs.telemetry import metrics
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs.base import Job, JobContext, JobResult, log

NAME = "migration_reconcile"
ORPHAN_LOOKBACK_DAYS = 7
ORPHANS_LOGGED = 100

_CLEAR_LEGACY_ZOMBIES = """
UPDATE monitoring_collect_tasks
SET status = CASE WHEN status = 'leased' THEN 'pending' ELSE status END,
    lease_token_hash = NULL, leased_to_executor = NULL, leased_at = NULL, lease_expires_at = NULL,
    updated_at = now()
WHERE leased_to_executor IS NOT NULL
  AND ((execution_owner = 'legacy' AND lease_expires_at < now()) OR execution_owner = 'desktop_tasks')
RETURNING id, tenant_id, execution_owner, leased_to_executor
"""

_STALLED_READY = """
SELECT count(*) AS n FROM monitoring_collect_tasks t
WHERE t.status = 'pending' AND t.execution_owner = 'desktop_tasks' AND t.dispatch_after <= now()
  AND coalesce(t.last_dispatched_at, t.enqueued_at) < now() - make_interval(secs => %(stall_s)s)
  AND NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id
                  AND d.status IN ('queued', 'in_progress', 'unknown'))
"""

_ORPHANS = """
SELECT t.id, t.tenant_id, t.status, t.dispatch_attempts, t.last_dispatched_at, t.business_date
FROM monitoring_collect_tasks t
WHERE t.execution_owner = 'desktop_tasks'
  AND t.business_date >= current_date - %(lookback_days)s::int
  AND (t.last_dispatched_at IS NOT NULL OR t.dispatch_attempts > 0 OR t.status IN ('completed', 'failed'))
  AND NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id)
ORDER BY t.id
"""


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    conn = ctx.conn
    async with conn.transaction():
        cur = await conn.execute(_CLEAR_LEGACY_ZOMBIES)
        cleared = await cur.fetchall()
    for row in cleared:
        log.warning("zombie lease cleared", extra={"monitor_task_id": row["id"], "tenant_id": row["tenant_id"],
                                                   "execution_owner": row["execution_owner"],
                                                   "executor": str(row["leased_to_executor"])})
    result.fixed += len(cleared)
    result.add("zombie_leases_cleared", len(cleared))

    cur = await conn.execute(_STALLED_READY, {"stall_s": ctx.settings.reconcile_interval_seconds})
    count = await cur.fetchone()
    stalled = int(count["n"]) if count else 0
    metrics.reconciler_migration_stalled_ready_tasks.set(stalled)
    result.add("stalled_ready", stalled)
    if stalled:
        await conn.execute("SELECT pg_notify(%(channel)s, '')", {"channel": DISPATCH_WAKE_CHANNEL})
        log.warning("ready desktop_tasks-owned tasks without an active execution; coordinator woken",
                    extra={"count": stalled})

    cur = await conn.execute(_ORPHANS, {"lookback_days": ORPHAN_LOOKBACK_DAYS})
    orphans = await cur.fetchall()
    metrics.reconciler_migration_orphan_tasks.set(len(orphans))
    result.add("orphans", len(orphans))
    for orphan in orphans[:ORPHANS_LOGGED]:
        log.error("ALERT: desktop_tasks-owned business task has no execution record; needs a human", extra={
            "monitor_task_id": orphan["id"], "tenant_id": orphan["tenant_id"], "status": orphan["status"],
            "dispatch_attempts": orphan["dispatch_attempts"],
            "business_date": orphan["business_date"].isoformat()})
    return result


def interval(_: ReconcilerConfig, settings: DispatchSettings) -> float:
    return float(max(settings.reconcile_interval_seconds, 1))


JOB = Job(NAME, "§16.2.4: legacy zombie leases cleared, stalled ready tasks woken, orphan tasks alerted",
          run, interval, phase2_consistency=True)
