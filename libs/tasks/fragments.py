"""SQL fragments the owner modules of libs/tasks compose into their statements (docs/architecture.md §7.1): the
client's interrupt generation a click stamps, the execution path the rollout gives a new task, the active executions'
task ids, the test for a client without a fresh heartbeat."""

from __future__ import annotations

from libs.tasks.statuses import ACTIVE_EXECUTION_SQL

# A click's write phase is pipelined (services/collect_now_api/service.py): statements after the increment read the
# new generation with this subquery (0 when the request is unbound). No other writer changes a client's generation.
CLIENT_GENERATION_SQL = (
    "coalesce((SELECT interrupt_generation FROM desktop_clients "
    "WHERE id = %(client_id)s::uuid AND tenant_id = %(tenant_id)s), 0)"
)


# The execution path of a task this click creates or re-collects (docs/legacy-path.md, rollout): the rollout as
# stored now, not as cached (a rollback applies to the next click). libs.domain.schedule.execution_owner_for in SQL.
ROLLOUT_OWNER_SQL = (
    "CASE WHEN %(tenant_id)s::bigint %% 100 < coalesce((SELECT (v.value #>> '{}')::int FROM dispatch_settings v "
    "WHERE v.key = 'rollout_percentage'), 100) THEN 'desktop_tasks' ELSE 'legacy' END"
)


# Active monitor executions (uq_desktop_tasks_monitor_active's statuses), hashed once: READY_BACKLOG's form.
ACTIVE_TASK_IDS_SQL = (
    "SELECT d.monitor_task_id FROM desktop_tasks d WHERE d.kind = 'monitor' "
    f"AND d.status IN {ACTIVE_EXECUTION_SQL} AND d.monitor_task_id IS NOT NULL"
)


# A client whose last heartbeat is older than %(timeout_s)s (or that never sent one).
STALE_CLIENT_SQL = "(c.last_heartbeat_at IS NULL OR c.last_heartbeat_at < now() - make_interval(secs => %(timeout_s)s))"
