"""ingest-shard-workers: applies MonitorResults from the shard queues, shard-serially (docs/architecture.md §12.2)."""

from __future__ import annotations

from aiohttp import web

from libs.config import Settings
from libs.db.write_health import writer_health
from libs.ingest.routing import RoutingStore
from libs.mq.topology import Topology, declare_ingest
from libs.runtime import Lifetime, Service, Worker
from services.ingest_shard_workers.consumer import IngestConfig, IngestWorker

SERVICE = Service("ingest-shard-workers")


async def start(life: Lifetime) -> Worker:
    settings = life.settings
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    # One connection per concurrently applying shard would starve Postgres: shards share a few.
    pool = await life.pool(min_size=1, max_size=max(2, settings.db_pool_max))
    store = RoutingStore(settings.ingest_shards)
    async with pool.connection() as conn:
        routing = await store.state(conn)
    # The active routing epoch's queues only: a draining or retired epoch's are never bound again.
    connection = await life.broker(declare=lambda channel: declare_ingest(channel, topology, [routing.active]))
    worker = IngestWorker(connection, topology, pool, IngestConfig(
        instance_id=settings.instance_id,
        batch_size=settings.ingest_batch_size,
        prefetch=settings.ingest_prefetch,
        member_heartbeat_s=settings.ingest_member_heartbeat_seconds,
        member_timeout_s=settings.ingest_member_timeout_seconds,
        retention_hours=settings.ingest_applied_retention_hours,
        db_outage_hold_s=settings.ingest_db_outage_hold_seconds,
    ), write_health=(health := writer_health(settings, "ingest")))
    return await life.consume(connection, worker, "shard queues", health, pool)


def build(settings: Settings) -> web.Application:
    return SERVICE.worker_app(settings, start)


def main() -> None:
    SERVICE.serve(build)
