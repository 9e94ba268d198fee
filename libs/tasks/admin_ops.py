"""The operator's reads and levers over the task tables (services/dispatch_coordinator/admin.py: `monitorctl status`,
`rollout status`, `rollback`): the ready backlog per lane, active executions and live legacy leases, business tasks
per execution path, and the emergency rollback's preview and its in-flight executions (docs/architecture.md "The task
store: the coordinator's operations", docs/legacy-path.md).

Operations over private statements (module constants composed from the store's fragments: READY is
libs/tasks/ready.py's), answering msgspec Structs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime

import msgspec

from libs.db.pool import Conn
from libs.tasks import fragments, ready, transitions
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL

# ---- the answers -------------------------------------------------------------------------------------------------


class LaneReady(msgspec.Struct, frozen=True):
    """Ready tasks of a lane and the oldest one's wait (ms)."""

    lane: str
    ready: int
    oldest_ms: float


class ClientCounts(msgspec.Struct, frozen=True):
    """Clients eligible for work (online, enabled, heartbeat fresh), online, and registered."""

    eligible: int
    online: int
    registered: int


class PathTasks(msgspec.Struct, frozen=True):
    """Business tasks per execution path (`rollout status`): pending rows (and, of desktop_tasks-owned ones, those with
    an active execution), legacy rows leased and received, and completed since today's start (UTC); and the live
    legacy leases by status (queued: offered, in_progress: pulled)."""

    pending_rows: dict[str, int]
    pending_with_execution: dict[str, int]
    leased: dict[str, int]
    received: dict[str, int]
    completed_today: dict[str, int]
    live_leases: dict[str, int]


class RollbackPreview(msgspec.Struct, frozen=True):
    """What a rollback would change: active executions, pending desktop_tasks-owned tasks, and those of them without
    an active execution."""

    in_flight: int
    pending_desktop_tasks: int
    pending_without_execution: int


class ActiveMonitor(msgspec.Struct, frozen=True):
    """An active monitor execution, with what its cancellation tells the client."""

    id: uuid.UUID
    target_client_id: uuid.UUID
    tenant_id: int
    interrupt_generation: int
    monitor_task_id: int
    collect_request_id: uuid.UUID | None


class PreemptionOutcomes(msgspec.Struct, frozen=True):
    """How the running executions a click asked to yield ended: yielded at a safe point, or force-cancelled at the
    platform's hard timeout."""

    yielded: int
    timed_out: int


# ---- the statements ----------------------------------------------------------------------------------------------

_LANE_BACKLOG = f"""
SELECT t.dispatch_lane AS lane, count(*) AS ready, coalesce(max(extract(epoch FROM (now() - t.enqueued_at))), 0)
       * 1000 AS oldest_ms
FROM monitoring_collect_tasks t WHERE {ready.READY} GROUP BY 1
"""
_EXECUTIONS = f"""
SELECT status, count(*) AS n FROM desktop_tasks
WHERE kind = 'monitor' AND status IN {ACTIVE_EXECUTION_SQL} GROUP BY 1
"""
_CLIENTS_ONLINE = f"""
SELECT count(*) FILTER (WHERE {ELIGIBLE_CLIENT_SQL}) AS eligible, count(*) FILTER (WHERE c.online) AS online,
       count(*) AS registered
FROM desktop_clients c
"""

# What a rollback would change, in one snapshot: active executions (aborted with --force, else left to finish) and
# the pending desktop_tasks-owned tasks (all of them with --force, whose executions are all aborted first; else only
# those without an active execution).
_ROLLBACK_PREVIEW = f"""
SELECT (SELECT count(*) FROM desktop_tasks d
        WHERE d.kind = 'monitor' AND d.status IN {ACTIVE_EXECUTION_SQL}) AS in_flight,
       count(*) AS pending_desktop_tasks,
       count(*) FILTER (WHERE t.id NOT IN ({fragments.ACTIVE_TASK_IDS_SQL})) AS pending_without_execution
FROM monitoring_collect_tasks t
WHERE t.status = 'pending' AND t.execution_owner = 'desktop_tasks'
"""

_ACTIVE_MONITOR = f"""
SELECT id, target_client_id, tenant_id, interrupt_generation, monitor_task_id, collect_request_id
FROM desktop_tasks
WHERE kind = 'monitor' AND status IN {ACTIVE_EXECUTION_SQL}
ORDER BY id
"""

_IN_FLIGHT = f"""
SELECT count(*) AS n FROM desktop_tasks WHERE kind = 'monitor' AND status IN {ACTIVE_EXECUTION_SQL}
"""

# `rollout status`: business tasks per path. Pending (desktop_tasks: without an active execution, whose tasks are in
# flight) over the pending index, legacy leases over ix_collect_tasks_legacy_holder, completed since today's start
# (UTC).
_PENDING_BY_OWNER = f"""
SELECT t.execution_owner AS path, count(*) AS pending_rows,
       count(*) FILTER (WHERE t.execution_owner = 'desktop_tasks'
                        AND t.id IN ({fragments.ACTIVE_TASK_IDS_SQL})) AS with_execution
FROM monitoring_collect_tasks t WHERE t.status = 'pending' GROUP BY 1
"""
_LEASED_BY_OWNER = """
SELECT t.execution_owner AS path, count(*) FILTER (WHERE t.status = 'leased') AS leased,
       count(*) FILTER (WHERE t.status = 'received') AS received
FROM monitoring_collect_tasks t WHERE t.status IN ('leased', 'received') GROUP BY 1
"""
_COMPLETED_TODAY_BY_OWNER = """
SELECT t.execution_owner AS path, count(*) AS n
FROM monitoring_collect_tasks t
WHERE t.status = 'completed' AND t.completed_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
GROUP BY 1
"""
_LIVE_LEASES = """
SELECT status, count(*) AS n FROM legacy_leases WHERE status IN ('queued', 'in_progress') GROUP BY 1
"""

# Running (leased) executions a click asked to yield since the step started, by how they ended: yielded at a safe
# point, or force-cancelled at the platform's hard timeout. Queued ones (lease_epoch 0) are cancelled outright and say
# nothing about the protocol; created_at bounds the scan to ix_desktop_tasks_created (a lease lives minutes).
_PREEMPTIONS = """
SELECT count(*) FILTER (WHERE status = 'aborted' AND interrupt_reason = 'collect_now_preempt') AS yielded,
       count(*) FILTER (WHERE interrupt_reason = 'interrupt_hard_timeout') AS timed_out
FROM desktop_tasks
WHERE kind = 'monitor' AND lease_epoch > 0 AND created_at >= %(since)s - interval '1 day'
  AND interrupted_at >= %(since)s
"""

# ---- the operations ----------------------------------------------------------------------------------------------


async def lane_backlog(conn: Conn) -> list[LaneReady]:
    """Ready tasks per lane (the lanes with any)."""
    cur = await conn.execute(_LANE_BACKLOG)
    return [LaneReady(r["lane"], int(r["ready"]), float(r["oldest_ms"])) for r in await cur.fetchall()]


async def active_executions_by_status(conn: Conn) -> dict[str, int]:
    """Active monitor executions per status (the statuses with any)."""
    cur = await conn.execute(_EXECUTIONS)
    return {r["status"]: int(r["n"]) for r in await cur.fetchall()}


async def active_execution_count(conn: Conn) -> int:
    cur = await conn.execute(_IN_FLIGHT)
    row = await cur.fetchone()
    return int(row["n"]) if row else 0


async def client_counts(conn: Conn, *, heartbeat_timeout_s: int) -> ClientCounts:
    cur = await conn.execute(_CLIENTS_ONLINE, {"heartbeat_timeout_s": heartbeat_timeout_s})
    row = await cur.fetchone()
    assert row is not None  # an aggregate: always one row
    return ClientCounts(int(row["eligible"]), int(row["online"]), int(row["registered"]))


async def path_tasks(conn: Conn) -> PathTasks:
    """Business tasks per execution path and the live legacy leases (run them in one snapshot: the caller's
    transaction)."""
    pending, with_execution, leased, received, completed, live = {}, {}, {}, {}, {}, {}
    for r in await (await conn.execute(_PENDING_BY_OWNER)).fetchall():
        pending[r["path"]], with_execution[r["path"]] = int(r["pending_rows"]), int(r["with_execution"])
    for r in await (await conn.execute(_LEASED_BY_OWNER)).fetchall():
        leased[r["path"]], received[r["path"]] = int(r["leased"]), int(r["received"])
    for r in await (await conn.execute(_COMPLETED_TODAY_BY_OWNER)).fetchall():
        completed[r["path"]] = int(r["n"])
    for r in await (await conn.execute(_LIVE_LEASES)).fetchall():
        live[r["status"]] = int(r["n"])
    return PathTasks(pending_rows=pending, pending_with_execution=with_execution, leased=leased, received=received,
                     completed_today=completed, live_leases=live)


async def rollback_preview(conn: Conn) -> RollbackPreview:
    row = await (await conn.execute(_ROLLBACK_PREVIEW)).fetchone()
    assert row is not None  # an aggregate: always one row
    return RollbackPreview(int(row["in_flight"]), int(row["pending_desktop_tasks"]),
                           int(row["pending_without_execution"]))


async def active_monitor_executions(conn: Conn) -> list[ActiveMonitor]:
    """Every active monitor execution, by id."""
    cur = await conn.execute(_ACTIVE_MONITOR)
    return [msgspec.convert(r, ActiveMonitor) for r in await cur.fetchall()]


async def give_back_dispatch_attempts(conn: Conn, monitor_task_ids: Iterable[int]) -> None:
    """Pending business tasks whose execution was ended by an operator get their dispatch attempt back."""
    await conn.execute(transitions.YIELD_BUSINESS_MANY, {"ids": sorted(set(monitor_task_ids))})


async def preemption_outcomes(conn: Conn, *, since: datetime) -> PreemptionOutcomes:
    """How the running executions interrupted since `since` ended (`monitorctl rollout advance`'s gates)."""
    row = await (await conn.execute(_PREEMPTIONS, {"since": since})).fetchone()
    assert row is not None  # an aggregate: always one row
    return PreemptionOutcomes(int(row["yielded"]), int(row["timed_out"]))
