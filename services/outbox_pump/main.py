"""outbox-pump: publishes committed outbox rows to RabbitMQ with publisher confirms."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from libs.config import Settings
from libs.db.pool import make_pool
from libs.http import add_readiness_check, make_app
from libs.mq.topology import Topology
from libs.outbox.pump import AmqpPublisher, OutboxPump, PumpConfig
from libs.runtime import SETTINGS, add_pool_check, background, base_app, serve

PUMP = web.AppKey("pump", OutboxPump)


def build(settings: Settings) -> web.Application:
    app = base_app(settings, make_app())

    async def resources(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        pool = make_pool(settings, name="outbox-pump", min_size=2, max_size=4)
        await pool.open(wait=True, timeout=30)
        publisher = AmqpPublisher(settings.amqp_url, Topology(settings.mq_prefix, settings.ingest_shards),
                                  timeout=settings.outbox_publish_timeout_seconds,
                                  name=f"outbox-pump-{settings.instance_id}")
        await publisher.start()
        app[PUMP] = OutboxPump(pool, publisher, PumpConfig(
            claimed_by=settings.instance_id,
            batch_size=settings.outbox_batch_size,
            poll_interval_s=settings.outbox_poll_interval_ms / 1000,
            listen=settings.outbox_listen,
            lease_seconds=settings.outbox_claim_lease_seconds,
            backoff_base_ms=settings.outbox_backoff_base_ms,
            backoff_max_ms=settings.outbox_backoff_max_ms,
            retention_hours=settings.outbox_retention_hours,
            concurrency=settings.outbox_concurrency,
        ), listen_url=settings.database_url)
        add_pool_check(app, pool)

        async def broker() -> None:
            if not publisher.ready():
                raise ConnectionError("broker connection not ready")

        add_readiness_check(app, "rabbitmq", broker)
        yield
        await publisher.close()
        await pool.close()

    app.cleanup_ctx.append(resources)
    background(app, "outbox-pump", lambda stop: app[PUMP].run(stop))
    return app


def main() -> None:
    serve("outbox-pump", build)
