"""The store's operations around the lease protocol (libs/tasks/execution_paths.py) that the hub and the reconciler's
lease jobs need and that are the same on both execution paths: the business task a result is published for, a click
request's marks, another client for a stuck client's high work, an unknown execution's evidence, stale clients.
Module-private SQL constants; those of the request table are its owner's (libs/tasks/requests.py), run here as
operations; the high work's rebinding and unbinding are libs/tasks/business.py's (`rebind_high`,
`unbind_high_of_stale_clients`)."""

from __future__ import annotations

import uuid
from datetime import date, datetime

import msgspec

from libs.db.pool import Conn
from libs.tasks import requests as collect_requests
from libs.tasks.fragments import STALE_CLIENT_SQL
from libs.tasks.outcomes import NotFound
from libs.tasks.records import from_rows
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL

# What a result message needs from the business task.
_RESULT_CONTEXT = """
SELECT t.id, t.collector_type, t.run_mode, t.tenant_id, t.workspace_id, t.brand_id, t.question_id, t.ai_platform_id,
       t.business_date
FROM monitoring_collect_tasks t
WHERE t.id = %(monitor_task_id)s AND t.tenant_id = %(tenant_id)s
"""

# The least loaded other eligible client of the tenant and workspace (where a stuck client's high work goes).
_OTHER_CLIENT = f"""
SELECT c.id, c.interrupt_generation FROM desktop_clients c
WHERE c.tenant_id = %(tenant_id)s AND c.workspace_id = %(workspace_id)s AND c.id <> %(client_id)s
  AND {ELIGIBLE_CLIENT_SQL}
ORDER BY (SELECT count(*) FROM desktop_tasks d
          WHERE d.target_client_id = c.id AND d.status IN ('queued', 'in_progress')) ASC,
         c.last_heartbeat_at DESC
LIMIT 1
"""

# The run row of the business key, if it was written by this execution or after its lease began.
_EVIDENCE = """
SELECT r.status FROM monitoring_collect_tasks t
JOIN question_monitor_runs r
  ON r.tenant_id = t.tenant_id AND r.brand_id = t.brand_id AND r.question_id = t.question_id
 AND r.ai_platform_id = t.ai_platform_id AND r.collector_type = t.collector_type AND r.run_mode = t.run_mode
 AND r.business_date = t.business_date
WHERE t.id = %(monitor_task_id)s
  AND (r.desktop_task_id = %(task_id)s OR (%(leased_at)s::timestamptz IS NOT NULL AND r.updated_at >= %(leased_at)s))
"""

# `online` clients whose last heartbeat is older than %(timeout_s)s: offline.
_MARK_STALE_CLIENTS_OFFLINE = f"""
UPDATE desktop_clients c
SET online = false, offline_since = coalesce(c.offline_since, now()), updated_at = now()
WHERE c.id IN (SELECT c.id FROM desktop_clients c WHERE c.online AND {STALE_CLIENT_SQL}
               ORDER BY c.last_heartbeat_at NULLS FIRST LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
  AND c.online AND {STALE_CLIENT_SQL}
RETURNING c.id, c.tenant_id, c.last_heartbeat_at, c.connected_hub
"""


class ResultContext(msgspec.Struct, frozen=True):
    """The business task a result is published for."""

    id: int
    collector_type: str
    run_mode: str
    tenant_id: int
    workspace_id: int
    brand_id: int
    question_id: int
    ai_platform_id: int
    business_date: date


class OfflineClient(msgspec.Struct, frozen=True):
    id: uuid.UUID
    tenant_id: int
    last_heartbeat_at: datetime | None
    connected_hub: str | None


async def result_context(conn: Conn, monitor_task_id: int | None, *, tenant_id: int) -> ResultContext | NotFound:
    """NotFound: no such business task (any more), or the execution has none (a `publish` one)."""
    if monitor_task_id is None:
        return NotFound()
    cur = await conn.execute(_RESULT_CONTEXT, {"monitor_task_id": monitor_task_id, "tenant_id": tenant_id})
    row = await cur.fetchone()
    return NotFound() if row is None else msgspec.convert(row, ResultContext)


async def mark_request_running(conn: Conn, request_id: uuid.UUID, *, tenant_id: int) -> None:
    """A click's request has work leased (pipelined: nothing read back)."""
    await conn.execute(collect_requests.MARK_RUNNING, {"request_id": request_id, "tenant_id": tenant_id})


async def first_preempt(conn: Conn, request_id: uuid.UUID | str, *, tenant_id: int) -> float | None:
    """A click's interrupt acknowledged: the first one stamps the request; the request's age (ms), None if gone."""
    cur = await conn.execute(collect_requests.FIRST_PREEMPT, {"request_id": request_id, "tenant_id": tenant_id})
    row = await cur.fetchone()
    return float(row["age_ms"]) if row else None


async def other_eligible_client(conn: Conn, *, tenant_id: int, workspace_id: int, client_id: uuid.UUID,
                                heartbeat_timeout_s: float) -> uuid.UUID | None:
    cur = await conn.execute(_OTHER_CLIENT, {"tenant_id": tenant_id, "workspace_id": workspace_id,
                                             "client_id": client_id, "heartbeat_timeout_s": heartbeat_timeout_s})
    row = await cur.fetchone()
    return row["id"] if row else None


async def mark_stale_clients_offline(conn: Conn, *, timeout_s: float, limit: int) -> list[OfflineClient]:
    cur = await conn.execute(_MARK_STALE_CLIENTS_OFFLINE, {"timeout_s": timeout_s, "limit": limit})
    return from_rows(await cur.fetchall(), OfflineClient)


async def run_evidence(conn: Conn, *, monitor_task_id: int, task_id: uuid.UUID,
                       leased_at: datetime | None) -> set[str]:
    """The statuses of the run rows an unknown execution may have written."""
    cur = await conn.execute(_EVIDENCE, {"monitor_task_id": monitor_task_id, "task_id": task_id,
                                         "leased_at": leased_at})
    return {str(r["status"]) for r in await cur.fetchall()}
