"""SQL of the dispatch coordinator, as named constants with named parameters, composed from each other by
f-strings in this module only."""

from __future__ import annotations

from libs.tasks import legacy
from libs.tasks.fragments import interrupt_timeout_ms_sql
from libs.tasks.ingest_ops import INGEST_LAG_SQL
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL

# A business task is READY (cross-service contract 1) when pending on the desktop_tasks path, due, and
# without an active execution.
# A scalar subquery with LIMIT 1, not NOT EXISTS: it stays one index probe of uq_desktop_tasks_monitor_active
# per task whatever the statistics say. NOT EXISTS lets the planner pick an anti-join, which over a backlog
# loaded since the last ANALYZE took ~1.8 s for 10,000 ready tasks. For statements that stop after a few rows;
# aggregates over the whole backlog use READY_BACKLOG.
NO_ACTIVE_EXECUTION = (
    "(SELECT true FROM desktop_tasks d WHERE d.monitor_task_id = t.id AND d.kind = 'monitor' "
    f"AND d.status IN {ACTIVE_EXECUTION_SQL} LIMIT 1) IS NULL"
)
READY = f"t.status = 'pending' AND t.dispatch_after <= now() AND {NO_ACTIVE_EXECUTION}"
# READY for aggregates over the whole backlog (the gauges, aging's count): the active executions are read once
# into a hashed set (NOT IN over an uncorrelated subquery: a "hashed SubPlan" while the active executions fit in
# work_mem, i.e. up to ~100,000 of them) instead of NO_ACTIVE_EXECUTION's probe per task, which cost 110-120 ms a
# statement over a 10,000-task backlog (6-11 ms now), twice every maintenance tick, on the cores collect-now
# shares. monitor_task_id IS NOT NULL keeps NOT IN's NULL semantics out of it.
NOT_ACTIVE_HASHED = (
    "t.id NOT IN (SELECT d.monitor_task_id FROM desktop_tasks d WHERE d.kind = 'monitor' "
    f"AND d.status IN {ACTIVE_EXECUTION_SQL} AND d.monitor_task_id IS NOT NULL)"
)
READY_BACKLOG = f"t.status = 'pending' AND t.dispatch_after <= now() AND {NOT_ACTIVE_HASHED}"

# The same test for the candidate scans, which walk an index in dispatch order and stop at a LIMIT: the
# LATERAL .. LIMIT 1 forces one probe of `uq_desktop_tasks_monitor_active` per row walked (the planner
# cannot turn it into an unparameterised anti-join, which with stale statistics, e.g. right after the
# scanner created 20,000 tasks, re-scanned every active execution for every candidate). Use with
# ACTIVE_PROBE in the FROM clause.
ACTIVE_PROBE = (
    "LEFT JOIN LATERAL (SELECT true AS busy FROM desktop_tasks d WHERE d.monitor_task_id = t.id "
    f"AND d.kind = 'monitor' AND d.status IN {ACTIVE_EXECUTION_SQL} LIMIT 1) act ON true"
)
READY_PROBED = (
    "t.status = 'pending' AND t.dispatch_after <= now() AND act.busy IS NULL"
)

# The monitor work a client holds or has been sent, on both paths: queued or in-progress executions, and legacy offers
# (queued) and leases (in_progress) (docs/legacy-path.md). Client concurrency, queue depth and platform concurrency
# count both alike.
ACTIVE_WORK = """(
    SELECT d.target_client_id, d.tenant_id, d.ai_platform_id, d.status, d.lane, d.control_flags, d.interrupted_at,
           d.monitor_task_id
    FROM desktop_tasks d WHERE d.kind = 'monitor' AND d.status IN ('queued', 'in_progress')
    UNION ALL
    SELECT l.target_client_id, l.tenant_id, l.ai_platform_id, l.status, l.lane, l.control_flags,
           NULL::timestamptz, l.monitor_task_id
    FROM legacy_leases l WHERE l.status IN ('queued', 'in_progress'))"""

# An execution counts against its window's budget unless collect-now cancelled it while still queued (never
# leased): that one gives its budget back. One SQL definition (migration 021) for the count and the ledger.
COUNTS_AGAINST_BUDGET = "dispatch_budget_counts(d.kind, d.status, d.interrupt_reason, d.lease_epoch)"

# Serialises dispatch passes (and fences a zombie ex-leader whose lock session died mid-pass).
PASS_LOCK = "SELECT pg_advisory_xact_lock(7401552111)"
# One clock reading: the pass checks the window of `now` and stamps its executions with `ts`.
NOW = "SELECT extract(epoch FROM c.ts)::float8 AS now, c.ts FROM (SELECT clock_timestamp() AS ts) c"

# The window's executions, counted: what the ledger below replaces on the passes. Still the ledger's start and the
# ops status (`monitorctl status`), and the reference the ledger's tests compare it with.
BUDGET_USED = f"""
SELECT d.tenant_id, (d.lane = 'high') AS high, count(*) AS n
FROM dispatch_budget_rows d
WHERE d.kind = 'monitor' AND d.created_at >= to_timestamp(%(window_start)s)
  AND d.created_at < to_timestamp(%(window_end)s) AND {COUNTS_AGAINST_BUDGET}
GROUP BY 1, 2
"""

# ---- budget ledger (migration 021) ----------------------------------------------------------------------------
# Triggers on desktop_tasks keep dispatch_budget_ledger in the transaction of every change it counts; the passes read
# a window's use as at most four rows a tenant instead of counting the window's executions (at 1,000,000 ready
# tasks and 5,000 executions a window: 10.8 ms a full pass and 18.7 of the high pass's 19.4 ms snapshot; see
# docs/benchmarks.md "Cost as the backlog grows").
#
# Taken exclusively (after PASS_LOCK) to start the ledger; every trigger takes it shared. While it is held no
# execution can be inserted (the pass lock) or start or stop counting (the triggers wait): the count that starts the
# ledger is exact, and every later change lands in the rows it wrote.
LEDGER_LOCK = "SELECT pg_advisory_xact_lock(7401552112)"
LEDGER_TRACKING = "SELECT window_seconds, since_window_start FROM dispatch_budget_ledger_tracking"
# Start (or restart, after a change of budget_window_seconds) the ledger for one window length: it counts from the
# current window on. Executions already created in it or later (only the current window's, normally) are counted
# here once; every later change comes from the triggers.
LEDGER_FORGET = "DELETE FROM dispatch_budget_ledger_tracking"
LEDGER_CLEAR = """
WITH totals AS (DELETE FROM dispatch_budget_totals)
DELETE FROM dispatch_budget_ledger
"""
LEDGER_TRACK = """
INSERT INTO dispatch_budget_ledger_tracking (window_seconds, since_window_start)
VALUES (%(window)s, %(window_start)s)
"""
LEDGER_START = f"""
WITH c AS MATERIALIZED (
    SELECT dispatch_budget_window(d.created_at, %(window)s) AS window_start, d.tenant_id, d.lane = 'high' AS high,
           count(*)::int AS n
    FROM dispatch_budget_rows d
    WHERE d.kind = 'monitor' AND d.created_at >= to_timestamp(%(window_start)s) AND {COUNTS_AGAINST_BUDGET}
    GROUP BY 1, 2, 3
), per_tenant AS (
    INSERT INTO dispatch_budget_ledger (window_start, window_seconds, tenant_id, high, source, used)
    SELECT c.window_start, %(window)s, c.tenant_id, c.high, 0, c.n FROM c
)
INSERT INTO dispatch_budget_totals (window_start, window_seconds, high, shard, source, used)
SELECT c.window_start, %(window)s, c.high, c.tenant_id %% 16, 0, sum(c.n) FROM c GROUP BY 1, 2, 3, 4
"""
# Windows long past (kept an hour for whoever looks at the tables).
LEDGER_PRUNE = """
WITH totals AS (DELETE FROM dispatch_budget_totals WHERE window_start < %(window_start)s - 3600)
DELETE FROM dispatch_budget_ledger WHERE window_start < %(window_start)s - 3600
"""

# A window's budget use per tenant and lane class: from the ledger when it counts this window (the usual case), else
# counted. The count runs only in the ledger's absence (the first window after a deployment or a change of the
# window length, until the next full pass starts the ledger): EXISTS over an uncorrelated subquery is a one-time
# filter, evaluated before either branch scans anything. {ws} is the window start (epoch seconds).
def _ledger_tracks(ws: str) -> str:
    """Does the ledger count the window starting at `ws` (an SQL expression)?"""
    return ("SELECT 1 FROM dispatch_budget_ledger_tracking k "
            f"WHERE k.window_seconds = %(window)s AND k.since_window_start <= {ws}")


BUDGET_USE = f"""
SELECT l.tenant_id, l.high, sum(l.used) AS n
FROM dispatch_budget_ledger l
WHERE l.window_start = %(window_start)s AND l.window_seconds = %(window)s
  AND EXISTS ({_ledger_tracks("%(window_start)s")})
GROUP BY 1, 2
UNION ALL
SELECT d.tenant_id, d.lane = 'high', count(*)
FROM dispatch_budget_rows d
WHERE NOT EXISTS ({_ledger_tracks("%(window_start)s")}) AND d.kind = 'monitor'
  AND d.created_at >= to_timestamp(%(window_start)s) AND d.created_at < to_timestamp(%(window_start)s + %(window)s)
  AND {COUNTS_AGAINST_BUDGET}
GROUP BY 1, 2
"""
# The high pass needs the window's use per lane class only: from the totals (at most 64 rows, whatever the number of
# tenants), else counted. For the window of its clock (its `w` row).
_HIGH_TRACKED = _ledger_tracks("(SELECT ws FROM w)")
_HIGH_BUDGET_USE = f"""
SELECT t.high, sum(t.used) AS n
FROM dispatch_budget_totals t
WHERE t.window_start = (SELECT ws FROM w) AND t.window_seconds = %(window)s AND EXISTS ({_HIGH_TRACKED})
GROUP BY 1
UNION ALL
SELECT d.lane = 'high', count(*)
FROM dispatch_budget_rows d
WHERE NOT EXISTS ({_HIGH_TRACKED}) AND d.kind = 'monitor' AND d.created_at >= to_timestamp((SELECT ws FROM w))
  AND d.created_at < to_timestamp((SELECT ws FROM w) + %(window)s) AND {COUNTS_AGAINST_BUDGET}
GROUP BY 1
"""

# Eligible clients with their monitor load. Set-based: one aggregate over the active work, folded into ONE jsonb
# object (client id -> [in_progress, queued, queued_high, interrupt_overdue]), and the clients with pending high work
# as one array, each looked up per eligible client: no join between the clients and the aggregate, so no plan can
# rescan the aggregate per client. As a join it did when the statistics were taken while no client was online (the
# planner estimated one client): a nested loop of 1,041 clients over 501 loads, 215 of the pass's 245 ms at 1,000,000
# ready tasks (docs/benchmarks.md "Backlog scale").
CLIENTS = f"""
WITH load AS MATERIALIZED (
    SELECT coalesce(jsonb_object_agg(a.client_id::text, jsonb_build_array(
               a.in_progress, a.queued, a.queued_high, a.interrupt_overdue)), '{{}}'::jsonb) AS by_client
    FROM (SELECT d.target_client_id AS client_id,
                 count(*) FILTER (WHERE d.status = 'in_progress') AS in_progress,
                 count(*) FILTER (WHERE d.status = 'queued') AS queued,
                 count(*) FILTER (WHERE d.status = 'queued' AND d.lane = 'high') AS queued_high,
                 coalesce(bool_or(d.status = 'in_progress' AND (d.control_flags ->> 'interrupt_requested') = 'true'
                          -- evaluated last, for the (few) interrupted executions: the mode's soft timeout (§10.5)
                          AND d.interrupted_at < now() - make_interval(
                              secs => {interrupt_timeout_ms_sql("soft", "d", "ps", "15000")} / 1000.0)), false)
                     AS interrupt_overdue
          FROM {ACTIVE_WORK} d LEFT JOIN platform_settings ps ON ps.ai_platform_id = d.ai_platform_id
          GROUP BY 1) a
), high AS MATERIALIZED (
    -- Clients with pending high business work not yet running (its ready-list index, lane = 'high').
    SELECT coalesce(array_agg(DISTINCT t.target_client_id), '{{}}') AS clients
    FROM monitoring_collect_tasks t
    WHERE t.dispatch_lane = 'high' AND t.status = 'pending' AND t.target_client_id IS NOT NULL
      AND {NOT_ACTIVE_HASHED}
)
SELECT c.id, c.tenant_id, c.workspace_id, c.max_concurrent_monitor, c.max_queue_depth, c.interrupt_generation,
       c.platform_health, coalesce((a.l ->> 0)::int, 0) AS in_progress, coalesce((a.l ->> 1)::int, 0) AS queued,
       coalesce((a.l ->> 2)::int, 0) > 0 OR c.id = ANY(h.clients) AS pending_high,
       coalesce((a.l ->> 3)::boolean, false) AS interrupt_overdue
FROM desktop_clients c
CROSS JOIN load
CROSS JOIN high h
CROSS JOIN LATERAL (SELECT load.by_client -> c.id::text AS l) a
WHERE {ELIGIBLE_CLIENT_SQL}
"""

# An operator's per-(tenant, platform) override of the platform-health pause: 'pause' or 'ignore_health'.
PLATFORM_HEALTH_OVERRIDES = "SELECT tenant_id, ai_platform_id, mode FROM platform_health_overrides"

PLATFORM_ACTIVE = f"""
SELECT w.tenant_id, w.ai_platform_id, count(*) AS n
FROM {ACTIVE_WORK} w
GROUP BY 1, 2
"""

# Platform limits and pauses, for both passes.
PLATFORM_SETTINGS = """
SELECT p.id AS ai_platform_id, p.code, p.enabled, coalesce(s.max_concurrent, 1) AS max_concurrent,
       coalesce(s.paused, false) AS paused, coalesce(s.interrupt_soft_timeout_ms, 15000) AS soft_timeout_ms,
       coalesce(s.interrupt_hard_timeout_ms, 45000) AS hard_timeout_ms
FROM ai_platforms p LEFT JOIN platform_settings s ON s.ai_platform_id = p.id
"""

# ---- high-only pass (collect-now latency) -----------------------------------------------------------
# The high pass commits without waiting for its WAL flush (0.6 ms of the click's commit round trip here). What a
# Postgres crash could lose with it is a dispatch whose TaskAvailable the relay already published: the hub then
# pushes an event whose lease finds nothing, and the business task, still pending in the recovered database, is
# dispatched again. No decision is lost (the collect-now request itself commits synchronously), and a pushed
# event never was a promise (contract: task_available is a hint, the lease decides).
ASYNC_COMMIT = "SET LOCAL synchronous_commit = off"
# The high pass's snapshot in ONE statement (one result to convert instead of five; the sub-results come back as
# JSON documents): the clock, the budget window it falls in and that window's cluster budget use, platform settings,
# the active executions of the tenants with ready high work, and the eligible clients that work can go to (its
# bound client, or the clients of its tenant and workspace) with their monitor load. The executions the pass
# writes are stamped with this clock, so they fall in the window whose budget was read. ELIGIBLE_CLIENT_SQL and
# PLATFORM_SETTINGS are part of it.
HIGH_SNAPSHOT = f"""
WITH w AS MATERIALIZED (
    SELECT c.ts, (floor(extract(epoch FROM c.ts) / %(window)s) * %(window)s)::bigint AS ws
    FROM (SELECT clock_timestamp() AS ts) c
), cand AS MATERIALIZED (
    -- Where ready high work is (a superset of the candidates: tasks with an active execution are not filtered
    -- out): a walk of the high lane of ix_collect_tasks_ready, without the candidate query's per-task probes.
    SELECT DISTINCT t.tenant_id, t.workspace_id, t.target_client_id
    FROM monitoring_collect_tasks t
    WHERE t.dispatch_lane = 'high' AND t.status = 'pending' AND t.dispatch_after <= now()
)
SELECT extract(epoch FROM w.ts)::float8 AS now, w.ts, w.ws::float8 AS window_start,
       b.cluster_used, b.non_high_used,
       (SELECT coalesce(json_agg(p), '[]')::text FROM ({PLATFORM_SETTINGS}) p) AS platforms,
       (SELECT coalesce(json_agg(a), '[]')::text FROM (
            SELECT d.tenant_id, d.ai_platform_id, count(*) AS n
            FROM {ACTIVE_WORK} d
            WHERE d.tenant_id = ANY(ARRAY(SELECT tenant_id FROM cand))
            GROUP BY 1, 2) a) AS active,
       (SELECT coalesce(json_agg(l), '[]')::text FROM (
            SELECT c.id, c.tenant_id, c.workspace_id, c.max_concurrent_monitor, c.max_queue_depth,
                   c.interrupt_generation, coalesce(a.in_progress, 0) AS in_progress, coalesce(a.queued, 0) AS queued
            -- A primary-key probe (LATERAL .. OFFSET 0, whatever the statistics say) per bound client and per client of
            -- the tenant and workspace of unbound work: the filter over every online client it replaces took 3-12 ms
            -- at 1,041 clients.
            FROM (SELECT DISTINCT k.id FROM unnest(ARRAY(
                      SELECT target_client_id FROM cand WHERE target_client_id IS NOT NULL
                      UNION ALL
                      SELECT s.id
                      FROM (SELECT DISTINCT tenant_id, workspace_id FROM cand WHERE target_client_id IS NULL) u
                      JOIN desktop_clients s ON s.tenant_id = u.tenant_id AND s.workspace_id = u.workspace_id)) AS k(id)
                 ) k
            CROSS JOIN LATERAL (SELECT * FROM desktop_clients c WHERE c.id = k.id OFFSET 0) c
            LEFT JOIN LATERAL (
                SELECT count(*) FILTER (WHERE d.status = 'in_progress') AS in_progress,
                       count(*) FILTER (WHERE d.status = 'queued') AS queued
                FROM (SELECT d.status FROM desktop_tasks d
                      WHERE d.target_client_id = c.id AND d.kind = 'monitor' AND d.status IN ('queued', 'in_progress')
                      UNION ALL
                      SELECT l.status FROM legacy_leases l
                      WHERE l.target_client_id = c.id AND l.status IN ('queued', 'in_progress')) d
            ) a ON true
            WHERE {ELIGIBLE_CLIENT_SQL}) l) AS clients
FROM w CROSS JOIN (
    -- High work answers to the cluster budget only (no tenant budget): two sums of the window's totals.
    SELECT coalesce(sum(u.n), 0) AS cluster_used, coalesce(sum(u.n) FILTER (WHERE NOT u.high), 0) AS non_high_used
    FROM ({_HIGH_BUDGET_USE}) u
) b
"""


# (tenant, platform) pairs with pending work (either path): a loose index scan, one probe per pair.
PENDING_PAIRS = """
WITH RECURSIVE pairs AS (
    (SELECT tenant_id, ai_platform_id FROM monitoring_collect_tasks
     WHERE status = 'pending'
     ORDER BY tenant_id, ai_platform_id LIMIT 1)
    UNION ALL
    SELECT n.tenant_id, n.ai_platform_id FROM pairs p
    CROSS JOIN LATERAL (
        SELECT tenant_id, ai_platform_id FROM monitoring_collect_tasks
        WHERE status = 'pending'
          AND (tenant_id, ai_platform_id) > (p.tenant_id, p.ai_platform_id)
        ORDER BY tenant_id, ai_platform_id LIMIT 1) n
)
SELECT tenant_id, ai_platform_id FROM pairs
"""

_CANDIDATE_COLUMNS = (
    "t.id, t.tenant_id, t.workspace_id, t.ai_platform_id, t.dispatch_lane AS lane, t.dispatch_priority AS priority, "
    "extract(epoch FROM t.enqueued_at)::float8 AS enqueued_at, t.target_client_id"
)

# The trace context of the collect-now a task was promoted by (tracing: the dispatch joins the click's trace).
# One primary-key probe, and only for tasks of a request.
_CLICK_TRACEPARENT = """CASE WHEN t.collect_request_id IS NOT NULL THEN (
    SELECT r.traceparent FROM monitoring_collect_requests r WHERE r.id = t.collect_request_id) END
       AS collect_traceparent"""

HIGH_CANDIDATES = f"""
SELECT {_CANDIDATE_COLUMNS}
FROM monitoring_collect_tasks t {ACTIVE_PROBE}
WHERE t.dispatch_lane = 'high' AND {READY_PROBED}
ORDER BY t.dispatch_priority DESC, t.enqueued_at, t.id
LIMIT %(limit)s
"""

# The high pass takes its locks while it reads, in the order every writer uses (clients, then tasks), so
# its write needs no CLAIM round trip: first the clients that ready high work is bound to (share mode,
# as LOCK_CLIENTS), then the high candidates themselves, locked (SKIP LOCKED: a task a collect-now is
# promoting right now is left to the pass its commit wakes) with the columns CLAIM would re-read.
LOCK_HIGH_CLIENTS = """
SELECT c.id FROM desktop_clients c
WHERE c.id IN (SELECT t.target_client_id FROM monitoring_collect_tasks t
               WHERE t.dispatch_lane = 'high' AND t.status = 'pending'
                 AND t.target_client_id IS NOT NULL)
ORDER BY c.id
FOR SHARE OF c
"""

HIGH_CANDIDATES_LOCKED = f"""
SELECT {_CANDIDATE_COLUMNS}, t.ctid AS row_ref, t.dispatch_priority, t.dispatch_lane, t.trigger_source,
       t.collect_request_id, t.question_id, t.enqueued_at AS enqueued_ts, t.brand_id, t.business_date,
       t.next_execution_id, t.execution_owner, {_CLICK_TRACEPARENT}
FROM monitoring_collect_tasks t {ACTIVE_PROBE}
WHERE t.dispatch_lane = 'high' AND {READY_PROBED}
ORDER BY t.dispatch_priority DESC, t.enqueued_at, t.id
LIMIT %(limit)s
FOR UPDATE OF t SKIP LOCKED
"""

# The active-execution test is the hashed set (READY_BACKLOG), read once per statement, not a probe per task walked:
# see CLAIM.
PAIR_CANDIDATES = f"""
SELECT c.* FROM unnest(%(tenants)s::bigint[], %(platforms)s::bigint[], %(lanes)s::text[], %(limits)s::int[])
     AS p(tenant_id, ai_platform_id, lane, k)
CROSS JOIN LATERAL (
    SELECT {_CANDIDATE_COLUMNS}
    FROM monitoring_collect_tasks t
    WHERE t.tenant_id = p.tenant_id AND t.ai_platform_id = p.ai_platform_id AND t.dispatch_lane = p.lane
      AND {READY_BACKLOG}
    -- The leading (equal) keys make ix_collect_tasks_ready_pair the only index giving this order, so the
    -- probe is a short range scan of its pair even when statistics are stale (the per-lane ready index
    -- would filter every other pair's rows out).
    ORDER BY t.tenant_id, t.ai_platform_id, t.dispatch_lane, t.dispatch_priority DESC, t.enqueued_at, t.id
    LIMIT p.k
) c
"""

# The write of a pass, in set-based steps whose plans do not depend on statistics (the tables change by
# tens of thousands of rows between two autovacuum analyses when a day's schedule comes due):
#   LOCK_CLIENTS -> CLAIM (lock the decided business rows by primary key and re-read them) ->
#   CLIENTS_WITH_HIGH (lane rule re-check) -> the dispatcher filters -> libs.tasks.business.COUNT_DISPATCH_ATTEMPTS +
#   libs.tasks.executions.INSERT_EXECUTIONS.
#
# CLAIM re-checks READY at write time (a concurrent collect-now may have promoted or bound a task, an
# execution may have been created meanwhile): the rows come back locked, in their latest committed
# version, so what the dispatcher checks cannot change before the insert. One primary-key probe per
# decided id (the OFFSET 0 keeps the LATERAL parameterised: as a plain join, or with `id = ANY(..)`, stale
# statistics made the planner walk a whole partial index of pending tasks instead), ids in ascending
# order so concurrent lockers of the same rows cannot deadlock. `ctid` lets business.COUNT_DISPATCH_ATTEMPTS update the
# very rows locked here with a TID scan (a locked row cannot move).
# The active-execution test is READY_BACKLOG's hashed set, read once per claim (the outstanding executions: bounded by
# the clients' queues), not ACTIVE_PROBE's probe per claimed task: with statistics taken while nothing was outstanding
# both partial indexes of active executions look empty, the planner may probe with ix_desktop_tasks_client_active
# (whose key does not match) and read every outstanding execution per claimed task (500 claims, 501 outstanding:
# 110 ms and 254,001 buffers against 3,000; docs/benchmarks.md "Backlog scale").
CLAIM = f"""
SELECT t.*
FROM unnest(%(task_ids)s::bigint[]) WITH ORDINALITY AS u(id, n)
CROSS JOIN LATERAL (
    SELECT t.ctid AS row_ref, t.id, t.tenant_id, t.workspace_id, t.dispatch_priority, t.dispatch_lane,
           t.trigger_source, t.collect_request_id, t.question_id, t.enqueued_at, t.brand_id, t.ai_platform_id,
           t.business_date, t.target_client_id, t.next_execution_id, t.execution_owner, {_CLICK_TRACEPARENT}
    FROM monitoring_collect_tasks t
    WHERE t.id = u.id AND {READY_BACKLOG}
    OFFSET 0
    FOR UPDATE OF t
) t
ORDER BY u.n
"""

# Lane rule re-checked at write time, after LOCK_CLIENTS: a collect-now that committed since the snapshot
# wins, so no normal goes to a client that now has pending high work not already running.
CLIENTS_WITH_HIGH = """
SELECT DISTINCT h.target_client_id AS client_id
FROM monitoring_collect_tasks h
LEFT JOIN LATERAL (SELECT true AS busy FROM desktop_tasks x WHERE x.monitor_task_id = h.id AND x.kind = 'monitor'
                   AND x.status IN ('in_progress', 'unknown') LIMIT 1) run ON true
WHERE h.target_client_id = ANY(%(clients)s::uuid[]) AND h.status = 'pending' AND h.dispatch_lane = 'high'
  AND run.busy IS NULL
"""

# Collect-now starts by updating its client's row (interrupt_generation): holding these rows in share
# mode orders a pass against a collect-now on the same client. Either the collect-now committed first
# (the DISPATCH re-check then sees its high work and sends no normal) or it waits for this pass and then
# cancels the normal executions this pass queued on its client.
LOCK_CLIENTS = "SELECT id FROM desktop_clients WHERE id = ANY(%(ids)s) ORDER BY id FOR SHARE"

# ---- scanner -------------------------------------------------------------------------------------

# Time zone names Postgres knows (read once per process: pg_timezone_names reads the zone files).
TIME_ZONES = "SELECT array_agg(name) AS names FROM pg_timezone_names"

# ---- aging ---------------------------------------------------------------------------------------

AGING_READY_COUNT = f"""
SELECT count(*) AS n FROM monitoring_collect_tasks t
WHERE t.dispatch_lane IN ('normal', 'normal_boosted') AND {READY_BACKLOG}
"""

# The boundary of an aging round: the (enqueued_at, id) of the `limit`-th oldest ready normal task. An index-only
# walk of ix_collect_tasks_aging (migration 021 includes dispatch_after), which stops there.
AGING_BOUNDARY = f"""
SELECT t.enqueued_at, t.id FROM monitoring_collect_tasks t
WHERE t.dispatch_lane IN ('normal', 'normal_boosted') AND {READY_BACKLOG}
ORDER BY t.enqueued_at, t.id
OFFSET %(limit)s - 1 LIMIT 1
"""

# The next batch of a round: ready normal tasks after `after` and up to the boundary whose boost is below the cap,
# oldest first. The walk skips the tasks already at the cap from the index (it includes aging_boost) and reads the
# heap row of only the tasks it returns. It read every task of the round's share before: 5.1 s at 1,000,000 ready
# tasks (docs/benchmarks.md "Cost as the backlog grows").
AGING_OLDEST = f"""
SELECT t.id, t.dispatch_lane AS lane, t.dispatch_priority AS priority, t.aging_boost, t.enqueued_at,
       extract(epoch FROM (now() - t.enqueued_at)) / 60.0 AS wait_minutes
FROM (SELECT t.id FROM monitoring_collect_tasks t
      WHERE t.dispatch_lane IN ('normal', 'normal_boosted') AND {READY_BACKLOG} AND t.aging_boost < %(cap)s
        AND (t.enqueued_at, t.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint)
        AND (t.enqueued_at, t.id) <= (%(last_at)s::timestamptz, %(last_id)s::bigint)
      ORDER BY t.enqueued_at, t.id
      LIMIT %(batch)s) o
CROSS JOIN LATERAL (SELECT * FROM monitoring_collect_tasks t WHERE t.id = o.id OFFSET 0) t
ORDER BY t.enqueued_at, t.id
"""

# ---- observation ---------------------------------------------------------------------------------

# Every maintenance tick: the high lane (bounded by what collect-now may promote), exactly. A high task waits from
# when it became high work (collect-now sets dispatch_after to the click), not from when the scanner first created
# it hours earlier: the high-lane alert must measure the click's wait.
HIGH_BACKLOG = f"""
SELECT count(*) AS n,
       coalesce(extract(epoch FROM (now() - min(greatest(t.enqueued_at, t.dispatch_after)))) * 1000, 0) AS oldest_ms
FROM monitoring_collect_tasks t
WHERE t.dispatch_lane = 'high' AND {READY_BACKLOG}
"""

# The rest of the backlog gauges come from a census of the pending tasks taken a slice at a time
# (maintenance.BacklogCensus): the next %(rows)s pending tasks after %(after)s in id order (ix_collect_tasks_pending_id,
# migration 022, holds only pending tasks) per tick, instead of the three statements below over the whole backlog
# every tick (4.9 s at 1,000,000 ready tasks). Per slice, in one aggregation (grouping sets): ready non-high tasks per
# tenant and lane, pending tasks per execution path, the ready normal tasks' waits in logarithmic buckets (64 a factor
# e: 1.6% wide) measured at %(reference)s (epoch seconds) so that the slices of a sweep add up, and the slice's size
# and last id (the empty grouping set).
CENSUS_SLICE = f"""
SELECT grouping(s.tenant_id, s.lane) = 0 AS by_lane, grouping(s.owner) = 0 AS by_owner,
       grouping(s.bucket) = 0 AS by_bucket, s.tenant_id, s.lane, s.owner, s.bucket,
       count(*) FILTER (WHERE s.ready AND s.lane <> 'high') AS ready,
       count(*) FILTER (WHERE s.ready AND s.lane IN ('normal', 'normal_boosted')) AS ready_normal,
       count(*) AS pending, max(s.id) AS last_id
FROM (SELECT r.*, CASE WHEN r.ready AND r.lane IN ('normal', 'normal_boosted') THEN
                      floor(ln(1 + greatest(0, %(reference)s::float8 - extract(epoch FROM r.enqueued_at)::float8)) * 64)
                  END::int AS bucket
      FROM (SELECT t.id, t.tenant_id, t.dispatch_lane AS lane, t.execution_owner AS owner, t.enqueued_at,
                   coalesce({READY_BACKLOG}, false) AS ready
            FROM monitoring_collect_tasks t
            WHERE t.status = 'pending' AND t.id > %(after)s
            ORDER BY t.id
            LIMIT %(rows)s) r) s
GROUP BY GROUPING SETS ((s.tenant_id, s.lane), (s.owner), (s.bucket), ())
"""

# The same counts exactly, each in one statement over the whole backlog: what the census is tested against.
BACKLOG = f"""
SELECT t.tenant_id, t.dispatch_lane AS lane, count(*) AS n,
       extract(epoch FROM (now() - min(CASE WHEN t.dispatch_lane = 'high'
                                            THEN greatest(t.enqueued_at, t.dispatch_after)
                                            ELSE t.enqueued_at END))) * 1000 AS oldest_ms
FROM monitoring_collect_tasks t
WHERE {READY_BACKLOG}
GROUP BY 1, 2
"""

NORMAL_WAIT_P99 = f"""
SELECT coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM (now() - t.enqueued_at)) * 1000),
                0) AS p99_ms
FROM monitoring_collect_tasks t
WHERE t.dispatch_lane IN ('normal', 'normal_boosted') AND {READY_BACKLOG}
"""

OWNER_COUNTS = """
SELECT execution_owner, count(*) AS n FROM monitoring_collect_tasks WHERE status = 'pending' GROUP BY 1
"""

# The queued executions counted once per client, looked up per online client in one JSON object: linear whatever the
# statistics say. The join it replaces was planned as a nested loop over every queued execution per client once
# `online` or the queue had changed since the last ANALYZE (286 ms for 1,041 clients and 500 queued executions).
CLIENT_QUEUE_DEPTH = f"""
WITH q AS MATERIALIZED (
    -- Materialized: computed once. As a plain subquery, statistics taken while no client was online made the planner
    -- rescan the aggregate for every online client (1.5 s a tick at 1,000,000 ready tasks; docs/benchmarks.md
    -- "Backlog scale").
    SELECT coalesce(jsonb_object_agg(d.target_client_id::text, d.n), '{{}}'::jsonb) AS depths
    FROM (SELECT w.target_client_id, count(*) AS n FROM {ACTIVE_WORK} w
          WHERE w.status = 'queued' GROUP BY 1) d
)
SELECT c.id, coalesce((q.depths ->> c.id::text)::int, 0) AS queued
FROM desktop_clients c CROSS JOIN q
WHERE c.online
"""

# Both execution paths' oldest result not applied yet (one definition: libs/ingest/lag.py).
INGEST_LAG = INGEST_LAG_SQL

PROJECTION_LAG = """
SELECT coalesce(extract(epoch FROM (now() - min(requested_at))) * 1000, 0) AS lag_ms FROM projection_rebuild_queue
"""

PUBLISH_STATE = """
INSERT INTO dispatch_coordinator_state (key, value, updated_at) VALUES (%(key)s, %(value)s, now())
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
"""

# The rollout as stored (libs.tasks.fragments.ROLLOUT_OWNER_SQL's reading, with the settings' default) and the work
# in flight per execution path (libs.tasks.legacy.IN_FLIGHT_BY_PATH: counts over the two partial indexes of live
# work), in one round trip for the maintenance tick's gauges.
PATHS = f"""
SELECT coalesce((SELECT (v.value #>> '{{}}')::int FROM dispatch_settings v WHERE v.key = 'rollout_percentage'),
                %(default_rollout)s) AS rollout_percentage,
       f.desktop_tasks, f.legacy
FROM ({legacy.IN_FLIGHT_BY_PATH}) f
"""
