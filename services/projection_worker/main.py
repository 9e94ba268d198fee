"""projection-worker: coalesced rebuilds of monitoring_brand_daily / monitoring_brand_platform_daily."""

from __future__ import annotations

from aiohttp import web

from libs.config import Settings
from libs.db.write_health import writer_health
from libs.mq.topology import Topology, declare_projection
from libs.runtime import Lifetime, Service, Worker
from services.projection_worker.consumer import ProjectionWorker
from services.projection_worker.rebuild import ProjectionConfig, Rebuilder

SERVICE = Service("projection-worker")


async def start(life: Lifetime) -> Worker:
    settings = life.settings
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    pool = await life.pool(min_size=1, max_size=max(2, min(settings.db_pool_max, settings.projection_concurrency + 1)))
    connection = await life.broker(declare=lambda channel: declare_projection(channel, topology))
    rebuilder = Rebuilder(pool, ProjectionConfig(instance_id=settings.instance_id,
                                                 lease_s=settings.projection_claim_lease_seconds,
                                                 max_attempts=settings.projection_max_attempts),
                          write_health=(health := writer_health(settings, "projection")))
    worker = ProjectionWorker(connection, topology, rebuilder,
                              concurrency=settings.projection_concurrency,
                              sweep_interval_s=settings.projection_sweep_interval_ms / 1000,
                              merge_window_s=settings.projection_merge_window_ms / 1000,
                              merge_batch=settings.projection_merge_batch,
                              event_batch=settings.projection_event_batch,
                              refused_hold_s=settings.projection_refused_hold_seconds)
    return await life.consume(connection, worker, "projection queue", health, pool)


def build(settings: Settings) -> web.Application:
    return SERVICE.worker_app(settings, start)


def main() -> None:
    SERVICE.serve(build)
