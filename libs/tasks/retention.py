"""Bounded history: finished executions (with their attempts), finished legacy leases and finished collect-now requests
older than their retention, and finished business tasks of a business date older than theirs, are deleted, a batch
per transaction, oldest first. Never a live one: what counts as live is what the partial unique indexes protect
(libs/tasks/statuses.py; for a business task, the statuses the coordinator, the click and the business-day sweep still
move), and each batch locks its rows (SKIP LOCKED: a row a writer holds is left for the next batch) before deleting
them. A business task goes only once no execution and no legacy lease refers to it (their foreign keys have no ON
DELETE: the executions' shorter retention takes them first).

Kept: the results (question_monitor_runs, the daily aggregates: the reports read those, keyed by business key, not the
business tasks), and everything younger than its retention, which must cover what the other readers of these tables
look back over (the safe-point window, 7 days; the collect-now rate limits, an hour; the budget ledger, the current
windows; the orphan check of the migration reconcile, 7 days of business tasks with their executions; `explain`, a
task of the last days). docs/architecture.md "History retention"."""

from __future__ import annotations

import msgspec

from libs.db.pool import Conn
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, ACTIVE_LEASE_SQL, FINISHED_BUSINESS_SQL, sql_list

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
# Oldest business date first (ix_collect_tasks_business_date_all), only finished ones (a pending, leased or received
# one is live however old: the business-day sweep expires it; the scanner and a click create or promote only today's)
# that no execution or legacy lease refers to any more, locked. The references are scalar subqueries, one index probe
# per candidate (ix_desktop_tasks_monitor_task, ix_legacy_leases_monitor_task): as NOT EXISTS the planner hashes the
# whole of desktop_tasks for an anti-join (measured: a sequential scan of 227,000 executions for a 2,000-row batch).
# The date is UTC's: a tenant's business day is at most a day away from it, far inside any retention allowed.
_DOOMED_BUSINESS_TASKS = f"""
SELECT t.id FROM monitoring_collect_tasks t
WHERE t.business_date < (now() AT TIME ZONE 'UTC')::date - %(days)s::int
  AND t.status IN {FINISHED_BUSINESS_SQL}
  AND (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id LIMIT 1) IS NULL
  AND (SELECT 1 FROM legacy_leases l WHERE l.monitor_task_id = t.id LIMIT 1) IS NULL
ORDER BY t.business_date
LIMIT %(batch)s
FOR UPDATE OF t SKIP LOCKED
"""
_DELETE_BUSINESS_TASKS = "DELETE FROM monitoring_collect_tasks WHERE id = ANY(%(ids)s::bigint[])"


class Purged(msgspec.Struct):
    """What one batch deleted, per table."""

    executions: int = 0
    attempts: int = 0
    legacy_leases: int = 0
    collect_requests: int = 0
    business_tasks: int = 0

    @property
    def total(self) -> int:
        return self.executions + self.attempts + self.legacy_leases + self.collect_requests + self.business_tasks


async def purge_history_batch(conn: Conn, *, execution_days: int, request_days: int, business_days: int,
                              batch: int) -> Purged:
    """One batch of each table, in one transaction: at most `batch` executions (and their attempts), legacy leases,
    requests and business tasks (after the executions and leases, so a business task whose last execution this batch
    deleted can go in the same batch). Zero everywhere when nothing is old enough."""
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
        cur = await conn.execute(_DOOMED_BUSINESS_TASKS, {"days": business_days, "batch": batch})
        if business_ids := [r["id"] for r in await cur.fetchall()]:
            purged.business_tasks = (await conn.execute(_DELETE_BUSINESS_TASKS, {"ids": business_ids})).rowcount
    return purged
