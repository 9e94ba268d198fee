"""The ingest gauges say what is true now: a stuck batch raises `monitor_result_ingest_lag_ms` while it is stuck
(it was set only when a batch started, so a stuck one showed a small lag and IngestLagHigh stayed silent), and
`monitoring_pg_write_qps` counts every writer's rows in the database (it counted ingest's own rows only)."""

from __future__ import annotations

import re
import time
from datetime import date
from pathlib import Path

import psycopg
import yaml
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from tests.support.ingest_factory import fetch, make_executions, make_result, make_world, publish, running_ingest
from tests.support.wait import eventually

DAY = date(2026, 3, 18)
PROMTOOL_CASE = Path(__file__).resolve().parents[1] / "prometheus" / "ingest_lag_test.yaml"


def gauge(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def stuck_batch_slope() -> float:
    """Lag gained per second of wall clock by the promtool case's stuck-batch series (ms/s): the series the alert
    test is built from must be the one this test observes."""
    doc = yaml.safe_load(PROMTOOL_CASE.read_text())
    [case] = [t for t in doc["tests"] if any('scenario="stuck-batch"' in s["series"] for s in t["input_series"])]
    [series] = [s for s in case["input_series"] if 'scenario="stuck-batch"' in s["series"]]
    interval_s = int(str(case["interval"]).rstrip("s"))
    stuck = re.search(r"(\d+)\+(\d+)x\d+", series["values"])
    assert stuck is not None, series["values"]
    return int(stuck.group(2)) / interval_s


async def test_a_stuck_batch_raises_the_lag_gauge_as_it_waits(pool: AsyncConnectionPool[Conn], settings, topology,
                                                              amqp, database_url: str) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        [execution] = await make_executions(conn, world, business_date=DAY)
    result = make_result(execution, shards=topology.ingest_shards)
    shard = str(result.shard)
    samples: list[tuple[float, float]] = []
    async with running_ingest(pool, settings, topology):
        # The test holds the business task's row lock: ingest's batch (which locks it first) waits on it.
        blocker = await psycopg.AsyncConnection.connect(database_url)
        try:
            await blocker.execute("BEGIN")
            await blocker.execute("SELECT 1 FROM monitoring_collect_tasks WHERE id = %s FOR UPDATE",
                                  (execution.monitor_task_id,))
            await publish(amqp, topology, [result])

            def rising() -> bool:
                samples.append((time.monotonic(), gauge("monitor_result_ingest_lag_ms", shard=shard)))
                return samples[-1][1] >= 3000

            await eventually(rising, timeout=20, interval=0.25, message="the lag gauge rising past 3 s")
            assert await fetch(pool, "SELECT 1 FROM ingest_applied_results") == []  # still stuck, not applied
        finally:
            await blocker.rollback()
            await blocker.close()
        await eventually(lambda: _applied(pool), timeout=20, message="the batch applied once the lock went")
        await eventually(lambda: gauge("monitor_result_ingest_lag_ms", shard=shard) == 0, timeout=5,
                         message="the lag gauge back to 0")
    # Growing with the wall clock while stuck (about 1,000 ms per second, the slope of the promtool case), not a
    # value frozen when the batch started.
    moving = [(t, v) for t, v in samples if v > 0]
    (t0, v0), (t1, v1) = moving[0], moving[-1]
    assert t1 - t0 >= 1.5, samples
    slope = (v1 - v0) / (t1 - t0)
    assert 0.7 * 1000 <= slope <= 1.3 * 1000, (slope, samples)
    assert stuck_batch_slope() == 1000


async def _applied(pool: AsyncConnectionPool[Conn]) -> bool:
    return bool(await fetch(pool, "SELECT 1 FROM ingest_applied_results"))


async def test_write_rate_gauge_counts_every_writer_of_the_database(pool: AsyncConnectionPool[Conn], settings,
                                                                    topology) -> None:
    async with running_ingest(pool, settings, topology):
        await eventually(lambda: REGISTRY.get_sample_value("monitoring_pg_write_qps") is not None, timeout=15,
                         message="a first write-rate figure")
        async with pool.connection() as conn:
            # Not ingest: another writer's 60,000 rows, which the old per-replica count of ingest's rows missed.
            await conn.execute("CREATE TABLE gauge_write_burst (n int)")
            await conn.execute("INSERT INTO gauge_write_burst SELECT generate_series(1, 60000)")
        # 60,000 rows within one or two samples (every INGEST_MEMBER_HEARTBEAT_SECONDS, 2 s): well above 5,000/s.
        await eventually(lambda: gauge("monitoring_pg_write_qps") >= 5000, timeout=20,
                         message="the burst in the write rate")
        # And back down once nobody writes (the gauge is a rate over the last interval, not a running total).
        await eventually(lambda: gauge("monitoring_pg_write_qps") < 1000, timeout=20, message="the rate falling")
