"""The dispatch coordinator's reads of the task tables, as operations: a pass's snapshot (budget use, platforms,
eligible clients with their load), the high pass's locked read, the candidate reads, the write-time claim and the
pending (tenant, platform) pairs (docs/architecture.md "The task store: the coordinator's operations").

Each operation takes plain arguments and answers msgspec Structs; the statements are private module constants
(named parameters, composed by f-strings from the store's own fragments, libs/tasks/ready.py). Their text and plans
are the ones the coordinator's benchmarks and plan tests were tuned on (docs/benchmarks.md): change one only with
its EXPLAIN test. The operations that read several statements send them in one pipeline (one round trip), as the
passes did when they held the statements themselves.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime
from typing import Any

import msgspec
from psycopg import AsyncCursor

from libs.db.pool import Conn
from libs.domain.lanes import CLICK_LANE, lane_names
from libs.domain.platform_health import BLOCKING_STATES, OverrideMode
from libs.tasks import business, executions, ready
from libs.tasks import requests as collect_requests
from libs.tasks.fragments import BLOCKING_STATES_SQL, interrupt_timeout_ms_sql
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL

# ---- the answers -------------------------------------------------------------------------------------------------


class BudgetUse(msgspec.Struct, frozen=True):
    """A window's budget use of one tenant and lane class (high or not); `tenant_id` None: of every tenant (the
    window's totals)."""

    tenant_id: int | None
    high: bool
    n: int


class PlatformSetting(msgspec.Struct, frozen=True):
    """A platform's limits and pause, with its settings' defaults."""

    ai_platform_id: int
    code: str
    enabled: bool
    max_concurrent: int
    paused: bool
    soft_timeout_ms: int
    hard_timeout_ms: int


class PlatformActive(msgspec.Struct, frozen=True):
    """The monitor work of one (tenant, platform) queued or running, on both paths (a platform of None: work whose
    row names none)."""

    tenant_id: int
    ai_platform_id: int | None
    n: int


class HealthOverride(msgspec.Struct, frozen=True):
    """An operator's per-(tenant, platform) override of the platform-health pause: 'pause' or 'ignore_health'."""

    tenant_id: int
    ai_platform_id: int
    mode: OverrideMode


class ClientLoad(msgspec.Struct, frozen=True):
    """An eligible client with its monitor load (a full pass's snapshot)."""

    id: uuid.UUID
    tenant_id: int
    workspace_id: int
    max_concurrent_monitor: int
    max_queue_depth: int
    interrupt_generation: int
    platform_health: dict[str, str] | None
    in_progress: int
    queued: int
    pending_high: bool
    interrupt_overdue: bool


class HealthPause(msgspec.Struct, frozen=True):
    """A (tenant, platform code) every eligible client of the tenant reports a blocking login state for."""

    tenant_id: int
    code: str


class PassSnapshot(msgspec.Struct, frozen=True):
    """What a full pass reads before its candidates (`clients`: every eligible client, or none when the pass reads
    the clients of its candidates' tenants itself, `clients_of`; `budget`: per tenant with every client, else the
    window's totals, the tenants' use read with their clients)."""

    budget: list[BudgetUse]
    platforms: list[PlatformSetting]
    active: list[PlatformActive]
    clients: list[ClientLoad]
    overrides: list[HealthOverride]
    health_pauses: list[HealthPause]


class HighClientLoad(msgspec.Struct, frozen=True):
    """A client ready high work may go to, with its monitor load (the high pass's snapshot)."""

    id: uuid.UUID
    tenant_id: int
    workspace_id: int
    max_concurrent_monitor: int
    max_queue_depth: int
    interrupt_generation: int
    in_progress: int
    queued: int


class HighSnapshot(msgspec.Struct, frozen=True):
    """The high pass's snapshot: its clock (`now` epoch seconds, `ts` to stamp its executions), the budget window it
    falls in and the window's cluster use, platforms, the active work of the tenants with ready high work, and the
    clients that work may go to."""

    now: float
    ts: datetime
    window_start: float
    cluster_used: int
    non_high_used: int
    platforms: list[PlatformSetting]
    active: list[PlatformActive]
    clients: list[HighClientLoad]


class CandidateRow(msgspec.Struct, frozen=True):
    """A ready business task as the planner reads it (`enqueued_at` in epoch seconds)."""

    id: int
    tenant_id: int
    workspace_id: int
    ai_platform_id: int
    lane: str
    priority: int
    enqueued_at: float
    target_client_id: uuid.UUID | None


class ClaimedTask(msgspec.Struct, frozen=True):
    """A business task locked for the write, in its latest committed version (`row_ref`: its ctid, for
    business.count_dispatched; `collect_traceparent`: the trace of the click that promoted it)."""

    row_ref: str
    id: int
    tenant_id: int
    workspace_id: int
    dispatch_priority: int
    dispatch_lane: str
    trigger_source: str
    collect_request_id: uuid.UUID | None
    question_id: int
    enqueued_at: datetime
    brand_id: int
    ai_platform_id: int
    business_date: date
    target_client_id: uuid.UUID | None
    next_execution_id: uuid.UUID | None
    execution_owner: str
    collect_traceparent: str | None


class HighRead(msgspec.Struct, frozen=True):
    """The high pass's read: its candidates (locked, SKIP LOCKED), the same rows as claimed tasks by id, the clients
    locked with them (bound to ready high work) and the snapshot."""

    candidates: list[CandidateRow]
    tasks: dict[int, ClaimedTask]
    locked_clients: frozenset[uuid.UUID]
    snapshot: HighSnapshot


class Claim(msgspec.Struct, frozen=True):
    """The write-time re-check: the decided tasks still READY (locked, by id), and which of the given normal clients
    now have pending high work not already running."""

    tasks: dict[int, ClaimedTask]
    clients_with_high: frozenset[uuid.UUID]


class FirstDispatch(msgspec.Struct, frozen=True):
    """A collect-now request the pass dispatched tasks of: whether it was its first dispatch, and its age then."""

    id: uuid.UUID
    first: bool
    latency_ms: float


# ---- the statements ----------------------------------------------------------------------------------------------

# Lanes as SQL literals ('high'), for statements that compare one lane with `=`: the click lane (the high pass
# walks its part of ix_collect_tasks_ready), the lane whose pending work keeps the others off its client (§10), and
# the lane a window's budget counts apart (§9.2), as migration 021's ledger triggers compare it. Each is one lane of
# the table: the unpacking fails at import once a table change makes one of them more.
_CLICK = f"'{CLICK_LANE.name}'"
(_PREEMPTING,) = (f"'{name}'" for name in lane_names(lambda s: s.preempts))
(_BUDGET_EXEMPT,) = (f"'{name}'" for name in lane_names(lambda s: s.budget_exempt))

# An execution counts against its window's budget unless collect-now cancelled it while still queued (never
# leased): that one gives its budget back. One SQL definition (migration 021) for the count and the ledger.
_COUNTS_AGAINST_BUDGET = "dispatch_budget_counts(d.kind, d.status, d.interrupt_reason, d.lease_epoch)"

# A window's budget use per tenant and lane class: from the ledger when it counts this window (the usual case), else
# counted. The count runs only in the ledger's absence (the first window after a deployment or a change of the
# window length, until the next full pass starts the ledger): EXISTS over an uncorrelated subquery is a one-time
# filter, evaluated before either branch scans anything. {ws} is the window start (epoch seconds).
def _ledger_tracks(ws: str) -> str:
    """Does the ledger count the window starting at `ws` (an SQL expression)?"""
    return ("SELECT 1 FROM dispatch_budget_ledger_tracking k "
            f"WHERE k.window_seconds = %(window)s AND k.since_window_start <= {ws}")


def _budget_use(ledger_rows: str, counted_tenants: str = "") -> str:
    """The window's budget use per tenant and lane class, the ledger's rows from `ledger_rows` (aliased `l`), the
    count's restricted by `counted_tenants` (a condition on `d`, or "")."""
    return f"""
SELECT l.tenant_id, l.high, sum(l.used) AS n
FROM {ledger_rows}
WHERE EXISTS ({_ledger_tracks("%(window_start)s")})
GROUP BY 1, 2
UNION ALL
SELECT d.tenant_id, d.lane = {_BUDGET_EXEMPT}, count(*)
FROM dispatch_budget_rows d
WHERE NOT EXISTS ({_ledger_tracks("%(window_start)s")}) AND d.kind = 'monitor' {counted_tenants}
  AND d.created_at >= to_timestamp(%(window_start)s) AND d.created_at < to_timestamp(%(window_start)s + %(window)s)
  AND {_COUNTS_AGAINST_BUDGET}
GROUP BY 1, 2
"""


_WINDOW_LEDGER = "l.window_start = %(window_start)s AND l.window_seconds = %(window)s"
_BUDGET_USE = _budget_use(f"(SELECT * FROM dispatch_budget_ledger l WHERE {_WINDOW_LEDGER}) l")
# The same for some tenants only: what a full pass reads of the tenant budgets, for the tenants its window reaches
# (`clients_of`). A probe of dispatch_budget_ledger_pkey per tenant (LATERAL .. OFFSET 0): with the tenants as a
# filter the planner, estimating one row for the window (statistics older than the window), read every tenant's
# rows of it and threw away the others' (4,842 of 4,985 rows, 4,937 buffers, 27 ms a statement at 10,000 tenants);
# every tenant's rows were what the snapshot read before (docs/benchmarks.md "The full pass at 10,000 tenants").
_TENANTS_BUDGET_USE = _budget_use(
    "unnest(%(tenants)s::bigint[]) AS w(tenant_id) CROSS JOIN LATERAL ("
    f"SELECT l.tenant_id, l.high, l.used FROM dispatch_budget_ledger l WHERE {_WINDOW_LEDGER} "
    "AND l.tenant_id = w.tenant_id OFFSET 0) l",
    "AND d.tenant_id = ANY(%(tenants)s::bigint[])")
# The window's use per lane class (a full pass's cluster budget): from the totals (at most 64 rows, whatever the number
# of tenants), else counted.
_BUDGET_TOTALS = f"""
SELECT t.high, sum(t.used) AS n
FROM dispatch_budget_totals t
WHERE t.window_start = %(window_start)s AND t.window_seconds = %(window)s
  AND EXISTS ({_ledger_tracks("%(window_start)s")})
GROUP BY 1
UNION ALL
SELECT d.lane = {_BUDGET_EXEMPT}, count(*)
FROM dispatch_budget_rows d
WHERE NOT EXISTS ({_ledger_tracks("%(window_start)s")}) AND d.kind = 'monitor'
  AND d.created_at >= to_timestamp(%(window_start)s) AND d.created_at < to_timestamp(%(window_start)s + %(window)s)
  AND {_COUNTS_AGAINST_BUDGET}
GROUP BY 1
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
SELECT d.lane = {_BUDGET_EXEMPT}, count(*)
FROM dispatch_budget_rows d
WHERE NOT EXISTS ({_HIGH_TRACKED}) AND d.kind = 'monitor' AND d.created_at >= to_timestamp((SELECT ws FROM w))
  AND d.created_at < to_timestamp((SELECT ws FROM w) + %(window)s) AND {_COUNTS_AGAINST_BUDGET}
GROUP BY 1
"""

# What _CLIENTS and _CLIENTS_OF share, so that both answer the row `_client_load` reads: the body of their `load` CTE
# (the monitor load of the active work, before each one's own WHERE and GROUP BY: of every client, or of the clients
# asked for), and the row per client, looked up in that load and in the clients with pending high work.
_LOAD_BY_CLIENT = f"""\
    SELECT coalesce(jsonb_object_agg(a.client_id::text, jsonb_build_array(
               a.in_progress, a.queued, a.queued_high, a.interrupt_overdue)), '{{}}'::jsonb) AS by_client
    FROM (SELECT d.target_client_id AS client_id,
                 count(*) FILTER (WHERE d.status = 'in_progress') AS in_progress,
                 count(*) FILTER (WHERE d.status = 'queued') AS queued,
                 count(*) FILTER (WHERE d.status = 'queued' AND d.lane = {_PREEMPTING}) AS queued_high,
                 coalesce(bool_or(d.status = 'in_progress' AND (d.control_flags ->> 'interrupt_requested') = 'true'
                          -- evaluated last, for the (few) interrupted executions: the mode's soft timeout (§10.5)
                          AND d.interrupted_at < now() - make_interval(
                              secs => {interrupt_timeout_ms_sql("soft", "d", "ps", "15000")} / 1000.0)), false)
                     AS interrupt_overdue
          FROM {ready.ACTIVE_WORK} d LEFT JOIN platform_settings ps ON ps.ai_platform_id = d.ai_platform_id
"""
# A client's platform_health entries as (key, value) text rows; none when it is not a JSON object.
_HEALTH_ENTRIES = ("jsonb_each_text(CASE WHEN jsonb_typeof(c.platform_health) = 'object' THEN c.platform_health "
                   "ELSE '{}'::jsonb END)")
# A client's platform_health as the pass uses it (libs.domain.platform_health.blocked_platforms): its entries with a
# blocking state only, as text (NULL when none), whatever else it holds.
_BLOCKING_HEALTH = f"""(SELECT jsonb_object_agg(e.key, e.value) FROM {_HEALTH_ENTRIES} e
        WHERE e.value IN {BLOCKING_STATES_SQL}) AS platform_health"""
_CLIENT_WITH_LOAD = f"""\
SELECT c.id, c.tenant_id, c.workspace_id, c.max_concurrent_monitor, c.max_queue_depth, c.interrupt_generation,
       {_BLOCKING_HEALTH}, coalesce((a.l ->> 0)::int, 0) AS in_progress, coalesce((a.l ->> 1)::int, 0) AS queued,
       coalesce((a.l ->> 2)::int, 0) > 0 OR c.id = ANY(h.clients) AS pending_high,
       coalesce((a.l ->> 3)::boolean, false) AS interrupt_overdue
"""
_LOAD_JOINS = """\
CROSS JOIN load
CROSS JOIN high h
CROSS JOIN LATERAL (SELECT load.by_client -> c.id::text AS l) a
"""

# Eligible clients with their monitor load. Set-based: one aggregate over the active work, folded into ONE jsonb
# object (client id -> [in_progress, queued, queued_high, interrupt_overdue]), and the clients with pending high work
# as one array, each looked up per eligible client: no join between the clients and the aggregate, so no plan can
# rescan the aggregate per client. As a join it did when the statistics were taken while no client was online (the
# planner estimated one client): a nested loop of 1,041 clients over 501 loads, 215 of the pass's 245 ms at 1,000,000
# ready tasks (docs/benchmarks.md "Backlog scale").
_CLIENTS = f"""
WITH load AS MATERIALIZED (
{_LOAD_BY_CLIENT}          GROUP BY 1) a
), high AS MATERIALIZED (
    -- Clients with pending high business work not yet running (its ready-list index, lane = {_PREEMPTING}).
    SELECT coalesce(array_agg(DISTINCT t.target_client_id), '{{}}') AS clients
    FROM monitoring_collect_tasks t
    WHERE t.dispatch_lane = {_PREEMPTING} AND t.status = 'pending' AND t.target_client_id IS NOT NULL
      AND {ready.NOT_ACTIVE_HASHED}
)
{_CLIENT_WITH_LOAD}FROM desktop_clients c
{_LOAD_JOINS}WHERE {ELIGIBLE_CLIENT_SQL}
"""

# The clients of some tenants (and some clients by id), eligible, with their monitor load: what a full pass reads of
# the fleet (docs/architecture.md "Full pass: clients of the window"), _CLIENTS for these clients only. The clients
# asked for come first: a probe of ix_clients_tenant_heartbeat per tenant (LATERAL .. OFFSET 0, eligibility tested
# above it, so no estimate of the last heartbeats can pick ix_clients_online_heartbeat: on statistics older than them,
# a row or so estimated, that walked every online client and compared each with every tenant asked for: 159 ms for a
# pass's three at 10,041 clients, docs/benchmarks.md "The full pass at 10,000 tenants"), those by id by the primary key.
# Their load is _CLIENTS' one aggregate over the active work of these clients only, their ids a hashed subplan (NOT ..
# NOT IN: a prepared statement's `= ANY(ARRAY(..))` compared every outstanding execution with every client read): at
# worst one read of the outstanding executions, whatever the statistics (a probe of the active work per client,
# planned on statistics taken while nothing was outstanding, filtered every outstanding execution per client:
# tests/integration/test_coordinator_idle_statistics.py); the clients with pending high work as in _CLIENTS, of these
# clients only (ix_collect_tasks_target_client).
_CLIENT_OF_COLUMNS = ("c.id, c.tenant_id, c.workspace_id, c.max_concurrent_monitor, c.max_queue_depth, "
                      "c.interrupt_generation, c.platform_health, c.online, c.disabled_at, c.last_heartbeat_at")
_CLIENTS_OF = f"""
WITH k AS MATERIALIZED (
    SELECT DISTINCT ON (c.id) c.id, c.tenant_id, c.workspace_id, c.max_concurrent_monitor, c.max_queue_depth,
           c.interrupt_generation, c.platform_health
    FROM (SELECT s.* FROM unnest(%(tenants)s::bigint[]) AS w(tenant_id)
          CROSS JOIN LATERAL (SELECT {_CLIENT_OF_COLUMNS} FROM desktop_clients c WHERE c.tenant_id = w.tenant_id
                              OFFSET 0) s
          UNION ALL
          SELECT {_CLIENT_OF_COLUMNS} FROM desktop_clients c WHERE c.id = ANY(%(ids)s::uuid[])
          OFFSET 0) c
    WHERE {ELIGIBLE_CLIENT_SQL}
), load AS MATERIALIZED (
{_LOAD_BY_CLIENT}          WHERE NOT (d.target_client_id NOT IN (SELECT id FROM k))
          GROUP BY 1) a
), high AS MATERIALIZED (
    SELECT coalesce(array_agg(DISTINCT t.target_client_id), '{{}}') AS clients
    FROM monitoring_collect_tasks t
    WHERE t.target_client_id = ANY(ARRAY(SELECT id FROM k)) AND t.dispatch_lane = {_PREEMPTING}
      AND t.status = 'pending' AND {ready.NOT_ACTIVE_HASHED}
)
{_CLIENT_WITH_LOAD}FROM k c
{_LOAD_JOINS}"""

# _CLIENTS_OF's answer as one JSON array of its rows, decoded by msgspec: 704 rows through dict_row, a ClientLoad each
# and the JSON of their health cost a full pass at 10,000 tenants ~10 ms of this process (docs/benchmarks.md).
_CLIENTS_OF_JSON = f"SELECT coalesce(json_agg(x), '[]')::text AS clients FROM ({_CLIENTS_OF}) x"
_client_loads = msgspec.json.Decoder(list[ClientLoad])

# A client reporting a blocking login state for some platform (libs.domain.platform_health.BLOCKING_STATES): the
# predicate of migration 070's partial index ix_clients_health_blocking, spelled as there (the planner uses a partial
# index only for a query repeating its predicate; tests/unit/test_health_blocking_index.py holds the two together).
HEALTH_BLOCKING_SQL = ("c.platform_health @? '$.* ? ("
                       + " || ".join(f'@ == "{state}"' for state in sorted(BLOCKING_STATES)) + ")'")

# The platform-health pauses (libs.domain.platform_health.paused_pairs, before the operators' overrides): the
# (tenant, platform code) pairs that every eligible client of the tenant reports a blocking state for. The blocking
# clients come from ix_clients_health_blocking (only they are in it), their tenants' eligible clients are counted by
# ix_clients_tenant_heartbeat: the cost follows the clients with a broken login, not the fleet. Every tenant's pause,
# with or without pending work: the gauge and `explain` show a pause whatever the pass reads.
_HEALTH_PAUSES = f"""
WITH b AS MATERIALIZED (
    SELECT c.tenant_id, h.key AS code, count(*) AS n
    FROM desktop_clients c
    CROSS JOIN LATERAL {_HEALTH_ENTRIES} h
    WHERE {HEALTH_BLOCKING_SQL} AND {ELIGIBLE_CLIENT_SQL} AND h.value IN {BLOCKING_STATES_SQL}
    GROUP BY 1, 2
)
SELECT b.tenant_id, b.code
FROM b
WHERE b.n = (SELECT count(*) FROM desktop_clients c WHERE c.tenant_id = b.tenant_id AND {ELIGIBLE_CLIENT_SQL})
"""

# An operator's per-(tenant, platform) override of the platform-health pause: 'pause' or 'ignore_health'.
_PLATFORM_HEALTH_OVERRIDES = "SELECT tenant_id, ai_platform_id, mode FROM platform_health_overrides"

_PLATFORM_ACTIVE = f"""
SELECT w.tenant_id, w.ai_platform_id, count(*) AS n
FROM {ready.ACTIVE_WORK} w
GROUP BY 1, 2
"""

# Platform limits and pauses, for both passes.
_PLATFORM_SETTINGS = """
SELECT p.id AS ai_platform_id, p.code, p.enabled, coalesce(s.max_concurrent, 1) AS max_concurrent,
       coalesce(s.paused, false) AS paused, coalesce(s.interrupt_soft_timeout_ms, 15000) AS soft_timeout_ms,
       coalesce(s.interrupt_hard_timeout_ms, 45000) AS hard_timeout_ms
FROM ai_platforms p LEFT JOIN platform_settings s ON s.ai_platform_id = p.id
"""

# The high pass's snapshot in ONE statement (one result to convert instead of five; the sub-results come back as
# JSON documents): the clock, the budget window it falls in and that window's cluster budget use, platform settings,
# the active executions of the tenants with ready high work, and the eligible clients that work can go to (its
# bound client, or the clients of its tenant and workspace) with their monitor load. The executions the pass
# writes are stamped with this clock, so they fall in the window whose budget was read. ELIGIBLE_CLIENT_SQL and
# _PLATFORM_SETTINGS are part of it.
_HIGH_SNAPSHOT = f"""
WITH w AS MATERIALIZED (
    SELECT c.ts, (floor(extract(epoch FROM c.ts) / %(window)s) * %(window)s)::bigint AS ws
    FROM (SELECT clock_timestamp() AS ts) c
), cand AS MATERIALIZED (
    -- Where ready high work is (a superset of the candidates: tasks with an active execution are not filtered
    -- out): a walk of the high lane of ix_collect_tasks_ready, without the candidate query's per-task probes.
    SELECT DISTINCT t.tenant_id, t.workspace_id, t.target_client_id
    FROM monitoring_collect_tasks t
    WHERE t.dispatch_lane = {_CLICK} AND t.status = 'pending' AND t.dispatch_after <= now()
)
SELECT extract(epoch FROM w.ts)::float8 AS now, w.ts, w.ws::float8 AS window_start,
       b.cluster_used, b.non_high_used,
       (SELECT coalesce(json_agg(p), '[]')::text FROM ({_PLATFORM_SETTINGS}) p) AS platforms,
       (SELECT coalesce(json_agg(a), '[]')::text FROM (
            SELECT d.tenant_id, d.ai_platform_id, count(*) AS n
            FROM {ready.ACTIVE_WORK} d
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


# (tenant, platform, lane) with pending work (either path): a loose index scan of ix_collect_tasks_ready_pair, one
# probe per (tenant, platform, lane). Per lane, so that a full pass walks, in each lane, the pairs with work in that
# lane only: over the pairs of every lane, a lane with work in a few pairs (retries) was read pair by pair through
# the thousands with scheduled work only, a window a pass (docs/architecture.md "Full pass: clients of the window").
# The (tenant, platform, lane) entries with pending work from the pair (%(tenant)s, %(platform)s) on, in that order, at
# most %(limit)s: a loose index scan of ix_collect_tasks_ready_pair, a probe per entry (so a read costs what it
# returns, not the pending tasks), answered as a row per lane with its pairs as two arrays in order (a row per pair
# took ~30 ms of the coordinator's CPU to decode at 10,000 tenants, the arrays ~7: docs/benchmarks.md "The full pass at
# 10,000 tenants").
_PENDING_PAIRS = """
WITH RECURSIVE pairs AS (
    (SELECT tenant_id, ai_platform_id, dispatch_lane, 1 AS n FROM monitoring_collect_tasks
     WHERE status = 'pending' AND (tenant_id, ai_platform_id) >= (%(tenant)s::bigint, %(platform)s::bigint)
     ORDER BY tenant_id, ai_platform_id, dispatch_lane LIMIT 1)
    UNION ALL
    SELECT n.tenant_id, n.ai_platform_id, n.dispatch_lane, p.n + 1 FROM pairs p
    CROSS JOIN LATERAL (
        SELECT tenant_id, ai_platform_id, dispatch_lane FROM monitoring_collect_tasks
        WHERE status = 'pending'
          AND (tenant_id, ai_platform_id, dispatch_lane) > (p.tenant_id, p.ai_platform_id, p.dispatch_lane)
        ORDER BY tenant_id, ai_platform_id, dispatch_lane LIMIT 1) n
    WHERE p.n < %(limit)s
)
SELECT dispatch_lane AS lane, array_agg(tenant_id ORDER BY n) AS tenants,
       array_agg(ai_platform_id ORDER BY n) AS platforms
FROM pairs GROUP BY 1
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

_HIGH_CANDIDATES = f"""
SELECT {_CANDIDATE_COLUMNS}
FROM monitoring_collect_tasks t {ready.ACTIVE_PROBE}
WHERE t.dispatch_lane = {_CLICK} AND {ready.READY_PROBED}
ORDER BY t.dispatch_priority DESC, t.enqueued_at, t.id
LIMIT %(limit)s
"""

# The high pass takes its locks while it reads, in the order every writer uses (clients, then tasks), so
# its write needs no _CLAIM round trip: first the clients that ready high work is bound to (share mode,
# as _LOCK_CLIENTS), then the high candidates themselves, locked (SKIP LOCKED: a task a collect-now is
# promoting right now is left to the pass its commit wakes) with the columns _CLAIM would re-read.
_LOCK_HIGH_CLIENTS = f"""
SELECT c.id FROM desktop_clients c
WHERE c.id IN (SELECT t.target_client_id FROM monitoring_collect_tasks t
               WHERE t.dispatch_lane = {_CLICK} AND t.status = 'pending'
                 AND t.target_client_id IS NOT NULL)
ORDER BY c.id
FOR SHARE OF c
"""

_HIGH_CANDIDATES_LOCKED = f"""
SELECT {_CANDIDATE_COLUMNS}, t.ctid AS row_ref, t.dispatch_priority, t.dispatch_lane, t.trigger_source,
       t.collect_request_id, t.question_id, t.enqueued_at AS enqueued_ts, t.brand_id, t.business_date,
       t.next_execution_id, t.execution_owner, {_CLICK_TRACEPARENT}
FROM monitoring_collect_tasks t {ready.ACTIVE_PROBE}
WHERE t.dispatch_lane = {_CLICK} AND {ready.READY_PROBED}
ORDER BY t.dispatch_priority DESC, t.enqueued_at, t.id
LIMIT %(limit)s
FOR UPDATE OF t SKIP LOCKED
"""

# The active-execution test is the hashed set (READY_BACKLOG), read once per statement, not a probe per task walked:
# see _CLAIM.
_PAIR_CANDIDATES = f"""
SELECT c.* FROM unnest(%(tenants)b::bigint[], %(platforms)b::bigint[], %(lanes)b::text[], %(limits)b::int[])
     AS p(tenant_id, ai_platform_id, lane, k)
CROSS JOIN LATERAL (
    SELECT {_CANDIDATE_COLUMNS}
    FROM monitoring_collect_tasks t
    WHERE t.tenant_id = p.tenant_id AND t.ai_platform_id = p.ai_platform_id AND t.dispatch_lane = p.lane
      AND {ready.READY_BACKLOG}
    -- The leading (equal) keys make ix_collect_tasks_ready_pair the only index giving this order, so the
    -- probe is a short range scan of its pair even when statistics are stale (the per-lane ready index
    -- would filter every other pair's rows out).
    ORDER BY t.tenant_id, t.ai_platform_id, t.dispatch_lane, t.dispatch_priority DESC, t.enqueued_at, t.id
    LIMIT p.k
) c
"""

# The write of a pass, in set-based steps whose plans do not depend on statistics (the tables change by
# tens of thousands of rows between two autovacuum analyses when a day's schedule comes due):
#   _LOCK_CLIENTS -> _CLAIM (lock the decided business rows by primary key and re-read them) ->
#   _CLIENTS_WITH_HIGH (lane rule re-check) -> the dispatcher filters -> libs.tasks.business.COUNT_DISPATCH_ATTEMPTS +
#   libs.tasks.executions.INSERT_EXECUTIONS.
#
# _CLAIM re-checks READY at write time (a concurrent collect-now may have promoted or bound a task, an
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
_CLAIM = f"""
SELECT t.*
FROM unnest(%(task_ids)s::bigint[]) WITH ORDINALITY AS u(id, n)
CROSS JOIN LATERAL (
    SELECT t.ctid AS row_ref, t.id, t.tenant_id, t.workspace_id, t.dispatch_priority, t.dispatch_lane,
           t.trigger_source, t.collect_request_id, t.question_id, t.enqueued_at, t.brand_id, t.ai_platform_id,
           t.business_date, t.target_client_id, t.next_execution_id, t.execution_owner, {_CLICK_TRACEPARENT}
    FROM monitoring_collect_tasks t
    WHERE t.id = u.id AND {ready.READY_BACKLOG}
    OFFSET 0
    FOR UPDATE OF t
) t
ORDER BY u.n
"""

# Lane rule re-checked at write time, after _LOCK_CLIENTS: a collect-now that committed since the snapshot
# wins, so no normal goes to a client that now has pending high work not already running.
_CLIENTS_WITH_HIGH = f"""
SELECT DISTINCT h.target_client_id AS client_id
FROM monitoring_collect_tasks h
LEFT JOIN LATERAL (SELECT true AS busy FROM desktop_tasks x WHERE x.monitor_task_id = h.id AND x.kind = 'monitor'
                   AND x.status IN ('in_progress', 'unknown') LIMIT 1) run ON true
WHERE h.target_client_id = ANY(%(clients)s::uuid[]) AND h.status = 'pending' AND h.dispatch_lane = {_PREEMPTING}
  AND run.busy IS NULL
"""

# Collect-now starts by updating its client's row (interrupt_generation): holding these rows in share
# mode orders a pass against a collect-now on the same client. Either the collect-now committed first
# (the DISPATCH re-check then sees its high work and sends no normal) or it waits for this pass and then
# cancels the normal executions this pass queued on its client.
# A primary-key probe per client, in the order given (the caller sorts the ids: every writer locks clients in id
# order), so the statement costs what it locks: as `id = ANY(..) ORDER BY id` its generic plan scanned every client
# (10,041 at 10,000 tenants) to lock 500, and the 500 ids went as text.
_LOCK_CLIENTS = """
SELECT c.id FROM unnest(%(ids)b::uuid[]) AS u(id)
CROSS JOIN LATERAL (SELECT c.id FROM desktop_clients c WHERE c.id = u.id FOR SHARE) c
"""


# ---- the operations ----------------------------------------------------------------------------------------------

# The row's columns in ClaimedTask's field order (the high pass's locked candidates carry the timestamp as enqueued_ts).
_CLAIMED_COLUMNS = ClaimedTask.__struct_fields__
_LOCKED_HIGH_COLUMNS = tuple("enqueued_ts" if f == "enqueued_at" else f for f in _CLAIMED_COLUMNS)
_platforms = msgspec.json.Decoder(list[PlatformSetting])
_actives = msgspec.json.Decoder(list[PlatformActive])
_high_clients = msgspec.json.Decoder(list[HighClientLoad])


def _candidate(r: Mapping[str, Any]) -> CandidateRow:
    return CandidateRow(id=r["id"], tenant_id=r["tenant_id"], workspace_id=r["workspace_id"],
                        ai_platform_id=r["ai_platform_id"], lane=r["lane"], priority=r["priority"],
                        enqueued_at=float(r["enqueued_at"]), target_client_id=r["target_client_id"])


def _claimed(r: Mapping[str, Any], columns: tuple[str, ...] = _CLAIMED_COLUMNS) -> ClaimedTask:
    return ClaimedTask(*map(r.__getitem__, columns))  # positional: ~1 us a row (a pass claims up to its batch)


def _platform(r: Mapping[str, Any]) -> PlatformSetting:
    return PlatformSetting(ai_platform_id=r["ai_platform_id"], code=r["code"], enabled=r["enabled"],
                           max_concurrent=int(r["max_concurrent"]), paused=r["paused"],
                           soft_timeout_ms=int(r["soft_timeout_ms"]), hard_timeout_ms=int(r["hard_timeout_ms"]))


def _client_load(r: Mapping[str, Any]) -> ClientLoad:
    return ClientLoad(id=r["id"], tenant_id=r["tenant_id"], workspace_id=r["workspace_id"],
                      max_concurrent_monitor=r["max_concurrent_monitor"], max_queue_depth=r["max_queue_depth"],
                      interrupt_generation=r["interrupt_generation"], platform_health=r["platform_health"],
                      in_progress=r["in_progress"], queued=r["queued"], pending_high=r["pending_high"],
                      interrupt_overdue=r["interrupt_overdue"])


async def read_pass_snapshot(conn: Conn, *, window_start: int, window_seconds: int, heartbeat_timeout_s: int,
                             all_clients: bool = True) -> PassSnapshot:
    """A full pass's snapshot in one round trip: the window's budget use (from the ledger when it counts the window,
    else counted), platform settings, active work per (tenant, platform), the operators' health overrides, the
    platform-health pauses and (`all_clients`) every eligible client with its load. A full pass reads the clients of
    its candidates' tenants instead (`clients_of`); `explain` and the health status read them all."""
    params = {"heartbeat_timeout_s": heartbeat_timeout_s}
    window = {"window_start": window_start, "window": window_seconds}
    async with conn.pipeline():
        budget = await conn.execute(_BUDGET_USE if all_clients else _BUDGET_TOTALS, window)
        platforms = await conn.execute(_PLATFORM_SETTINGS)
        active = await conn.execute(_PLATFORM_ACTIVE)
        loads = await conn.execute(_CLIENTS, params) if all_clients else None
        overrides = await conn.execute(_PLATFORM_HEALTH_OVERRIDES)
        pauses = await conn.execute(_HEALTH_PAUSES, params)
        return PassSnapshot(
            budget=[BudgetUse(r["tenant_id"] if all_clients else None, r["high"], int(r["n"]))
                    for r in await budget.fetchall()],
            platforms=[_platform(r) for r in await platforms.fetchall()],
            active=[PlatformActive(r["tenant_id"], r["ai_platform_id"], int(r["n"])) for r in await active.fetchall()],
            clients=[_client_load(r) for r in await loads.fetchall()] if loads is not None else [],
            overrides=[HealthOverride(r["tenant_id"], r["ai_platform_id"], r["mode"])
                       for r in await overrides.fetchall()],
            health_pauses=[HealthPause(r["tenant_id"], r["code"]) for r in await pauses.fetchall()])


class TenantsRead(msgspec.Struct, frozen=True):
    """What a full pass reads of some tenants: their eligible clients (and some by id) with their load, and (when
    asked for a window) the tenants' budget use in it."""

    clients: list[ClientLoad]
    budget: list[BudgetUse]


async def clients_of(conn: Conn, *, tenants: Sequence[int], ids: Sequence[uuid.UUID] = (),
                     heartbeat_timeout_s: int, window_start: int | None = None,
                     window_seconds: int = 60) -> TenantsRead:
    """The eligible clients of `tenants`, and those of `ids`, with their monitor load (what `read_pass_snapshot` reads
    of every eligible client, for these only) and, with `window_start`, the budget use of `tenants` in that window (what
    `budget_use` reads of every tenant): one round trip."""
    params = {"tenants": sorted(set(tenants)), "ids": sorted(set(ids), key=str),
              "heartbeat_timeout_s": heartbeat_timeout_s, "window_start": window_start, "window": window_seconds}
    async with conn.pipeline():
        cur = await conn.execute(_CLIENTS_OF_JSON, params)
        budget = (await conn.execute(_TENANTS_BUDGET_USE, params)
                  if window_start is not None and params["tenants"] else None)
        row = await cur.fetchone()
        assert row is not None
        return TenantsRead(
            clients=_client_loads.decode(row["clients"]),
            budget=[BudgetUse(r["tenant_id"], r["high"], int(r["n"])) for r in await budget.fetchall()]
            if budget is not None else [])


async def budget_use(conn: Conn, *, window_start: int, window_seconds: int) -> list[BudgetUse]:
    """A window's budget use per tenant and lane class (the full pass's reading of it)."""
    cur = await conn.execute(_BUDGET_USE, {"window_start": window_start, "window": window_seconds})
    return [BudgetUse(r["tenant_id"], r["high"], int(r["n"])) for r in await cur.fetchall()]


async def read_high_pass(conn: Conn, *, limit: int, window_seconds: int, heartbeat_timeout_s: int) -> HighRead | None:
    """The high pass's locks and reads (one round trip in the caller's transaction, after its pass lock): the clients
    bound to ready high work (share-locked), up to `limit` high candidates (locked, SKIP LOCKED) and the snapshot.
    None: no ready high work."""
    locked_cur = await conn.execute(_LOCK_HIGH_CLIENTS)
    found = await conn.execute(_HIGH_CANDIDATES_LOCKED, {"limit": limit})
    snapshot_cur = await conn.execute(_HIGH_SNAPSHOT, {"window": window_seconds,
                                                      "heartbeat_timeout_s": heartbeat_timeout_s})
    locked = frozenset(r["id"] for r in await locked_cur.fetchall())
    rows = await found.fetchall()
    stamp = await snapshot_cur.fetchone()
    assert stamp is not None
    if not rows:
        return None
    snapshot = HighSnapshot(
        now=float(stamp["now"]), ts=stamp["ts"], window_start=float(stamp["window_start"]),
        cluster_used=int(stamp["cluster_used"]), non_high_used=int(stamp["non_high_used"]),
        platforms=_platforms.decode(stamp["platforms"]), active=_actives.decode(stamp["active"]),
        clients=_high_clients.decode(stamp["clients"]))
    return HighRead(candidates=[_candidate(r) for r in rows],
                    tasks={r["id"]: _claimed(r, _LOCKED_HIGH_COLUMNS) for r in rows},
                    locked_clients=locked, snapshot=snapshot)


async def high_candidates(conn: Conn, *, limit: int) -> list[CandidateRow]:
    """Up to `limit` ready high tasks in dispatch order (not locked: a full pass's read)."""
    cur = await conn.execute(_HIGH_CANDIDATES, {"limit": limit})
    return [_candidate(r) for r in await cur.fetchall()]


async def pair_candidates(conn: Conn, *, tenants: Sequence[int], platforms: Sequence[int], lanes: Sequence[str],
                          limits: Sequence[int]) -> list[CandidateRow]:
    """The ready tasks of each (tenants[i], platforms[i], lanes[i]), up to limits[i] each, in dispatch order."""
    cur = await conn.execute(_PAIR_CANDIDATES, {"tenants": list(tenants), "platforms": list(platforms),
                                                "lanes": list(lanes), "limits": list(limits)})
    return [_candidate(r) for r in await cur.fetchall()]


async def claim(conn: Conn, *, client_ids: Sequence[uuid.UUID], task_ids: Sequence[int],
                normal_clients: Sequence[uuid.UUID]) -> Claim:
    """The write-time re-check, one round trip: share-lock the clients (in id order), lock and re-read the decided
    tasks still READY (in id order), and which `normal_clients` now have pending high work not running."""
    async with conn.pipeline():
        await conn.execute(_LOCK_CLIENTS, {"ids": sorted(set(client_ids))})  # in id order, whatever the caller gave
        cur = await conn.execute(_CLAIM, {"task_ids": sorted(task_ids)})
        with_high = (await conn.execute(_CLIENTS_WITH_HIGH, {"clients": list(normal_clients)})
                     if normal_clients else None)
        tasks = {r["id"]: _claimed(r) for r in await cur.fetchall()}
        clients = (frozenset(r["client_id"] for r in await with_high.fetchall()) if with_high is not None
                   else frozenset())
    return Claim(tasks=tasks, clients_with_high=clients)


async def pending_pairs(conn: Conn) -> set[tuple[int, int]]:
    """Every (tenant, platform) with a pending task, of any lane and either path."""
    return {pair for pairs in (await pending_lane_pairs(conn)).values() for pair in pairs}


async def pending_lane_pairs(conn: Conn) -> dict[str, set[tuple[int, int]]]:
    """Per lane, every (tenant, platform) with a pending task of that lane, on either path."""
    by_lane, _ = await pending_lane_pairs_slice(conn, start=None, limit=None)
    return {lane: set(pairs) for lane, pairs in by_lane.items()}


# The least (tenant, platform): where a read of every pair starts (ids are positive; both columns fit a bigint).
_FIRST_PAIR = (-(2**63), -(2**63))


async def pending_lane_pairs_slice(conn: Conn, *, start: tuple[int, int] | None, limit: int | None
                                   ) -> tuple[dict[str, list[tuple[int, int]]], tuple[int, int] | None]:
    """Per lane, in order, the (tenant, platform) pairs with a pending task of that lane, from the pair `start` (None:
    the first) on, and where they end: up to `limit` (pair, lane) entries (None: all). When the limit cut the read, the
    pair it was cut in is left out (its later lanes were not read) and returned as the end, the first pair not
    covered; else the end is None (every pair from `start` on was read)."""
    first = start if start is not None else _FIRST_PAIR
    cur = await conn.execute(_PENDING_PAIRS, {"tenant": first[0], "platform": first[1],
                                              "limit": limit if limit is not None else 2**31 - 1})
    by_lane = {r["lane"]: list(zip(r["tenants"], r["platforms"], strict=True)) for r in await cur.fetchall()}
    if limit is None or sum(len(pairs) for pairs in by_lane.values()) < limit:
        return by_lane, None
    end = max(pairs[-1] for pairs in by_lane.values() if pairs)
    return {lane: [pair for pair in pairs if pair < end] for lane, pairs in by_lane.items()}, end


class RequestsDispatched:
    """The answer of `mark_requests_dispatched`, read once the pass's pipeline has been sent (after its commit)."""

    def __init__(self, cur: AsyncCursor[dict[str, Any]]) -> None:
        self._cur = cur

    async def fetch(self) -> list[FirstDispatch]:
        return [FirstDispatch(r["id"], r["first"], float(r["latency_ms"])) for r in await self._cur.fetchall()]


async def mark_requests_dispatched(conn: Conn, counts: Mapping[uuid.UUID, int]) -> RequestsDispatched:
    """The pass dispatched counts[id] tasks of each collect-now request: counted, first dispatch stamped, accepted ->
    dispatching (queued in the caller's pipeline; `fetch` the answer after it was sent)."""
    cur = await conn.execute(collect_requests.MARK_DISPATCHED, {"ids": list(counts), "counts": list(counts.values())})
    return RequestsDispatched(cur)


_WARM_UP_PARAMS: dict[str, object] = {
    "window": 60, "heartbeat_timeout_s": 30, "limit": 1, "row_refs": ["(0,0)"], "ts": datetime(2000, 1, 1, tzinfo=UTC),
    "rows": "[]", "ids": [uuid.UUID(int=0)], "counts": [0],
}


def high_pass_warm_up() -> list[tuple[str, Mapping[str, object]]]:
    """What a new pooled connection of the coordinator plans before its first click (libs.db.pool: EXPLAIN, nothing
    runs): the high pass's statements, with parameters that match no row. The store names its own statements here,
    business.py's private one included: the pool only plans them."""
    return [(statement, _WARM_UP_PARAMS) for statement in (
        _HIGH_SNAPSHOT, _LOCK_HIGH_CLIENTS, _HIGH_CANDIDATES_LOCKED, business._COUNT_DISPATCH_ATTEMPTS,
        executions.INSERT_EXECUTIONS, collect_requests.MARK_DISPATCHED)]
