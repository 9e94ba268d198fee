"""Bounded history: finished executions (with their attempts), finished legacy leases and finished collect-now requests
older than their retention are deleted, a batch per transaction, oldest first. Never a live one: what counts as live is
what the partial unique indexes protect (libs/tasks/statuses.py), and each batch locks its rows (SKIP LOCKED: a row a
writer holds is left for the next batch) before deleting them.

Kept: the business tasks (monitoring_collect_tasks: reports, `explain`, the scanner's business keys), the results
(question_monitor_runs, the daily aggregates), and everything younger than the retention, which must cover what the
other readers of these tables look back over (the safe-point window, 7 days; the collect-now rate limits, an hour;
the budget ledger, the current windows)."""

from __future__ import annotations

import msgspec

from libs.db.pool import Conn
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, ACTIVE_LEASE_SQL, sql_list

# A collect-now request is live (its counters still move, its TTL runs) while in one of these.
LIVE_REQUEST_SQL = sql_list(("accepted", "dispatching", "running"))

# Oldest first by creation (ix_desktop_tasks_created), only finished ones, locked.
_DOOMED_EXECUTIONS = f"""
SELECT d.id FROM desktop_tasks d
WHERE d.created_at < now() - make_interval(days => %(days)s) AND d.status NOT IN {ACTIVE_EXECUTION_SQL}
ORDER BY d.created_at
LIMIT %(batch)s
FOR UPDATE SKIP LOCKED
"""
_DELETE_ATTEMPTS = "DELETE FROM desktop_task_attempts WHERE task_id = ANY(%(ids)s::uuid[])"
_DELETE_EXECUTIONS = "DELETE FROM desktop_tasks WHERE id = ANY(%(ids)s::uuid[])"
_DELETE_LEASES = f"""
DELETE FROM legacy_leases WHERE id IN (
    SELECT l.id FROM legacy_leases l
    WHERE l.created_at < now() - make_interval(days => %(days)s) AND l.status NOT IN {ACTIVE_LEASE_SQL}
    ORDER BY l.created_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED)
"""
_DELETE_REQUESTS = f"""
DELETE FROM monitoring_collect_requests WHERE id IN (
    SELECT r.id FROM monitoring_collect_requests r
    WHERE r.created_at < now() - make_interval(days => %(days)s) AND r.status NOT IN {LIVE_REQUEST_SQL}
    ORDER BY r.created_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED)
"""


class Purged(msgspec.Struct):
    """What one batch deleted, per table."""

    executions: int = 0
    attempts: int = 0
    legacy_leases: int = 0
    collect_requests: int = 0

    @property
    def total(self) -> int:
        return self.executions + self.attempts + self.legacy_leases + self.collect_requests


async def purge_history_batch(conn: Conn, *, execution_days: int, request_days: int, batch: int) -> Purged:
    """One batch of each table, in one transaction: at most `batch` executions (and their attempts), legacy leases and
    requests. Zero everywhere when nothing is old enough."""
    purged = Purged()
    async with conn.transaction():
        cur = await conn.execute(_DOOMED_EXECUTIONS, {"days": execution_days, "batch": batch})
        ids = [r["id"] for r in await cur.fetchall()]
        if ids:
            purged.attempts = (await conn.execute(_DELETE_ATTEMPTS, {"ids": ids})).rowcount
            purged.executions = (await conn.execute(_DELETE_EXECUTIONS, {"ids": ids})).rowcount
        purged.legacy_leases = (await conn.execute(_DELETE_LEASES, {"days": execution_days, "batch": batch})).rowcount
        purged.collect_requests = (await conn.execute(_DELETE_REQUESTS, {"days": request_days,
                                                                         "batch": batch})).rowcount
    return purged
