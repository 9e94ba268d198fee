"""SQL of the dispatch coordinator on tables other than the task tables (the pass lock, the clock, the budget ledger,
its published state), as named constants with named parameters. Its reads of the task tables are operations of the
task store: libs/tasks/dispatch_reads.py (a pass's snapshot, candidates and claim), libs/tasks/backlog_reads.py (the
gauges and aging), libs/tasks/business.py (the scan, aging's write)."""

from __future__ import annotations

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

# ---- high-only pass (collect-now latency) -----------------------------------------------------------
# The high pass commits without waiting for its WAL flush (0.6 ms of the click's commit round trip here). What a
# Postgres crash could lose with it is a dispatch whose TaskAvailable the relay already published: the hub then
# pushes an event whose lease finds nothing, and the business task, still pending in the recovered database, is
# dispatched again. No decision is lost (the collect-now request itself commits synchronously), and a pushed
# event never was a promise (contract: task_available is a hint, the lease decides).
ASYNC_COMMIT = "SET LOCAL synchronous_commit = off"
# ---- scanner -------------------------------------------------------------------------------------

# Time zone names Postgres knows (read once per process: pg_timezone_names reads the zone files).
TIME_ZONES = "SELECT array_agg(name) AS names FROM pg_timezone_names"

PROJECTION_LAG = """
SELECT coalesce(extract(epoch FROM (now() - min(requested_at))) * 1000, 0) AS lag_ms FROM projection_rebuild_queue
"""

PUBLISH_STATE = """
INSERT INTO dispatch_coordinator_state (key, value, updated_at) VALUES (%(key)s, %(value)s, now())
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
"""
