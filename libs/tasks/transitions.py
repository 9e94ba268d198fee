"""Shared state transitions (docs/architecture.md §7.1 write matrix, §8). Each runs inside the caller's transaction.

Semantics every service relies on:
- `dispatch_attempts` is counted by the coordinator at dispatch; a preemption yield (or a queued
  execution cancelled by collect-now) gives it back, so a yield never consumes a retry.
- On the desktop_tasks path the business row stays `pending` while executing, and only moves to
  completed / failed / skipped / expired. On the legacy path it is `leased` / `received` while a lease lives, and
  ending the lease puts it back to `pending` first (libs/tasks/legacy.py), so the same transitions follow.
- An execution is active while queued / in_progress / unknown (`uq_desktop_tasks_monitor_active`).

Ending an execution or lease is the `Executions` protocol's (libs/tasks/execution_paths.py `end`, `end_many`, with
typed outcomes); the business task's moves that follow it are here.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Literal

import msgspec

from libs.contracts.amqp import LifecycleEvent, LifecycleKind
from libs.db.pool import Conn
from libs.domain.lanes import retry_lane_sql, retry_priority_sql
from libs.mq.topology import LIFECYCLE
from libs.outbox import enqueue
from libs.tasks.outcomes import Stale
from libs.tasks.records import EndedExecution, ExecutionEnd, ExecutionOutcome
from libs.tasks.statuses import CLEAR_LEGACY_LEASE_SQL

__all__ = ["EndedExecution", "ExecutionEnd", "ExecutionOutcome"]

# Notified by collect-now (and anything else latency-sensitive) to wake the coordinator at once.
DISPATCH_WAKE_CHANNEL = "dispatch_wakeup"


_YIELD_BUSINESS = """
UPDATE monitoring_collect_tasks
SET dispatch_attempts = greatest(dispatch_attempts - 1, 0), updated_at = now()
WHERE id = %(id)s AND status = 'pending'
"""

# yield_business_task set-based, for the business tasks of executions ended together (a forced rollback): the
# dispatch attempt given back (lane, priority and enqueued_at kept).
YIELD_BUSINESS_MANY = """
UPDATE monitoring_collect_tasks
SET dispatch_attempts = greatest(dispatch_attempts - 1, 0), updated_at = now()
WHERE id = ANY(%(ids)s::bigint[]) AND status = 'pending'
"""

_RETRY_BUSINESS = f"""
UPDATE monitoring_collect_tasks
SET status = CASE WHEN dispatch_attempts >= %(max_attempts)s THEN 'failed' ELSE 'pending' END,
    dispatch_lane = {retry_lane_sql("dispatch_lane")},
    dispatch_priority = {retry_priority_sql("dispatch_lane", "dispatch_priority")},
    last_error = %(error)s,
    completed_at = CASE WHEN dispatch_attempts >= %(max_attempts)s THEN now() END,
    updated_at = now()
WHERE id = %(id)s AND status = 'pending'
RETURNING status
"""

# Finishing clears a legacy lease still on the row (a result of an earlier lease completed the task while a later one
# was out: that one is ended by ingest's abort of the other active work).
_FINISH_BUSINESS = f"""
UPDATE monitoring_collect_tasks
SET status = %(status)s, completed_at = now(), last_error = %(error)s, updated_at = now(), {CLEAR_LEGACY_LEASE_SQL}
WHERE id = %(id)s AND status NOT IN ('completed', 'skipped', 'expired')
  AND NOT (status = 'failed' AND %(status)s = 'failed')
RETURNING id
"""


class Yielded(msgspec.Struct, frozen=True, tag=True):
    """The business task is pending again with its dispatch attempt given back."""

    monitor_task_id: int


async def yield_business_task(conn: Conn, monitor_task_id: int) -> Yielded | Stale:
    """A preempted (or cancelled-while-queued) execution: back to pending, lane and enqueued_at kept,
    the dispatch attempt given back. Stale: the business task is not pending (finished meanwhile)."""
    cur = await conn.execute(_YIELD_BUSINESS, {"id": monitor_task_id})
    return Yielded(monitor_task_id=monitor_task_id) if cur.rowcount else Stale(status=None)


async def retry_business_task(conn: Conn, monitor_task_id: int, *, max_attempts: int,
                              error: str | None) -> Literal["pending", "failed"] | Stale:
    """A failed or expired execution: pending in the retry lane (high work stays high), or failed once
    `dispatch_attempts` reached `max_attempts`. Returns the new status; Stale: the task was not pending."""
    cur = await conn.execute(_RETRY_BUSINESS, {"id": monitor_task_id, "max_attempts": max_attempts,
                                               "error": error})
    row = await cur.fetchone()
    if row is None:
        return Stale()
    return "failed" if row["status"] == "failed" else "pending"


async def finish_business_task(conn: Conn, monitor_task_id: int, *, status: Literal["completed", "failed"],
                               error: str | None = None) -> bool:
    """Terminal business state. A later success may still turn failed into completed."""
    cur = await conn.execute(_FINISH_BUSINESS, {"id": monitor_task_id, "status": status, "error": error})
    return await cur.fetchone() is not None


_FINISH_BUSINESS_MANY = f"""
UPDATE monitoring_collect_tasks
SET status = %(status)s, completed_at = now(), last_error = NULL, updated_at = now(), {CLEAR_LEGACY_LEASE_SQL}
WHERE id = ANY(%(ids)s::bigint[]) AND status NOT IN ('completed', 'skipped', 'expired')
  AND NOT (status = 'failed' AND %(status)s = 'failed')
RETURNING id
"""


_RETRY_BUSINESS_MANY = f"""
UPDATE monitoring_collect_tasks t
SET status = CASE WHEN t.dispatch_attempts >= %(max_attempts)s THEN 'failed' ELSE 'pending' END,
    dispatch_lane = {retry_lane_sql("t.dispatch_lane")},
    dispatch_priority = {retry_priority_sql("t.dispatch_lane", "t.dispatch_priority")},
    last_error = w.error,
    completed_at = CASE WHEN t.dispatch_attempts >= %(max_attempts)s THEN now() END,
    updated_at = now()
FROM unnest(%(ids)s::bigint[], %(errors)s::text[]) AS w(id, error)
WHERE t.id = w.id AND t.status = 'pending'
RETURNING t.id, t.status
"""


async def retry_business_tasks(conn: Conn, failures: dict[int, str | None], *, max_attempts: int) -> dict[int, str]:
    """`retry_business_task` for many tasks ({monitor_task_id: error}) in one statement; returns the new
    status of each task that was pending."""
    if not failures:
        return {}
    ids = sorted(failures)
    cur = await conn.execute(_RETRY_BUSINESS_MANY, {"ids": ids, "errors": [failures[i] for i in ids],
                                                    "max_attempts": max_attempts})
    return {int(row["id"]): str(row["status"]) for row in await cur.fetchall()}


async def finish_business_tasks(conn: Conn, monitor_task_ids: list[int], *,
                                status: Literal["completed", "failed"]) -> set[int]:
    """`finish_business_task` for many tasks in one statement; returns the ids that moved."""
    if not monitor_task_ids:
        return set()
    cur = await conn.execute(_FINISH_BUSINESS_MANY, {"ids": sorted(set(monitor_task_ids)), "status": status})
    return {int(row["id"]) for row in await cur.fetchall()}


async def emit_lifecycle(conn: Conn, event: LifecycleKind, *, tenant_id: int, client_id: uuid.UUID | None = None,
                         task_id: uuid.UUID | None = None, monitor_task_id: int | None = None,
                         ai_platform_id: int | None = None, lane: str | None = None, reason: str | None = None,
                         collect_request_id: uuid.UUID | None = None, notify: bool = False) -> None:
    """A `monitor.lifecycle` event through the outbox, in the caller's transaction."""
    message = LifecycleEvent(event=event, tenant_id=tenant_id, occurred_at=datetime.now(UTC), client_id=client_id,
                             task_id=task_id, monitor_task_id=monitor_task_id, ai_platform_id=ai_platform_id,
                             lane=lane, reason=reason, collect_request_id=collect_request_id)
    await enqueue(conn, exchange=LIFECYCLE, routing_key=event, message=message, tenant_id=tenant_id, notify=notify)


# An eligible client for dispatch (§10.6): online with a heartbeat in the last N seconds.
ELIGIBLE_CLIENT_SQL = (
    "c.online AND c.disabled_at IS NULL "
    "AND c.last_heartbeat_at > now() - make_interval(secs => %(heartbeat_timeout_s)s)"
)
