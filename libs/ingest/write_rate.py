"""`monitoring_pg_write_qps`: rows written per second to the monitoring database by every writer, not just ingest.

Postgres counts the rows each database's transactions inserted, updated and deleted (`pg_stat_database`,
`tup_inserted + tup_updated + tup_deleted`, published by each backend at the end of its transactions, at
most about a second late); the gauge is the delta of that counter between two samples over the seconds
between them. Per-statement counts would need the `pg_stat_statements` extension, which the project does not
require; rows are what the write path's capacity is spent on. Every ingest replica samples the same database,
so dashboards take `max`, not `sum`, across replicas.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from libs.db.pool import Conn

ROWS_WRITTEN_SQL = """
SELECT (tup_inserted + tup_updated + tup_deleted)::bigint AS rows_written
FROM pg_stat_database WHERE datname = current_database()
"""


@dataclass(frozen=True, slots=True)
class WriteSample:
    at_s: float  # monotonic seconds
    rows_written: int


def rows_per_second(previous: WriteSample | None, current: WriteSample) -> float | None:
    """Rows written per second between two samples; None without a usable earlier sample (the first one, or the
    statistics were reset in between, which makes the counter go down)."""
    if previous is None or current.at_s <= previous.at_s or current.rows_written < previous.rows_written:
        return None
    return (current.rows_written - previous.rows_written) / (current.at_s - previous.at_s)


async def sample_rows_written(conn: Conn) -> WriteSample:
    cur = await conn.execute(ROWS_WRITTEN_SQL)
    row = await cur.fetchone()
    return WriteSample(time.monotonic(), int(row["rows_written"]) if row else 0)


class WriteRateGauge:
    """Keeps the previous sample; `update` returns the rate since it (None on the first call or after a reset)."""

    def __init__(self) -> None:
        self._previous: WriteSample | None = None

    async def update(self, conn: Conn) -> float | None:
        current = await sample_rows_written(conn)
        rate = rows_per_second(self._previous, current)
        self._previous = current
        return rate
