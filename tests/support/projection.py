"""projection-worker test helpers: a running worker and pump, and the aggregates by definition
(`libs.ingest.aggregates`) to compare the stored projections with."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import date

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import MonitorResult
from libs.db.pool import Conn
from libs.ingest.aggregates import CitationFact, DailyAggregate, RunFact, compute_daily
from libs.ingest.citations import parse_citations
from libs.mq.connection import connect
from libs.mq.topology import Topology, declare_projection
from libs.outbox.pump import AmqpPublisher, OutboxPump, PumpConfig
from services.projection_worker.consumer import ProjectionWorker
from services.projection_worker.rebuild import ProjectionConfig, Rebuilder
from tests.support.ingest_factory import fetch, running_worker

DAY = date(2026, 3, 15)
COLUMNS = ("runs", "succeeded_runs", "failed_runs", "brand_mentioned_runs", "mention_rate", "citations",
           "distinct_cited_domains")

Rows = tuple[tuple[object, ...] | None, dict[int, tuple[object, ...]]]


@contextlib.asynccontextmanager
async def running_projection(pool: AsyncConnectionPool[Conn], settings: Settings, topology: Topology, *,
                             instance_id: str = "projection-a", sweep_interval_s: float = 1.0,
                             merge_window_s: float = 5.0, merge_batch: int = 200,
                             rebuilder: Rebuilder | None = None) -> AsyncIterator[ProjectionWorker]:
    connection = await connect(settings.amqp_url, name=instance_id)
    async with connection.channel() as channel:
        await declare_projection(channel, topology)
    worker = ProjectionWorker(connection, topology,
                              rebuilder or Rebuilder(pool, ProjectionConfig(instance_id=instance_id)),
                              sweep_interval_s=sweep_interval_s, merge_window_s=merge_window_s,
                              merge_batch=merge_batch)
    async with running_worker(connection, worker):
        yield worker


@contextlib.asynccontextmanager
async def running_pump(pool: AsyncConnectionPool[Conn], settings: Settings, topology: Topology) -> (
    AsyncIterator[None]
):
    publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="pump")
    await publisher.start()
    pump = OutboxPump(pool, publisher, PumpConfig(claimed_by="pump", poll_interval_s=0.2),
                      listen_url=settings.database_url)
    stop = asyncio.Event()
    task = asyncio.create_task(pump.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await publisher.close()


def _row(aggregate: DailyAggregate) -> tuple[object, ...]:
    return tuple(getattr(aggregate, c) for c in COLUMNS)


def expected_from_results(results: list[MonitorResult]) -> tuple[DailyAggregate | None, dict[int, DailyAggregate]]:
    """The aggregates by definition (libs.ingest.aggregates), from what was sent (one result per key here)."""
    runs = [RunFact(i, r.ai_platform_id, r.status, r.brand_mentioned) for i, r in enumerate(results)]
    cites = [CitationFact(i, c.domain) for i, r in enumerate(results) if r.status == "succeeded"
             for c in parse_citations(r.citations)]
    return compute_daily(runs, cites)


async def recomputed_from_facts(pool: AsyncConnectionPool[Conn], tenant_id: int, brand_id: int,
                                business_date: date = DAY) -> tuple[DailyAggregate | None, dict[int, DailyAggregate]]:
    """A from-scratch recomputation over the raw fact tables."""
    runs = await fetch(pool, "SELECT id, ai_platform_id, status, brand_mentioned FROM question_monitor_runs "
                             "WHERE tenant_id = %s AND brand_id = %s AND business_date = %s",
                       tenant_id, brand_id, business_date)
    cites = await fetch(pool, "SELECT run_id, domain FROM monitoring_citation_facts "
                              "WHERE tenant_id = %s AND brand_id = %s AND business_date = %s",
                        tenant_id, brand_id, business_date)
    return compute_daily([RunFact(int(r["id"]), int(r["ai_platform_id"]), str(r["status"]),  # type: ignore[call-overload]
                                  bool(r["brand_mentioned"])) for r in runs],
                         [CitationFact(int(c["run_id"]), str(c["domain"])) for c in cites])  # type: ignore[call-overload]


async def stored(pool: AsyncConnectionPool[Conn], tenant_id: int, brand_id: int, business_date: date = DAY) -> Rows:
    cols = ", ".join(COLUMNS)
    brand = await fetch(pool, f"SELECT {cols} FROM monitoring_brand_daily "
                              "WHERE tenant_id = %s AND brand_id = %s AND business_date = %s",
                        tenant_id, brand_id, business_date)
    platforms = await fetch(pool, f"SELECT ai_platform_id, {cols} FROM monitoring_brand_platform_daily "
                                  "WHERE tenant_id = %s AND brand_id = %s AND business_date = %s",
                            tenant_id, brand_id, business_date)
    return (tuple(brand[0][c] for c in COLUMNS) if brand else None,
            {int(p["ai_platform_id"]): tuple(p[c] for c in COLUMNS) for p in platforms})  # type: ignore[call-overload]


def as_rows(computed: tuple[DailyAggregate | None, dict[int, DailyAggregate]]) -> Rows:
    brand, platforms = computed
    return (None if brand is None else _row(brand), {k: _row(v) for k, v in platforms.items()})
