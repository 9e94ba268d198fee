"""Ingest and projection lag read from Postgres, for readers outside the workers (auto slow-down, §12.4).

The workers export the same figures as `monitor_result_ingest_lag_ms{shard}` and
`monitor_projection_rebuild_lag_ms`; these queries give them to any process with a connection.
"""

from __future__ import annotations

from libs.db.pool import Conn

# Results the hub accepted (published, then stamped result_received_at) that ingest has not applied yet, on both
# execution paths: an execution still in progress (or unknown) with its result received, and a legacy lease still in
# progress with its result received (ingest ends the lease when it applies the result: docs/legacy-path.md). The
# oldest of the two; least() skips a path with none.
INGEST_LAG_SQL = """
SELECT coalesce(extract(epoch FROM now() - least(
           (SELECT min(result_received_at) FROM desktop_tasks
            WHERE status IN ('in_progress', 'unknown') AND result_received_at IS NOT NULL),
           (SELECT min(result_received_at) FROM legacy_leases
            WHERE status = 'in_progress' AND result_received_at IS NOT NULL))) * 1000, 0)::float8 AS lag_ms
"""

# Oldest projection rebuild request not yet served.
PROJECTION_LAG_SQL = """
SELECT coalesce(extract(epoch FROM now() - min(requested_at)) * 1000, 0)::float8 AS lag_ms
FROM projection_rebuild_queue
"""


async def ingest_lag_ms(conn: Conn) -> float:
    cur = await conn.execute(INGEST_LAG_SQL)
    row = await cur.fetchone()
    return max(0.0, float(row["lag_ms"])) if row else 0.0


async def projection_lag_ms(conn: Conn) -> float:
    cur = await conn.execute(PROJECTION_LAG_SQL)
    row = await cur.fetchone()
    return max(0.0, float(row["lag_ms"])) if row else 0.0
