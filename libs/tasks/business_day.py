"""The business-day sweep's reads and move (services/reconciler/jobs/business_day.py, docs/architecture.md "State
machines"): business tasks of a business date that is over in the tenant's time zone, pending (or, on the legacy path,
leased or received), are found, locked one by one, their live work listed on both paths, and they end `expired`.
Ending the live work is libs/tasks/transitions.py's; the request's recount, libs/tasks/requests.py's.

The tenant's "today" is computed by Postgres from tenants.time_zone (IANA name). The SQL is module-private `_NAME`
constants (docs/architecture.md "The task store: the click's and ingest's operations").
"""

from __future__ import annotations

import uuid
from datetime import date

import msgspec

from libs.db.pool import Conn
from libs.tasks.business import EXPIRE as _EXPIRE
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL

# Per tenant, its overdue live tasks oldest first (ix_collect_tasks_live_tenant_date, migration 076: a probe of the
# live tasks, never of the finished history), then the oldest of them all: the same `limit` tasks as one walk of every
# live task by date would give.
_CANDIDATES = """
SELECT c.id FROM tenants tn
CROSS JOIN LATERAL (
    SELECT t.id, t.business_date FROM monitoring_collect_tasks t
    WHERE t.tenant_id = tn.id AND t.status IN ('pending', 'leased', 'received')
      AND t.business_date < (now() AT TIME ZONE tn.time_zone)::date
    ORDER BY t.business_date, t.id
    LIMIT %(limit)s) c
ORDER BY c.business_date, c.id
LIMIT %(limit)s
"""

_LOCK = """
SELECT t.id, t.tenant_id, t.business_date, t.collect_request_id, t.execution_owner
FROM monitoring_collect_tasks t JOIN tenants tn ON tn.id = t.tenant_id
WHERE t.id = %(id)s AND t.status IN ('pending', 'leased', 'received')
  AND t.business_date < (now() AT TIME ZONE tn.time_zone)::date
FOR UPDATE OF t SKIP LOCKED
"""

_ACTIVE = f"""
SELECT id, target_client_id, status, interrupt_generation, lane, ai_platform_id, collect_request_id
FROM desktop_tasks
WHERE monitor_task_id = %(id)s AND status IN {ACTIVE_EXECUTION_SQL}
FOR UPDATE
"""

# On the legacy path: its live lease (ending it puts the business row back to pending, then it expires).
_ACTIVE_LEGACY = """
SELECT id, target_client_id, status, interrupt_generation, lane, ai_platform_id, collect_request_id
FROM legacy_leases
WHERE monitor_task_id = %(id)s AND status IN ('queued', 'in_progress')
FOR UPDATE
"""


class ExpiringTask(msgspec.Struct, frozen=True):
    """A business task of a business date that is over, locked."""

    id: int
    tenant_id: int
    business_date: date
    collect_request_id: uuid.UUID | None
    execution_owner: str


class LiveWork(msgspec.Struct, frozen=True):
    """An active execution or a live legacy lease of an expiring task, locked; `status` is its own (an `unknown`
    execution's client is not told)."""

    id: uuid.UUID
    target_client_id: uuid.UUID
    status: str
    interrupt_generation: int
    lane: str
    ai_platform_id: int | None
    collect_request_id: uuid.UUID | None


async def expiring_task_ids(conn: Conn, *, limit: int) -> list[int]:
    """Business tasks of a business date that is over (oldest date first, at most `limit`), read without locks."""
    cur = await conn.execute(_CANDIDATES, {"limit": limit})
    return [int(row["id"]) for row in await cur.fetchall()]


async def lock_expiring_task(conn: Conn, task_id: int) -> ExpiringTask | None:
    """The task, locked, if its business date is still over and it is still pending, leased or received; None when
    it no longer is, or another writer holds it (SKIP LOCKED: left for the next run)."""
    cur = await conn.execute(_LOCK, {"id": task_id})
    row = await cur.fetchone()
    if row is None:
        return None
    return ExpiringTask(id=int(row["id"]), tenant_id=int(row["tenant_id"]), business_date=row["business_date"],
                        collect_request_id=row["collect_request_id"], execution_owner=row["execution_owner"])


async def live_work(conn: Conn, task_id: int) -> list[LiveWork]:
    """The task's active executions, then its live legacy lease, locked."""
    found = []
    for statement in (_ACTIVE, _ACTIVE_LEGACY):
        cur = await conn.execute(statement, {"id": task_id})
        found += [LiveWork(id=r["id"], target_client_id=r["target_client_id"], status=r["status"],
                           interrupt_generation=int(r["interrupt_generation"]), lane=r["lane"],
                           ai_platform_id=r["ai_platform_id"], collect_request_id=r["collect_request_id"])
                  for r in await cur.fetchall()]
    return found


async def expire(conn: Conn, task_id: int) -> bool:
    """pending -> expired (its business day is over); False when it was not pending (live work not ended yet)."""
    cur = await conn.execute(_EXPIRE, {"id": task_id})
    return cur.rowcount > 0
