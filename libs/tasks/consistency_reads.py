"""The consistency of the two execution paths, read and repaired: the reconciler's §16.2.4 job
(services/reconciler/jobs/migration.py) and the coordinator's start-up check (docs/architecture.md "The task store:
the coordinator's operations", docs/legacy-path.md).

Operations over private statements (module constants; the path checks compose libs/tasks/legacy.py's, the stalled
count the READY rule of libs/tasks/ready.py: one owner for the coordinator and the reconciler), answering msgspec
Structs.
"""

from __future__ import annotations

import uuid
from datetime import date

import msgspec

from libs.db.pool import Conn
from libs.tasks import legacy, ready

# ---- the answers -------------------------------------------------------------------------------------------------


class PathsInFlight(msgspec.Struct, frozen=True):
    """Work in flight per execution path: active executions, live legacy leases (offered and pulled)."""

    desktop_tasks: int
    legacy: int


class PathProblem(msgspec.Struct, frozen=True):
    """A business task for a human: live work on the path it is not owned by, or (the orphans) executed without any
    record of an execution."""

    id: int
    tenant_id: int
    status: str
    execution_owner: str
    dispatch_attempts: int
    business_date: date
    problem: str


class ZombieLease(msgspec.Struct, frozen=True):
    """A business row whose legacy lease columns no live legacy lease backed: cleared (and pending again when it said
    leased / received)."""

    id: int
    tenant_id: int
    execution_owner: str
    leased_to_executor: uuid.UUID | None


class LostLegacyResult(msgspec.Struct, frozen=True):
    """A legacy lease whose accepted result never reached the raw facts (dead-lettered), locked (SKIP LOCKED)."""

    id: uuid.UUID
    monitor_task_id: int
    tenant_id: int
    target_client_id: uuid.UUID
    ai_platform_id: int
    lane: str
    lease_epoch: int
    collect_request_id: uuid.UUID | None


# ---- the statements ----------------------------------------------------------------------------------------------

# Legacy leases whose accepted result never reached the raw facts (dead-lettered): ended, business task retried.
_LEGACY_RESULTS_LOST = """
SELECT l.id, l.monitor_task_id, l.tenant_id, l.target_client_id, l.ai_platform_id, l.lane, l.lease_epoch,
       l.collect_request_id
FROM legacy_leases l
WHERE l.status = 'in_progress' AND l.result_received_at < now() - make_interval(secs => %(grace_s)s)
  AND NOT EXISTS (SELECT 1 FROM ingest_applied_results a WHERE a.task_id = l.id)
ORDER BY l.id
LIMIT %(limit)s
FOR UPDATE OF l SKIP LOCKED
"""

# READY tasks (contract 1, the coordinator's rule in its whole-backlog form) waiting longer than `stall_s` since they
# were last dispatched or enqueued.
_STALLED_READY = f"""
SELECT count(*) AS n FROM monitoring_collect_tasks t
WHERE {ready.READY_BACKLOG}
  AND coalesce(t.last_dispatched_at, t.enqueued_at) < now() - make_interval(secs => %(stall_s)s)
"""

_ORPHANS = f"""
SELECT t.id, t.tenant_id, t.status, t.execution_owner, t.dispatch_attempts, t.business_date,
       'executed without an execution record' AS problem
FROM monitoring_collect_tasks t
WHERE t.execution_owner = 'desktop_tasks'
  AND t.business_date >= current_date - %(lookback_days)s::int
  AND (t.last_dispatched_at IS NOT NULL OR t.dispatch_attempts > 0 OR t.status IN ('completed', 'failed'))
  AND NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id)
  AND NOT EXISTS (SELECT 1 FROM legacy_leases l WHERE l.monitor_task_id = t.id)
UNION ALL
{legacy.PATH_MISMATCHES}
ORDER BY 1
"""

# ---- the operations ----------------------------------------------------------------------------------------------


def _problems(rows: list[dict[str, object]]) -> list[PathProblem]:
    return [msgspec.convert(r, PathProblem) for r in rows]


async def in_flight_by_path(conn: Conn) -> PathsInFlight:
    """Active executions and live legacy leases, counted."""
    cur = await conn.execute(legacy.IN_FLIGHT_BY_PATH)
    row = await cur.fetchone()
    assert row is not None
    return PathsInFlight(int(row["desktop_tasks"]), int(row["legacy"]))


async def path_mismatches(conn: Conn) -> list[PathProblem]:
    """Tasks with live work on the path they are not owned by."""
    cur = await conn.execute(legacy.PATH_MISMATCHES)
    return _problems(await cur.fetchall())


async def orphans(conn: Conn, *, lookback_days: int) -> list[PathProblem]:
    """The path mismatches, and the desktop_tasks-owned tasks of the last `lookback_days` days that look executed
    (dispatched, or completed / failed) with no execution and no legacy lease at all; by task id."""
    cur = await conn.execute(_ORPHANS, {"lookback_days": lookback_days})
    return _problems(await cur.fetchall())


async def clear_zombie_leases(conn: Conn) -> list[ZombieLease]:
    """Legacy lease columns that no live legacy lease backs (or on a desktop_tasks-owned row) are cleared; a leased /
    received row goes back to pending. The rows cleared."""
    cur = await conn.execute(legacy.CLEAR_ZOMBIE_LEASES)
    return [ZombieLease(r["id"], r["tenant_id"], r["execution_owner"], r["leased_to_executor"])
            for r in await cur.fetchall()]


async def legacy_results_lost(conn: Conn, *, grace_s: float, limit: int) -> list[LostLegacyResult]:
    """Up to `limit` legacy leases whose result was accepted over `grace_s` ago and never applied, locked (SKIP
    LOCKED: in the caller's transaction)."""
    cur = await conn.execute(_LEGACY_RESULTS_LOST, {"grace_s": grace_s, "limit": limit})
    return [msgspec.convert(r, LostLegacyResult) for r in await cur.fetchall()]


async def stalled_ready_count(conn: Conn, *, stall_s: float) -> int:
    """READY tasks waiting longer than `stall_s` since they were last dispatched (or enqueued)."""
    cur = await conn.execute(_STALLED_READY, {"stall_s": stall_s})
    row = await cur.fetchone()
    return int(row["n"]) if row else 0
