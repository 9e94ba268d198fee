"""The READY rule (cross-service contract 1) and the active work of a client, as SQL fragments of the store.

One owner: the coordinator's candidate, claim and backlog reads (libs/tasks/dispatch_reads.py,
libs/tasks/backlog_reads.py), the admin reads (libs/tasks/admin_reads.py) and the reconciler's stalled-ready count
(libs/tasks/consistency_reads.py) all compose these. They are fragments for the store's own statements: outside
libs/tasks no module takes them (tests/unit/test_task_store_boundary.py refuses it); a service calls an operation.

The store's SQL is held as module constants (named, with named parameters), not `.sql` files: the statements
compose these fragments, and each module's constants are private (`_NAME`) to it.
"""

from __future__ import annotations

from libs.tasks.statuses import ACTIVE_EXECUTION_SQL

# A business task is READY (cross-service contract 1) when pending on the desktop_tasks path, due, and
# without an active execution.
# A scalar subquery with LIMIT 1, not NOT EXISTS: it stays one index probe of uq_desktop_tasks_monitor_active
# per task whatever the statistics say. NOT EXISTS lets the planner pick an anti-join, which over a backlog
# loaded since the last ANALYZE took ~1.8 s for 10,000 ready tasks. For statements that stop after a few rows;
# aggregates over the whole backlog use READY_BACKLOG.
NO_ACTIVE_EXECUTION = (
    "(SELECT true FROM desktop_tasks d WHERE d.monitor_task_id = t.id AND d.kind = 'monitor' "
    f"AND d.status IN {ACTIVE_EXECUTION_SQL} LIMIT 1) IS NULL"
)
READY = f"t.status = 'pending' AND t.dispatch_after <= now() AND {NO_ACTIVE_EXECUTION}"
# READY for aggregates over the whole backlog (the gauges, aging's count, the reconciler's stalled count): the active
# executions are read once into a hashed set (NOT IN over an uncorrelated subquery: a "hashed SubPlan" while the
# active executions fit in work_mem, i.e. up to ~100,000 of them) instead of NO_ACTIVE_EXECUTION's probe per task,
# which cost 110-120 ms a statement over a 10,000-task backlog (6-11 ms now), twice every maintenance tick, on the
# cores collect-now shares. monitor_task_id IS NOT NULL keeps NOT IN's NULL semantics out of it.
NOT_ACTIVE_HASHED = (
    "t.id NOT IN (SELECT d.monitor_task_id FROM desktop_tasks d WHERE d.kind = 'monitor' "
    f"AND d.status IN {ACTIVE_EXECUTION_SQL} AND d.monitor_task_id IS NOT NULL)"
)
READY_BACKLOG = f"t.status = 'pending' AND t.dispatch_after <= now() AND {NOT_ACTIVE_HASHED}"

# The same test for the candidate scans, which walk an index in dispatch order and stop at a LIMIT: the
# LATERAL .. LIMIT 1 forces one probe of `uq_desktop_tasks_monitor_active` per row walked (the planner
# cannot turn it into an unparameterised anti-join, which with stale statistics, e.g. right after the
# scanner created 20,000 tasks, re-scanned every active execution for every candidate). Use with
# ACTIVE_PROBE in the FROM clause.
ACTIVE_PROBE = (
    "LEFT JOIN LATERAL (SELECT true AS busy FROM desktop_tasks d WHERE d.monitor_task_id = t.id "
    f"AND d.kind = 'monitor' AND d.status IN {ACTIVE_EXECUTION_SQL} LIMIT 1) act ON true"
)
READY_PROBED = (
    "t.status = 'pending' AND t.dispatch_after <= now() AND act.busy IS NULL"
)

# The monitor work a client holds or has been sent, on both paths: queued or in-progress executions, and legacy offers
# (queued) and leases (in_progress) (docs/legacy-path.md). Client concurrency, queue depth and platform concurrency
# count both alike.
ACTIVE_WORK = """(
    SELECT d.target_client_id, d.tenant_id, d.ai_platform_id, d.status, d.lane, d.control_flags, d.interrupted_at,
           d.monitor_task_id
    FROM desktop_tasks d WHERE d.kind = 'monitor' AND d.status IN ('queued', 'in_progress')
    UNION ALL
    SELECT l.target_client_id, l.tenant_id, l.ai_platform_id, l.status, l.lane, l.control_flags,
           NULL::timestamptz, l.monitor_task_id
    FROM legacy_leases l WHERE l.status IN ('queued', 'in_progress'))"""
