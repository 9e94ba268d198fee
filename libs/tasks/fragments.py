"""SQL fragments the owner modules of libs/tasks compose into their statements (docs/architecture.md §7.1): the
client's interrupt generation a click stamps, the execution path the rollout gives a new task, the active executions'
task ids, the test for a client without a fresh heartbeat, the platforms a client reports a broken login on."""

from __future__ import annotations

from libs.domain.lanes import HELD_FOR_BROKEN_LOGIN_SQL
from libs.domain.platform_health import BLOCKING_STATES
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, sql_list

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


# ---- the platform-health pause (libs/domain/platform_health.py) ------------------------------------------------

# The login states that block a platform's scheduled work on the client reporting them.
BLOCKING_STATES_SQL = sql_list(tuple(sorted(BLOCKING_STATES)))

# The lanes the pause holds back on a client with a broken login (`held_for_broken_login`: all but the click lane, a
# user's collect-now still goes).
HELD_LANES_SQL = HELD_FOR_BROKEN_LOGIN_SQL


def _health_ignored_sql(tenant: str, platform: str) -> str:
    """An operator's `ignore_health` override of the tenant's platform (`tenant`, `platform`: SQL expressions)."""
    return (f"EXISTS (SELECT 1 FROM platform_health_overrides o WHERE o.tenant_id = {tenant} "
            f"AND o.ai_platform_id = {platform} AND o.mode = 'ignore_health')")


# (client_id, tenant_id, ai_platform_id) of every platform one of the clients %(client_ids)s reports a broken login
# on, as stored now, unless the tenant's override ignores health: whose queued normal work a report releases.
BLOCKED_PLATFORMS_OF_CLIENTS_SQL = f"""
SELECT c.id AS client_id, c.tenant_id, p.id AS ai_platform_id
FROM desktop_clients c CROSS JOIN ai_platforms p
WHERE c.id = ANY(%(client_ids)s::uuid[]) AND c.disabled_at IS NULL
  AND c.platform_health ->> p.code IN {BLOCKING_STATES_SQL}
  AND NOT {_health_ignored_sql("c.tenant_id", "p.id")}
"""


def held_for_broken_login_sql(row: str, code: str) -> str:
    """True for work of `row` (a desktop_tasks or legacy_leases alias; `code`: its platform's code) that the lease
    caller %(client_id)s may not take now: normal work of a platform it reports a broken login on, unless the
    tenant's override ignores health. The client's report is read once per statement; a platform it does not report
    is not held (false, never NULL: the caller negates it)."""
    return (f"({row}.lane IN {HELD_LANES_SQL} "
            f"AND coalesce((SELECT hc.platform_health FROM desktop_clients hc WHERE hc.id = %(client_id)s) ->> {code} "
            f"IN {BLOCKING_STATES_SQL}, false) "
            f"AND NOT {_health_ignored_sql(f'{row}.tenant_id', f'{row}.ai_platform_id')})")


# The mode a business task's question runs in on its platform (§10.5: OpenAI quick / deep reasoning), from its plan;
# NULL: the platform's default. `task_id` is the business task id's SQL expression.
def platform_mode_sql(task_id: str) -> str:
    return (f"(SELECT pl.platform_mode FROM monitoring_collect_tasks mt JOIN monitoring_plans pl ON pl.id = mt.plan_id "
            f"WHERE mt.id = {task_id})")


def interrupt_timeout_ms_sql(kind: str, execution: str, platform_settings: str, default_ms: str) -> str:
    """An execution's soft or hard interrupt timeout (ms): its mode's when the platform has values for the mode the
    task runs in (platform_mode_settings), else the platform's, else `default_ms`."""
    column = {"soft": "interrupt_soft_timeout_ms", "hard": "interrupt_hard_timeout_ms"}[kind]
    return (f"coalesce((SELECT pm.{column} FROM platform_mode_settings pm WHERE pm.ai_platform_id = "
            f"{execution}.ai_platform_id AND pm.mode = {platform_mode_sql(f'{execution}.monitor_task_id')}), "
            f"{platform_settings}.{column}, {default_ms})")


# ---- the lease call's capacity (both execution paths) -----------------------------------------------------------

# The client's free monitor slots for this lease: its concurrency minus what it runs on either path, at most
# %(max_tasks)s. No row: not a client of this tenant. A posted result waits for ingest, not for the client: the
# client is free again.
# The slots a client `c` has taken on the legacy path: pulled leases without a posted result.
LEGACY_SLOTS_TAKEN_SQL = """(
    SELECT count(*) FROM legacy_leases l
    WHERE l.target_client_id = c.id AND l.status = 'in_progress' AND l.result_received_at IS NULL)"""

# The free monitor slots of a client `c` (may be negative): its concurrency minus what it runs on either path. The
# lease call's capacity below, and push-lease's at dispatch (libs/tasks/push_leases.py).
CLIENT_FREE_SLOTS_SQL = f"""c.max_concurrent_monitor - (
           SELECT count(*) FROM desktop_tasks d
           WHERE d.target_client_id = c.id AND d.kind = 'monitor' AND d.status = 'in_progress'
             AND d.result_received_at IS NULL) - {LEGACY_SLOTS_TAKEN_SQL}"""

CLIENT_CAPACITY_SQL = f"""
SELECT greatest(0, least(%(max_tasks)s, {CLIENT_FREE_SLOTS_SQL})) AS free
FROM desktop_clients c
WHERE c.id = %(client_id)s AND c.tenant_id = %(tenant_id)s
"""
