"""The reads of `monitorctl explain` (services/dispatch_coordinator/explain.py): one business task, its live work on
either path, where it stands in its lane, and the ready backlog around it (docs/architecture.md "The task store: the
coordinator's operations").

Operations over private statements (module constants; READY is libs/tasks/ready.py's, the coordinator's own rule),
answering msgspec Structs. The pass's snapshot that explain also reads is libs/tasks/dispatch_reads.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import date, datetime

import msgspec

from libs.db.pool import Conn
from libs.tasks import ready

# ---- the answers -------------------------------------------------------------------------------------------------


class ExplainedTask(msgspec.Struct, frozen=True):
    """A business task as explain shows it (`not_due`: dispatch_after is in the future; `enqueued_epoch` in epoch
    seconds; `waited_ms` since it was enqueued)."""

    id: int
    tenant_id: int
    workspace_id: int
    brand_id: int
    question_id: int
    ai_platform_id: int
    business_date: date
    status: str
    lane: str
    priority: int
    target_client_id: uuid.UUID | None
    execution_owner: str
    dispatch_after: datetime
    not_due: bool
    enqueued_at: datetime
    enqueued_epoch: float
    dispatch_attempts: int
    aging_boost: int
    collect_request_id: uuid.UUID | None
    last_dispatched_at: datetime | None
    waited_ms: float


class ActiveExecution(msgspec.Struct, frozen=True):
    """The task's execution queued, running or unknown."""

    id: uuid.UUID
    status: str
    target_client_id: uuid.UUID
    lane: str
    created_at: datetime
    leased_at: datetime | None


class LiveLegacyLease(msgspec.Struct, frozen=True):
    """The live lease of a legacy-path task (docs/legacy-path.md)."""

    id: uuid.UUID
    status: str
    target_client_id: uuid.UUID
    lane: str
    created_at: datetime
    leased_at: datetime | None
    execution_phase: str | None
    lease_expires_at: datetime | None


class LanePosition(msgspec.Struct, frozen=True):
    """Ready tasks ahead of a task in its lane (all, and its tenant's), in higher lanes, and the tenants in its lane."""

    ahead_in_lane: int
    ahead_in_lane_same_tenant: int
    in_higher_lanes: int
    tenants_in_lane: int


# ---- the statements ----------------------------------------------------------------------------------------------

_TASK = """
SELECT t.id, t.tenant_id, t.workspace_id, t.brand_id, t.question_id, t.ai_platform_id, t.business_date, t.status,
       t.dispatch_lane AS lane, t.dispatch_priority AS priority, t.target_client_id, t.execution_owner,
       t.dispatch_after, t.dispatch_after > now() AS not_due, t.enqueued_at,
       extract(epoch FROM t.enqueued_at)::float8 AS enqueued_epoch, t.dispatch_attempts, t.aging_boost,
       t.collect_request_id, t.last_dispatched_at, extract(epoch FROM (now() - t.enqueued_at)) * 1000 AS waited_ms
FROM monitoring_collect_tasks t WHERE t.id = %(id)s
"""
_EXECUTION_TASK = "SELECT monitor_task_id FROM desktop_tasks WHERE id = %(id)s AND kind = 'monitor'"
_ACTIVE = """
SELECT id, status, target_client_id, lane, created_at, leased_at FROM desktop_tasks
WHERE monitor_task_id = %(id)s AND kind = 'monitor' AND status IN ('queued', 'in_progress', 'unknown')
"""
# The live lease of a legacy-path task (docs/legacy-path.md).
_LEGACY_LEASE = """
SELECT l.id, l.status, l.target_client_id, l.lane, l.created_at, l.leased_at, l.execution_phase,
       t.lease_expires_at
FROM monitoring_collect_tasks t JOIN legacy_leases l ON l.id = t.legacy_lease_id
WHERE t.id = %(id)s
"""
_POSITION = f"""
SELECT count(*) FILTER (WHERE t.dispatch_lane = %(lane)s AND (t.dispatch_priority > %(priority)s OR
            (t.dispatch_priority = %(priority)s AND (t.enqueued_at, t.id) < (%(enqueued_at)s, %(id)s))))
           AS ahead_in_lane,
       count(*) FILTER (WHERE t.tenant_id = %(tenant_id)s AND t.dispatch_lane = %(lane)s AND
            (t.dispatch_priority > %(priority)s OR
             (t.dispatch_priority = %(priority)s AND (t.enqueued_at, t.id) < (%(enqueued_at)s, %(id)s))))
           AS ahead_in_lane_same_tenant,
       count(*) FILTER (WHERE t.dispatch_lane = ANY(%(higher)s)) AS in_higher_lanes,
       count(DISTINCT t.tenant_id) FILTER (WHERE t.dispatch_lane = %(lane)s) AS tenants_in_lane
FROM monitoring_collect_tasks t WHERE {ready.READY}
"""
_TENANT_BACKLOG = f"""
SELECT t.dispatch_lane AS lane, count(*) AS n FROM monitoring_collect_tasks t
WHERE t.tenant_id = %(tenant_id)s AND {ready.READY} GROUP BY 1
"""
_HIGH_BACKLOG = f"SELECT count(*) AS n FROM monitoring_collect_tasks t WHERE t.dispatch_lane = 'high' AND {ready.READY}"
_NORMAL_WORK = f"""
SELECT EXISTS (SELECT 1 FROM monitoring_collect_tasks t
               WHERE t.dispatch_lane IN ('normal', 'normal_boosted', 'retry') AND {ready.READY}) AS any
"""


# ---- the operations ----------------------------------------------------------------------------------------------


async def task_of_execution(conn: Conn, execution_id: uuid.UUID) -> int | None:
    """The business task of a monitor execution (None: no such execution)."""
    cur = await conn.execute(_EXECUTION_TASK, {"id": execution_id})
    row = await cur.fetchone()
    return None if row is None else int(row["monitor_task_id"])


async def task(conn: Conn, task_id: int) -> ExplainedTask | None:
    cur = await conn.execute(_TASK, {"id": task_id})
    row = await cur.fetchone()
    return None if row is None else msgspec.convert(row, ExplainedTask)


async def active_execution(conn: Conn, task_id: int) -> ActiveExecution | None:
    cur = await conn.execute(_ACTIVE, {"id": task_id})
    row = await cur.fetchone()
    return None if row is None else msgspec.convert(row, ActiveExecution)


async def legacy_lease(conn: Conn, task_id: int) -> LiveLegacyLease | None:
    """The legacy lease the task's row names (None: none)."""
    cur = await conn.execute(_LEGACY_LEASE, {"id": task_id})
    row = await cur.fetchone()
    return None if row is None else msgspec.convert(row, LiveLegacyLease)


async def lane_position(conn: Conn, t: ExplainedTask, *, higher_lanes: Sequence[str]) -> LanePosition:
    """Where the ready task `t` stands: ahead of it in its lane (by priority, then age), in `higher_lanes`, and how
    many tenants share its lane."""
    cur = await conn.execute(_POSITION, {"lane": t.lane, "priority": t.priority, "enqueued_at": t.enqueued_at,
                                         "id": t.id, "tenant_id": t.tenant_id, "higher": list(higher_lanes)})
    row = await cur.fetchone()
    assert row is not None  # an aggregate: always one row
    return LanePosition(**{k: int(v) for k, v in row.items()})


async def tenant_ready_backlog(conn: Conn, tenant_id: int) -> dict[str, int]:
    """The tenant's ready tasks per lane."""
    cur = await conn.execute(_TENANT_BACKLOG, {"tenant_id": tenant_id})
    return {r["lane"]: int(r["n"]) for r in await cur.fetchall()}


async def high_ready_count(conn: Conn) -> int:
    """Ready high tasks."""
    cur = await conn.execute(_HIGH_BACKLOG)
    row = await cur.fetchone()
    return int(row["n"]) if row else 0


async def normal_has_work(conn: Conn) -> bool:
    """Is any normal, normal_boosted or retry task ready?"""
    cur = await conn.execute(_NORMAL_WORK)
    row = await cur.fetchone()
    return bool(row and row["any"])
