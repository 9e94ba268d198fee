"""Ingest and projection lag read from Postgres, for readers outside the workers (auto slow-down, §12.4).

The workers export the same figures as `monitor_result_ingest_lag_ms{shard}` and
`monitor_projection_rebuild_lag_ms`; these queries give them to any process with a connection. The ingest lag reads the
task tables, so its statement is the task store's (libs/tasks/ingest_ops.py).
"""

from __future__ import annotations

from libs.db.pool import Conn
from libs.tasks import ingest_ops

# Oldest projection rebuild request not yet served.
PROJECTION_LAG_SQL = """
SELECT coalesce(extract(epoch FROM now() - min(requested_at)) * 1000, 0)::float8 AS lag_ms
FROM projection_rebuild_queue
"""


async def ingest_lag_ms(conn: Conn) -> float:
    """Age of the oldest result accepted and not applied yet (ms): the task store's read (libs/tasks/ingest_ops.py)."""
    return await ingest_ops.oldest_unapplied_result_age_ms(conn)


async def projection_lag_ms(conn: Conn) -> float:
    cur = await conn.execute(PROJECTION_LAG_SQL)
    row = await cur.fetchone()
    return max(0.0, float(row["lag_ms"])) if row else 0.0
