"""Write health of a database writer, shared with the coordinator's auto slow-down.

The coordinator pauses normal dispatch when the monitoring database is slow or contended (p95 write latency over
`db_write_p95_threshold_ms`, or more than `conflict_rate_threshold` of writes failing on a conflict). Its own
dispatch transactions alone say little (they are few, and none at all while it has nothing to dispatch), so the
real writers measure themselves: each ingest worker, projection worker and hub replica times its write
transactions in a rolling window (libs/domain/slowdown.WriteStats) and upserts its p95, write count and conflict
count into `writer_health` every `publish_interval_s`. The coordinator reads the rows updated within
`FRESH_S` (a dead replica's row stops counting) and takes the worst p95 and the overall conflict rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import psycopg
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.domain.slowdown import WriteStats

log = logging.getLogger("db.write_health")

FRESH_S = 30.0
# serialization_failure, deadlock_detected, lock_not_available (lock_timeout), unique_violation
CONFLICT_STATES = frozenset({"40001", "40P01", "55P03", "23505"})

PUBLISH = """
INSERT INTO writer_health (writer, instance, p95_ms, writes, conflicts, updated_at)
VALUES (%(writer)s, %(instance)s, %(p95_ms)s, %(writes)s, %(conflicts)s, now())
ON CONFLICT (writer, instance) DO UPDATE
SET p95_ms = EXCLUDED.p95_ms, writes = EXCLUDED.writes, conflicts = EXCLUDED.conflicts, updated_at = now()
"""
LEAVE = "DELETE FROM writer_health WHERE writer = %(writer)s AND instance = %(instance)s"

# The coordinator's read: the worst fresh p95 and the fresh totals.
FRESH_TOTALS = """
SELECT coalesce(max(p95_ms), 0) AS p95_ms, coalesce(sum(writes), 0)::bigint AS writes,
       coalesce(sum(conflicts), 0)::bigint AS conflicts
FROM writer_health WHERE updated_at > now() - make_interval(secs => %(fresh_s)s)
"""


def is_conflict(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.Error) and exc.sqlstate in CONFLICT_STATES


class WriterHealth:
    """Times one writer's transactions and publishes the window's figures for the coordinator."""

    def __init__(self, writer: str, instance: str, *, window_s: float = 60.0, min_samples: int = 20) -> None:
        self.writer = writer
        self.instance = instance
        self.stats = WriteStats(window_s=window_s, min_samples=min_samples)
        self.published = 0

    @contextlib.asynccontextmanager
    async def timed(self) -> AsyncIterator[None]:
        """Wrap one write transaction: its duration counts, and so does a conflict it fails on."""
        started = time.monotonic()
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, Exception):
                self.stats.record(time.monotonic(), (time.monotonic() - started) * 1000, is_conflict(exc))
            raise
        self.stats.record(time.monotonic(), (time.monotonic() - started) * 1000, False)

    async def publish(self, pool: AsyncConnectionPool[Conn]) -> None:
        now = time.monotonic()
        writes, conflicts = self.stats.counts(now)
        async with pool.connection() as conn:
            await conn.execute(PUBLISH, {"writer": self.writer, "instance": self.instance,
                                         "p95_ms": self.stats.p95_ms(now), "writes": writes,
                                         "conflicts": conflicts})
        self.published += 1

    async def run(self, pool: AsyncConnectionPool[Conn], stop: asyncio.Event, interval_s: float = 5.0) -> None:
        """Publish every `interval_s` until `stop`; then remove this replica's row."""
        while not stop.is_set():
            try:
                await self.publish(pool)
            except Exception as exc:  # the coordinator then sees this row go stale, which is what it should see
                log.warning("publishing write health failed", extra={"writer": self.writer, "error": str(exc)[:200]})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
        with contextlib.suppress(Exception):
            async with pool.connection() as conn:
                await conn.execute(LEAVE, {"writer": self.writer, "instance": self.instance})


@contextlib.asynccontextmanager
async def publishing(health: WriterHealth, pool: AsyncConnectionPool[Conn], interval_s: float) -> AsyncIterator[None]:
    """Publish `health` in the background for the block's lifetime (a service's resources)."""
    stop = asyncio.Event()
    task = asyncio.create_task(health.run(pool, stop, interval_s), name=f"write-health-{health.writer}")
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


def writer_health(settings: Settings, writer: str) -> WriterHealth:
    return WriterHealth(writer, settings.instance_id, window_s=settings.write_health_window_s,
                        min_samples=settings.write_health_min_samples)
