"""The coordinator's reads of the backlog, and aging's: the gauges' statements (the high lane, the census slices of
the pending tasks, the clients' queues, the execution paths), the exact whole-backlog counts the census is tested
against, and the aging round's reads (docs/architecture.md "The task store: the coordinator's operations").

Operations over private statements (module constants composed from libs/tasks/ready.py's fragments), answering
msgspec Structs. The whole-backlog ones read READY through its hashed form (READY_BACKLOG): their EXPLAIN tests
(tests/integration/test_coordinator_backlog*.py) hold them to it.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from libs.db.pool import Conn
from libs.domain.lanes import AGING_LANES_SQL, CLICK_LANE, NORMAL_BACKLOG_SQL
from libs.tasks import legacy, ready

# ---- the answers -------------------------------------------------------------------------------------------------


class HighBacklog(msgspec.Struct, frozen=True):
    """Ready high tasks and the oldest one's wait (ms) since it became high work."""

    n: int
    oldest_ms: float


class CensusSlice(msgspec.Struct, frozen=True):
    """A census slice, counted: ready non-high tasks per lane and tenant (`lanes`: lane -> tenant -> tasks), pending
    tasks per execution path (`owners`), ready normal tasks per wait bucket (`waits`), the slice's size (`pending`)
    and its last task (`last_id`). Counts of zero are left out."""

    lanes: dict[str, dict[int, int]]
    owners: dict[str, int]
    waits: dict[int, int]
    pending: int
    last_id: int | None


class LaneBacklog(msgspec.Struct, frozen=True):
    """Ready tasks of one (tenant, lane), exactly, and the oldest one's wait (ms)."""

    tenant_id: int
    lane: str
    n: int
    oldest_ms: float


class PathsInFlight(msgspec.Struct, frozen=True):
    """The rollout percentage as stored (the settings' default when never stored), and the work in flight per
    execution path: active executions, live legacy leases."""

    rollout_percentage: int
    desktop_tasks: int
    legacy: int


class AgingCandidate(msgspec.Struct, frozen=True):
    """A ready normal task an aging round may boost, with its wait in minutes, its row's ctid and xmin as text (`tid`
    and `version`: business.apply_aging writes the row found there, if unchanged) and how many ready tasks the walk
    numbered up to it (`walked`)."""

    tid: str
    version: str
    id: int
    lane: str
    priority: int
    aging_boost: int
    enqueued_at: datetime
    walked: int
    wait_minutes: float


# ---- the statements ----------------------------------------------------------------------------------------------

# The click lane as an SQL literal ('high').
_CLICK = f"'{CLICK_LANE.name}'"

# ---- aging ---------------------------------------------------------------------------------------

_AGING_READY_COUNT = f"""
SELECT count(*) AS n FROM monitoring_collect_tasks t
WHERE t.dispatch_lane IN {AGING_LANES_SQL} AND {ready.READY_BACKLOG}
"""

# The next batch of a round: ready normal tasks after `after` whose boost is below the cap, oldest first, among the
# oldest %(share)s ready normal tasks after `after` (the round's share: its boundary). One index-only walk of
# ix_collect_tasks_aging (migration 021 includes dispatch_after and aging_boost) numbers the ready tasks as it goes
# (row_number()) and skips the capped ones from the index; it stops at the batch's last task (the outer LIMIT, in the
# walk's own order: ordered by `walked` the planner sorted the whole share first) or at the share's end (the inner
# LIMIT, which also tells the planner that the walk stops: without it, it read every pending task by another index and
# sorted them). Only the tasks returned are read from the heap (by id), with their ctid and xmin for the UPDATE
# (business.apply_aging writes by ctid, a Tid Scan instead of a second index lookup, and only an unchanged row).
# `walked` is how far into the share a task lies: the next batch takes the share's rest after it. The boundary was a
# statement of its own before, an OFFSET walk of the whole share: 99,950 rows, 72.8 ms at 1,000,000 ready tasks, for
# a round that boosts a few hundred of them (docs/benchmarks.md "Aging at the dispatch pace").
_AGING_OLDEST = f"""
SELECT t.ctid::text AS tid, t.xmin::text AS version, t.id, t.dispatch_lane AS lane, t.dispatch_priority AS priority,
       t.aging_boost, t.enqueued_at, o.walked, extract(epoch FROM (now() - t.enqueued_at)) / 60.0 AS wait_minutes
FROM (SELECT w.id, w.walked
      FROM (SELECT t.enqueued_at, t.id, t.aging_boost, row_number() OVER (ORDER BY t.enqueued_at, t.id) AS walked
            FROM monitoring_collect_tasks t
            WHERE t.dispatch_lane IN {AGING_LANES_SQL} AND {ready.READY_BACKLOG}
              AND (t.enqueued_at, t.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint)
            ORDER BY t.enqueued_at, t.id
            LIMIT %(share)s) w
      WHERE w.aging_boost < %(cap)s
      ORDER BY w.enqueued_at, w.id
      LIMIT %(batch)s) o
CROSS JOIN LATERAL (SELECT t.ctid, t.xmin, t.id, t.dispatch_lane, t.dispatch_priority, t.aging_boost, t.enqueued_at
                    FROM monitoring_collect_tasks t WHERE t.id = o.id OFFSET 0) t
ORDER BY o.walked
"""

# ---- observation ---------------------------------------------------------------------------------

# Every maintenance tick: the high lane (bounded by what collect-now may promote), exactly. A high task waits from
# when it became high work (collect-now sets dispatch_after to the click), not from when the scanner first created
# it hours earlier: the high-lane alert must measure the click's wait.
_HIGH_BACKLOG = f"""
SELECT count(*) AS n,
       coalesce(extract(epoch FROM (now() - min(greatest(t.enqueued_at, t.dispatch_after)))) * 1000, 0) AS oldest_ms
FROM monitoring_collect_tasks t
WHERE t.dispatch_lane = {_CLICK} AND {ready.READY_BACKLOG}
"""

# The rest of the backlog gauges come from a census of the pending tasks taken a slice at a time
# (maintenance.BacklogCensus): the next %(rows)s pending tasks after %(after)s in id order (ix_collect_tasks_pending_id,
# migration 022, holds only pending tasks) per tick, instead of the three statements below over the whole backlog
# every tick (4.9 s at 1,000,000 ready tasks). Per slice, in one aggregation (grouping sets): ready non-high tasks per
# tenant and lane, pending tasks per execution path, the ready normal tasks' waits in logarithmic buckets (64 a factor
# e: 1.6% wide) measured at %(reference)s (epoch seconds) so that the slices of a sweep add up, and the slice's size
# and last id (the empty grouping set). The groupings come back as one row of JSON objects (decoded by msgspec into
# CensusSlice): a row per (tenant, lane) was 10,000 rows a tick at 10,000 tenants, whose decoding into dicts and
# Structs took more of the tick than the statement did (docs/benchmarks.md "The maintenance tick and the aging round
# at 10,000 tenants and 1,000,000 tasks").
_CENSUS_SLICE = f"""
WITH g AS (
    SELECT grouping(s.tenant_id, s.lane) = 0 AS by_lane, grouping(s.owner) = 0 AS by_owner,
           grouping(s.bucket) = 0 AS by_bucket, s.tenant_id, s.lane, s.owner, s.bucket,
           count(*) FILTER (WHERE s.ready AND s.lane <> {_CLICK}) AS ready,
           count(*) FILTER (WHERE s.ready AND s.lane IN {NORMAL_BACKLOG_SQL}) AS ready_normal,
           count(*) AS pending, max(s.id) AS last_id
    FROM (SELECT r.*, CASE WHEN r.ready AND r.lane IN {NORMAL_BACKLOG_SQL} THEN
                          floor(ln(1 + greatest(0, %(reference)s::float8
                                                   - extract(epoch FROM r.enqueued_at)::float8)) * 64)
                      END::int AS bucket
          FROM (SELECT t.id, t.tenant_id, t.dispatch_lane AS lane, t.execution_owner AS owner, t.enqueued_at,
                       coalesce({ready.READY_BACKLOG}, false) AS ready
                FROM monitoring_collect_tasks t
                WHERE t.status = 'pending' AND t.id > %(after)s
                ORDER BY t.id
                LIMIT %(rows)s) r) s
    GROUP BY GROUPING SETS ((s.tenant_id, s.lane), (s.owner), (s.bucket), ())
)
SELECT (SELECT coalesce(json_object_agg(l.lane, l.tenants), '{{}}')
        FROM (SELECT g.lane, json_object_agg(g.tenant_id, g.ready) AS tenants
              FROM g WHERE g.by_lane AND g.ready > 0 GROUP BY g.lane) l)::text AS lanes,
       (SELECT coalesce(json_object_agg(g.owner, g.pending), '{{}}') FROM g WHERE g.by_owner)::text AS owners,
       (SELECT coalesce(json_object_agg(g.bucket, g.ready_normal), '{{}}')
        FROM g WHERE g.by_bucket AND g.ready_normal > 0)::text AS waits,
       g.pending, g.last_id
FROM g WHERE NOT (g.by_lane OR g.by_owner OR g.by_bucket)
"""

# The same counts exactly, each in one statement over the whole backlog: what the census is tested against.
_BACKLOG = f"""
SELECT t.tenant_id, t.dispatch_lane AS lane, count(*) AS n,
       extract(epoch FROM (now() - min(CASE WHEN t.dispatch_lane = {_CLICK}
                                            THEN greatest(t.enqueued_at, t.dispatch_after)
                                            ELSE t.enqueued_at END))) * 1000 AS oldest_ms
FROM monitoring_collect_tasks t
WHERE {ready.READY_BACKLOG}
GROUP BY 1, 2
"""

_NORMAL_WAIT_P99 = f"""
SELECT coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM (now() - t.enqueued_at)) * 1000),
                0) AS p99_ms
FROM monitoring_collect_tasks t
WHERE t.dispatch_lane IN {NORMAL_BACKLOG_SQL} AND {ready.READY_BACKLOG}
"""

_OWNER_COUNTS = """
SELECT execution_owner, count(*) AS n FROM monitoring_collect_tasks WHERE status = 'pending' GROUP BY 1
"""

# The online clients (their ids, one comma-separated text) and the queued executions per client (one JSON object,
# client id -> queued), as two independent aggregates: client_queue_depths gives each online client its count, 0 when
# it has none. No join for the planner to get wrong: joined, the queue was planned as a nested loop over every queued
# execution per client once `online` or the queue had changed since the last ANALYZE (286 ms for 1,041 clients and 500
# queued executions), and as a lookup per client in one JSON object (what this replaced) it still built a row, then a
# JSON entry, per online client: 22 ms at 10,000 online clients against 13 ms now, a row per online client before that
# (docs/benchmarks.md "The maintenance tick and the aging round at 10,000 tenants and 1,000,000 tasks").
_CLIENT_QUEUE_DEPTH = f"""
SELECT (SELECT coalesce(string_agg(c.id::text, ','), '') FROM desktop_clients c WHERE c.online) AS online,
       (SELECT coalesce(json_object_agg(d.target_client_id, d.n), '{{}}')
        FROM (SELECT w.target_client_id, count(*) AS n FROM {ready.ACTIVE_WORK} w
              WHERE w.status = 'queued' AND w.target_client_id IS NOT NULL GROUP BY 1) d)::text AS queued
"""

# The rollout as stored (libs.tasks.fragments.ROLLOUT_OWNER_SQL's reading, with the settings' default) and the work
# in flight per execution path (libs.tasks.legacy.IN_FLIGHT_BY_PATH: counts over the two partial indexes of live
# work), in one round trip for the maintenance tick's gauges.
_PATHS = f"""
SELECT coalesce((SELECT (v.value #>> '{{}}')::int FROM dispatch_settings v WHERE v.key = 'rollout_percentage'),
                %(default_rollout)s) AS rollout_percentage,
       f.desktop_tasks, f.legacy
FROM ({legacy.IN_FLIGHT_BY_PATH}) f
"""

# ---- the operations ----------------------------------------------------------------------------------------------


async def high_backlog(conn: Conn) -> HighBacklog:
    """The high lane's ready tasks, exactly (bounded by what collect-now may promote)."""
    cur = await conn.execute(_HIGH_BACKLOG)
    row = await cur.fetchone()
    assert row is not None  # an aggregate: always one row
    return HighBacklog(int(row["n"]), float(row["oldest_ms"] or 0))


# The census slice's and the client queues' JSON objects (their keys are text in JSON: msgspec reads them as ints).
_SLICE_LANES = msgspec.json.Decoder(dict[str, dict[int, int]])
_SLICE_OWNERS = msgspec.json.Decoder(dict[str, int])
_SLICE_WAITS = msgspec.json.Decoder(dict[int, int])
_DEPTHS_DECODER = msgspec.json.Decoder(dict[str, int])


async def census_slice(conn: Conn, *, after_id: int, rows: int, reference: float) -> CensusSlice:
    """The next `rows` pending tasks after `after_id` in id order, counted (see CensusSlice); waits measured at
    `reference` (epoch seconds), so that the slices of a sweep add up."""
    cur = await conn.execute(_CENSUS_SLICE, {"after": after_id, "rows": rows, "reference": reference})
    row = await cur.fetchone()
    assert row is not None  # the empty grouping set: always one row
    return CensusSlice(lanes=_SLICE_LANES.decode(row["lanes"]), owners=_SLICE_OWNERS.decode(row["owners"]),
                       waits=_SLICE_WAITS.decode(row["waits"]), pending=int(row["pending"]), last_id=row["last_id"])


async def backlog_exact(conn: Conn) -> list[LaneBacklog]:
    """Ready tasks per (tenant, lane) over the whole backlog in one statement (what the census is tested against)."""
    cur = await conn.execute(_BACKLOG)
    return [LaneBacklog(r["tenant_id"], r["lane"], int(r["n"]), float(r["oldest_ms"] or 0))
            for r in await cur.fetchall()]


async def normal_wait_p99_ms(conn: Conn) -> float:
    """The 99th percentile of the ready normal tasks' waits (ms), over the whole backlog."""
    cur = await conn.execute(_NORMAL_WAIT_P99)
    row = await cur.fetchone()
    return float(row["p99_ms"]) if row else 0.0


async def pending_by_owner(conn: Conn) -> dict[str, int]:
    """Pending tasks per execution path, over the whole backlog."""
    cur = await conn.execute(_OWNER_COUNTS)
    return {r["execution_owner"]: int(r["n"]) for r in await cur.fetchall()}


async def client_queue_depths(conn: Conn) -> dict[str, int]:
    """Every online client's queued monitor work, by client id (text)."""
    cur = await conn.execute(_CLIENT_QUEUE_DEPTH)
    row = await cur.fetchone()
    assert row is not None  # two aggregates: always one row
    depths = dict.fromkeys(row["online"].split(","), 0) if row["online"] else {}
    for client, queued in _DEPTHS_DECODER.decode(row["queued"]).items():
        if client in depths:  # an offline client's queue is not shown
            depths[client] = queued
    return depths


async def paths_in_flight(conn: Conn, *, default_rollout: int) -> PathsInFlight:
    """The rollout as stored (`default_rollout` when never stored) and the work in flight per path, one round trip."""
    cur = await conn.execute(_PATHS, {"default_rollout": default_rollout})
    row = await cur.fetchone()
    assert row is not None
    return PathsInFlight(int(row["rollout_percentage"]), int(row["desktop_tasks"]), int(row["legacy"]))


async def ready_normal_count(conn: Conn) -> int:
    """Ready normal (and normal_boosted) tasks, over the whole backlog."""
    cur = await conn.execute(_AGING_READY_COUNT)
    row = await cur.fetchone()
    return int(row["n"]) if row else 0


async def aging_candidates(conn: Conn, *, cap: int, after: tuple[datetime, int], share: int,
                           batch: int) -> list[AgingCandidate]:
    """Up to `batch` ready normal tasks whose boost is below `cap` among the `share` oldest ready normal tasks after
    `after` ((enqueued_at, id)), oldest first."""
    cur = await conn.execute(_AGING_OLDEST, {"cap": cap, "after_at": after[0], "after_id": after[1], "share": share,
                                             "batch": batch})
    return [AgingCandidate(r["tid"], r["version"], r["id"], r["lane"], r["priority"], r["aging_boost"],
                           r["enqueued_at"], int(r["walked"]), float(r["wait_minutes"]))
            for r in await cur.fetchall()]
