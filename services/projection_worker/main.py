"""projection-worker: coalesced rebuilds of monitoring_brand_daily / monitoring_brand_platform_daily."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aio_pika.abc import AbstractRobustConnection
from aiohttp import web

from libs.config import Settings
from libs.db.pool import make_pool
from libs.db.write_health import publishing, writer_health
from libs.http import make_app
from libs.mq.connection import connect
from libs.mq.topology import Topology, declare_projection
from libs.runtime import SETTINGS, add_consumer_check, add_pool_check, background, base_app, serve
from services.projection_worker.consumer import ProjectionWorker
from services.projection_worker.rebuild import ProjectionConfig, Rebuilder

WORKER = web.AppKey("projection_worker", ProjectionWorker)
AMQP = web.AppKey("amqp", AbstractRobustConnection)


def build(settings: Settings) -> web.Application:
    app = base_app(settings, make_app())

    async def resources(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        topology = Topology(settings.mq_prefix, settings.ingest_shards)
        pool = make_pool(settings, name="projection-worker", min_size=1,
                         max_size=max(2, min(settings.db_pool_max, settings.projection_concurrency + 1)))
        await pool.open(wait=True, timeout=30)
        connection = await connect(settings.amqp_url, name=f"projection-worker-{settings.instance_id}")
        async with connection.channel() as channel:
            await declare_projection(channel, topology)
        rebuilder = Rebuilder(pool, ProjectionConfig(instance_id=settings.instance_id,
                                                     lease_s=settings.projection_claim_lease_seconds,
                                                     max_attempts=settings.projection_max_attempts),
                              write_health=(health := writer_health(settings, "projection")))
        app[AMQP] = connection
        app[WORKER] = ProjectionWorker(connection, topology, rebuilder,
                                       concurrency=settings.projection_concurrency,
                                       sweep_interval_s=settings.projection_sweep_interval_ms / 1000,
                                       merge_window_s=settings.projection_merge_window_ms / 1000,
                                       merge_batch=settings.projection_merge_batch)
        add_pool_check(app, pool)

        add_consumer_check(app, connection, app[WORKER].subscribed, "projection queue")
        async with publishing(health, pool, settings.write_health_publish_s):
            yield
        await connection.close()
        await pool.close()

    app.cleanup_ctx.append(resources)
    background(app, "projection-worker", lambda stop: app[WORKER].run(stop))
    return app


def main() -> None:
    serve("projection-worker", build)
