"""ingest-shard-workers: applies MonitorResults from the shard queues, shard-serially (docs/architecture.md §12.2)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aio_pika.abc import AbstractRobustConnection
from aiohttp import web

from libs.config import Settings
from libs.db.pool import make_pool
from libs.db.write_health import publishing, writer_health
from libs.http import make_app
from libs.mq.connection import connect
from libs.mq.topology import Topology, declare_ingest
from libs.runtime import SETTINGS, add_consumer_check, add_pool_check, background, base_app, serve
from services.ingest_shard_workers.consumer import IngestConfig, IngestWorker

WORKER = web.AppKey("ingest_worker", IngestWorker)
AMQP = web.AppKey("amqp", AbstractRobustConnection)


def build(settings: Settings) -> web.Application:
    app = base_app(settings, make_app())

    async def resources(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        topology = Topology(settings.mq_prefix, settings.ingest_shards)
        # One connection per concurrently applying shard would starve Postgres: shards share a few.
        pool = make_pool(settings, name="ingest-shard-workers", min_size=1, max_size=max(2, settings.db_pool_max))
        await pool.open(wait=True, timeout=30)
        connection = await connect(settings.amqp_url, name=f"ingest-shard-workers-{settings.instance_id}")
        async with connection.channel() as channel:
            await declare_ingest(channel, topology)
        app[AMQP] = connection
        app[WORKER] = IngestWorker(connection, topology, pool, IngestConfig(
            instance_id=settings.instance_id,
            batch_size=settings.ingest_batch_size,
            prefetch=settings.ingest_prefetch,
            member_heartbeat_s=settings.ingest_member_heartbeat_seconds,
            member_timeout_s=settings.ingest_member_timeout_seconds,
            retention_hours=settings.ingest_applied_retention_hours,
        ), write_health=(health := writer_health(settings, "ingest")))
        add_pool_check(app, pool)

        add_consumer_check(app, connection, app[WORKER].subscribed, "shard queues")
        async with publishing(health, pool, settings.write_health_publish_s):
            yield
        await connection.close()
        await pool.close()

    app.cleanup_ctx.append(resources)
    background(app, "ingest-shard-workers", lambda stop: app[WORKER].run(stop))
    return app


def main() -> None:
    serve("ingest-shard-workers", build)
