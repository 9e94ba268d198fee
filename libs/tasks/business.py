"""Business tasks (`monitoring_collect_tasks`): every statement that creates a row or moves it through dispatch,
whoever runs it (docs/architecture.md "State machines", "Write matrix").

    (scanner | collect-now) create -> pending --(dispatch: counted, an execution or a legacy offer)--> ...
    pending: normal --(aging)--> normal_boosted; any --(collect-now)--> high, bound to the click's client
    high --(request timed out)--> normal, unbound; bound --(client offline)--> unbound; --(hard timeout)--> rebound
    pending --(business day over)--> expired; desktop_tasks --(rollback)--> legacy

Ending work (an execution or a legacy lease) and what it does to the business task (yield, retry, finish) is
libs/tasks/transitions.py; the legacy lease columns on the row are libs/tasks/legacy.py's.

Every statement has its operation: the coordinator's (`scan_due_plans`, `count_dispatched`, `apply_aging`,
`rollback_to_legacy`) hold private statements (`_NAME`); the reconciler's (`unbind_high_of_stale_clients`,
`demote_timed_out`, `rebind_high`, `expire`) keep their statements public, and collect-now's (CREATE_MISSING_TASKS,
PROMOTE_SCOPE, MARK_SUPERSEDED, run in its pipelined click) are still statements, until their callers move to
operations (issue #23).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import msgspec

from libs.db.pool import Conn
from libs.domain.lanes import CLICK_LANE, SCHEDULED_LANE
from libs.tasks.fragments import (
    ACTIVE_TASK_IDS_SQL,
    CLIENT_GENERATION_SQL,
    ROLLOUT_OWNER_SQL,
    STALE_CLIENT_SQL,
)
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, CLEAR_LEGACY_LEASE_SQL

# The lanes collect-now promotes to and the scanner creates in, as SQL literals ('high', 'normal').
_CLICK = f"'{CLICK_LANE.name}'"
_SCHEDULED = f"'{SCHEDULED_LANE.name}'"

# ---- creation ----------------------------------------------------------------------------------------------------


# Tasks the scanner has not created yet: one row per business key, never a second one.
CREATE_MISSING_TASKS = f"""
INSERT INTO monitoring_collect_tasks
    (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date, plan_id, trigger_source,
     dispatch_priority, dispatch_lane, target_client_id, dispatch_after, interrupt_generation,
     collect_request_id, ingest_shard_key, execution_owner)
SELECT %(tenant_id)s, %(workspace_id)s, %(brand_id)s, s.question_id, s.ai_platform_id, %(business_date)s,
       s.plan_id, 'manual', %(priority)s, {_CLICK}, %(client_id)s, now(), {CLIENT_GENERATION_SQL}, %(request_id)s,
       %(shard_key)s, {ROLLOUT_OWNER_SQL}
FROM unnest(%(question_ids)s::bigint[], %(platform_ids)s::bigint[], %(plan_ids)s::bigint[])
     AS s(question_id, ai_platform_id, plan_id)
ON CONFLICT (tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode, business_date)
DO NOTHING
RETURNING id
"""


# Promotion (contract 4): pending tasks, and finished ones reset for a fresh collection, move to the
# high lane bound to the client and the request, in place: a pending task keeps its execution path (a task never
# changes owner mid-flight); a finished one starts a new run on the path the rollout gives it now. Legacy rows a
# client holds (leased / received) are in the scope but left alone: that lease finishes or yields (Phase 1).
# Returns every scope task with whether it was promoted.
PROMOTE_SCOPE = f"""
WITH scope AS (
    SELECT * FROM unnest(%(question_ids)s::bigint[], %(platform_ids)s::bigint[]) AS s(question_id, ai_platform_id)
), scope_tasks AS (
    SELECT t.id, t.status
    FROM monitoring_collect_tasks t JOIN scope s
      ON t.question_id = s.question_id AND t.ai_platform_id = s.ai_platform_id
    WHERE t.tenant_id = %(tenant_id)s AND t.brand_id = %(brand_id)s AND t.business_date = %(business_date)s
      AND t.collector_type = 'desktop' AND t.run_mode = 'daily'
    FOR UPDATE OF t
), promoted AS (
    UPDATE monitoring_collect_tasks t
    SET status = 'pending', dispatch_lane = {_CLICK}, dispatch_priority = %(priority)s,
        target_client_id = %(client_id)s, interrupt_generation = {CLIENT_GENERATION_SQL},
        collect_request_id = %(request_id)s, superseded_by_request_id = NULL, dispatch_after = now(),
        execution_owner = CASE WHEN t.status = 'pending' THEN t.execution_owner ELSE {ROLLOUT_OWNER_SQL} END,
        dispatch_attempts = CASE WHEN t.status = 'pending' THEN t.dispatch_attempts ELSE 0 END,
        completed_at = CASE WHEN t.status = 'pending' THEN t.completed_at END,
        last_error = CASE WHEN t.status = 'pending' THEN t.last_error END,
        updated_at = now()
    FROM scope_tasks s
    WHERE t.id = s.id AND s.status IN ('pending', 'completed', 'failed', 'expired', 'skipped')
    RETURNING t.id
)
SELECT id, true AS promoted FROM promoted
UNION ALL
SELECT id, false FROM scope_tasks WHERE status NOT IN ('pending', 'completed', 'failed', 'expired', 'skipped')
"""


# A newer click replaced these requests: their tasks say so.
MARK_SUPERSEDED = """
UPDATE monitoring_collect_tasks SET superseded_by_request_id = %(request_id)s, updated_at = now()
WHERE tenant_id = %(tenant_id)s AND collect_request_id = ANY(%(old_ids)s::uuid[])
"""


# ---- dispatch ----------------------------------------------------------------------------------------------------

# The coordinator dispatched these rows (by ctid, locked by its claim): one attempt more, the replacement id used.
_COUNT_DISPATCH_ATTEMPTS = """
UPDATE monitoring_collect_tasks t
SET dispatch_attempts = t.dispatch_attempts + 1, last_dispatched_at = now(), next_execution_id = NULL,
    updated_at = now()
WHERE t.ctid = ANY(%(row_refs)s::tid[])
"""


# One statement per batch: lock due plans (SKIP LOCKED), compute each plan's latest due slot and its
# business date in the tenant's time zone (libs.domain.schedule.plan_occurrence, in SQL), create one task
# per plan (idempotent on the business key), advance the plans past now. The shard key is
# libs.domain.shard.ingest_shard_key's format ("{tenant}:{brand}:{YYYY-MM-DD}"; the scanner tests assert
# the two agree). Zones Postgres does not know fall back to UTC like tenant_zone(); %(zones)s lists the
# known ones. The plans are updated by `ctid` (rows locked by this very statement cannot move).
_SCAN_DUE_PLANS = f"""
WITH due AS MATERIALIZED (
    SELECT p.ctid AS row_ref, p.id, p.tenant_id, p.workspace_id, p.brand_id, p.question_id, p.ai_platform_id,
           p.collector_type, p.run_mode, p.next_run_at, greatest(1, p.interval_seconds) AS step_s,
           CASE WHEN tn.time_zone = ANY(%(zones)b::text[]) THEN tn.time_zone ELSE 'UTC' END AS zone
    FROM monitoring_plans p JOIN tenants tn ON tn.id = p.tenant_id
    WHERE p.enabled AND p.next_run_at <= now()
    ORDER BY p.next_run_at
    LIMIT %(limit)s
    FOR UPDATE OF p SKIP LOCKED
), occ AS MATERIALIZED (
    SELECT s.*, (s.slot AT TIME ZONE s.zone)::date AS business_date
    FROM (SELECT due.*, due.next_run_at + make_interval(secs => floor(
                     extract(epoch FROM (now() - due.next_run_at)) / due.step_s)::float8 * due.step_s) AS slot
          FROM due) s
), created AS (
    INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id,
                                          collector_type, run_mode, business_date, plan_id, status, trigger_source,
                                          dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner,
                                          enqueued_at, dispatch_after)
    SELECT o.tenant_id, o.workspace_id, o.brand_id, o.question_id, o.ai_platform_id, o.collector_type, o.run_mode,
           o.business_date, o.id, 'pending', 'automatic', %(priority)s, {_SCHEDULED},
           o.tenant_id || ':' || o.brand_id || ':' || to_char(o.business_date, 'YYYY-MM-DD'),
           CASE WHEN o.tenant_id %% 100 < %(rollout)s THEN 'desktop_tasks' ELSE 'legacy' END, now(), now()
    FROM occ o
    ON CONFLICT (tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode, business_date)
        DO NOTHING
    RETURNING tenant_id, ai_platform_id, execution_owner
), advanced AS (
    UPDATE monitoring_plans p
    SET next_run_at = o.slot + make_interval(secs => o.step_s), updated_at = now()
    FROM occ o
    WHERE p.ctid = o.row_ref
    RETURNING p.id
)
SELECT (SELECT count(*) FROM advanced) AS plans,
       (SELECT coalesce(json_agg(g), '[]'::json)
        FROM (SELECT tenant_id, ai_platform_id, execution_owner, count(*) AS n FROM created GROUP BY 1, 2, 3) g)
           AS created
"""



async def count_dispatched(conn: Conn, row_refs: Sequence[str]) -> None:
    """The rows a pass dispatched (their ctids, locked by its claim) count one dispatch attempt more."""
    await conn.execute(_COUNT_DISPATCH_ATTEMPTS, {"row_refs": list(row_refs)})


class CreatedGroup(msgspec.Struct, frozen=True):
    """Tasks a scan created, per (tenant, platform, execution path)."""

    tenant_id: int
    ai_platform_id: int
    execution_owner: str
    n: int


class ScanBatch(msgspec.Struct, frozen=True):
    """One scan batch: the plans it advanced and the tasks it created."""

    plans: int
    created: list[CreatedGroup]


async def scan_due_plans(conn: Conn, *, limit: int, zones: Sequence[str], priority: int,
                         rollout_percentage: int) -> ScanBatch:
    """One batch of due plans (SKIP LOCKED), each its task for its latest due slot (idempotent on the business key),
    each advanced past now. `zones`: the time zones Postgres knows (others fall back to UTC)."""
    cur = await conn.execute(_SCAN_DUE_PLANS, {"limit": limit, "zones": list(zones), "priority": priority,
                                               "rollout": rollout_percentage})
    row = await cur.fetchone()
    assert row is not None
    return ScanBatch(plans=int(row["plans"]), created=[  # `created`: a json document, loaded by psycopg
        CreatedGroup(int(g["tenant_id"]), int(g["ai_platform_id"]), str(g["execution_owner"]), int(g["n"]))
        for g in row["created"]])

# ---- lanes and bindings ------------------------------------------------------------------------------------------

# Aging (docs/architecture.md §9): long-waiting normal tasks get their new lane, priority and boost. Each row is
# found by the ctid its read gave (backlog_reads.aging_candidates, in the same transaction): a Tid Scan, not a second
# walk of the primary key (the list of ctids, = ANY: the planner does not look rows up by a joined ctid). The WHERE
# re-checks the rest: the id (a ctid whose row was pruned since may hold another row) and the row's version (xmin),
# which is the state check: the read found that version ready (pending, in a lane that ages), and any write since (a
# pass's dispatch count, `count_dispatched`, which leaves the task pending; a collect-now's promotion; a finish) is a
# newer version that fails it, as does one being written, which the UPDATE waits for and re-checks at its newest
# version. A task left alone is boosted next round if still ready. No predicate on the state itself: with
# `status = 'pending'` spelled out the planner may take a partial index of the pending tasks instead of the ctids
# (all 10,000 of them by ix_collect_tasks_business_date for 500 rows; docs/benchmarks.md "Aging at the dispatch
# pace"). The UPDATE locks the rows it writes, as before.
_APPLY_AGING = """
UPDATE monitoring_collect_tasks t
SET dispatch_lane = v.lane, dispatch_priority = v.priority, aging_boost = v.boost, updated_at = now()
FROM unnest(%(tids)s::tid[], %(versions)s::text[]::xid[], %(ids)s::bigint[], %(lanes)s::text[], %(priorities)s::int[],
            %(boosts)s::int[]) AS v(tid, version, id, lane, priority, boost)
WHERE t.ctid = ANY(%(tids)s::tid[]) AND t.ctid = v.tid AND t.xmin = v.version AND t.id = v.id
"""


async def apply_aging(conn: Conn, *, tids: Sequence[str], versions: Sequence[str], ids: Sequence[int],
                      lanes: Sequence[str], priorities: Sequence[int], boosts: Sequence[int]) -> int:
    """Aged pending normal tasks get their new lane, priority and boost (task ids[i], read at ctid tids[i] as version
    versions[i]: lanes[i], ...); how many did (a task changed since its read does not: dispatched, promoted)."""
    cur = await conn.execute(_APPLY_AGING, {"tids": list(tids), "versions": list(versions), "ids": list(ids),
                                            "lanes": list(lanes), "priorities": list(priorities),
                                            "boosts": list(boosts)})
    return cur.rowcount


# The reconciler: pending high work bound to a client without a fresh heartbeat (or disabled) is unbound, lane kept.
UNBIND_HIGH_OF_STALE_CLIENTS = f"""
UPDATE monitoring_collect_tasks t
SET target_client_id = NULL, updated_at = now()
FROM desktop_clients c
WHERE t.target_client_id = c.id AND t.status = 'pending' AND t.dispatch_lane = {_CLICK}
  AND t.tenant_id = c.tenant_id
  AND ({STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
RETURNING t.id, t.tenant_id, c.id AS client_id, t.collect_request_id
"""


class Unbound(msgspec.Struct, frozen=True):
    """Pending high work unbound from a client without a fresh heartbeat (or disabled)."""

    id: int
    tenant_id: int
    client_id: uuid.UUID
    collect_request_id: uuid.UUID | None


async def unbind_high_of_stale_clients(conn: Conn, *, heartbeat_timeout_s: float) -> list[Unbound]:
    """Pending high work bound to a client whose last heartbeat is older than `heartbeat_timeout_s` (or that is
    disabled) is unbound, its lane kept."""
    cur = await conn.execute(UNBIND_HIGH_OF_STALE_CLIENTS, {"timeout_s": heartbeat_timeout_s})
    return [Unbound(r["id"], r["tenant_id"], r["client_id"], r["collect_request_id"]) for r in await cur.fetchall()]


# The reconciler: a timed-out request's pending tasks that are not executing leave the high lane, unbound.
DEMOTE_TIMED_OUT = f"""
UPDATE monitoring_collect_tasks t
SET dispatch_lane = {_SCHEDULED}, dispatch_priority = %(normal_priority)s, target_client_id = NULL, updated_at = now()
WHERE t.collect_request_id = %(id)s AND t.tenant_id = %(tenant_id)s AND t.status = 'pending'
  AND t.dispatch_lane = {_CLICK}
  AND NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id
                  AND d.status IN {ACTIVE_EXECUTION_SQL})
"""


async def demote_timed_out(conn: Conn, *, request_id: uuid.UUID, tenant_id: int, normal_priority: int) -> int:
    """A timed-out request's pending high tasks without an active execution go to the normal lane, unbound; how
    many did."""
    cur = await conn.execute(DEMOTE_TIMED_OUT, {"id": request_id, "tenant_id": tenant_id,
                                                "normal_priority": normal_priority})
    return cur.rowcount


# The reconciler: a client that did not yield before the hard timeout loses its pending high work to another.
REBIND_HIGH = f"""
UPDATE monitoring_collect_tasks t
SET target_client_id = %(new_client_id)s, updated_at = now()
WHERE t.tenant_id = %(tenant_id)s AND t.target_client_id = %(client_id)s AND t.status = 'pending'
  AND t.dispatch_lane = {_CLICK}
  AND NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id
                  AND d.status IN ('in_progress', 'unknown'))
"""


async def rebind_high(conn: Conn, *, tenant_id: int, client_id: uuid.UUID, new_client_id: uuid.UUID | None) -> int:
    """The pending high work bound to `client_id` and not running goes to `new_client_id` (None: unbound); how many
    tasks moved."""
    cur = await conn.execute(REBIND_HIGH, {"tenant_id": tenant_id, "client_id": client_id,
                                           "new_client_id": new_client_id})
    return cur.rowcount


# ---- the end of a row's day and path ------------------------------------------------------------------------------

# The reconciler: a pending task whose business day is over (nothing live on it) expires.
EXPIRE = f"""
UPDATE monitoring_collect_tasks
SET status = 'expired', completed_at = now(), last_error = 'business date is over', updated_at = now(),
    {CLEAR_LEGACY_LEASE_SQL}
WHERE id = %(id)s AND status = 'pending'
"""


async def expire(conn: Conn, task_id: int) -> bool:
    """The pending task's business day is over: expired (False: it was not pending)."""
    cur = await conn.execute(EXPIRE, {"id": task_id})
    return cur.rowcount == 1


# Pending desktop_tasks-owned tasks without an active execution go to the legacy path (a row with one is left alone:
# without --force its execution finishes on desktop_tasks). Any zombie legacy lease columns are cleared on the way.
_ROLLBACK_TO_LEGACY = f"""
UPDATE monitoring_collect_tasks t
SET execution_owner = 'legacy', {CLEAR_LEGACY_LEASE_SQL}, updated_at = now()
WHERE t.status = 'pending' AND t.execution_owner = 'desktop_tasks' AND t.id NOT IN ({ACTIVE_TASK_IDS_SQL})
"""


async def rollback_to_legacy(conn: Conn) -> int:
    """Every pending desktop_tasks-owned task without an active execution goes to the legacy path; how many did."""
    cur = await conn.execute(_ROLLBACK_TO_LEGACY)
    return cur.rowcount
