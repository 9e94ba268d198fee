"""outbox-pump: publishes committed outbox rows to RabbitMQ with publisher confirms."""

from __future__ import annotations

from aiohttp import web

from libs.config import Settings
from libs.mq.topology import Topology
from libs.outbox.pump import AmqpPublisher, OutboxPump, PumpConfig
from libs.runtime import Lifetime, Service, Worker, add_broker_check

SERVICE = Service("outbox-pump")


async def start(life: Lifetime) -> Worker:
    settings = life.settings
    pool = await life.pool(min_size=2, max_size=4)
    publisher = await life.start(AmqpPublisher(settings.amqp_url, Topology(settings.mq_prefix, settings.ingest_shards),
                                               timeout=settings.outbox_publish_timeout_seconds,
                                               name=life.instance_name))
    pump = OutboxPump(pool, publisher, PumpConfig(
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
    add_broker_check(life.app, publisher.ready)
    return pump.run


def build(settings: Settings) -> web.Application:
    return SERVICE.worker_app(settings, start)


def main() -> None:
    SERVICE.serve(build)
