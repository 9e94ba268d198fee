"""dispatch-hub: composition root. Resources open in cleanup_ctx; loops run via background()."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from libs.config import Settings
from libs.db.pool import make_pool
from libs.db.write_health import publishing, writer_health
from libs.dispatch_settings import SettingsCache
from libs.http import add_readiness_check, make_app
from libs.mq.connection import connect as mq_connect
from libs.mq.topology import Topology
from libs.runtime import SETTINGS, add_pool_check, background, base_app, serve
from services.dispatch_hub.auth import ClientAuthenticator
from services.dispatch_hub.gateway import Gateway
from services.dispatch_hub.http_api import (
    AUTH,
    CONTEXT,
    GATEWAY,
    MAX_BODY,
    UPGRADE_LIMITS,
    UpgradeLimits,
    add_routes,
)
from services.dispatch_hub.leases import HubContext, PlatformCodes, SafePointStats
from services.dispatch_hub.logic import TokenBuckets
from services.dispatch_hub.results import AmqpResultPublisher

POOL_MAX = 6


def build(settings: Settings) -> web.Application:
    app = base_app(settings, make_app(max_body_bytes=settings.max_body_bytes))
    app[MAX_BODY] = settings.max_body_bytes
    app[UPGRADE_LIMITS] = UpgradeLimits(
        by_address=TokenBuckets(settings.hub_upgrades_per_address_per_s, settings.hub_upgrade_burst_per_address),
        by_client=TokenBuckets(settings.hub_upgrades_per_client_per_s, settings.hub_upgrade_burst_per_client))
    add_routes(app)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        topology = Topology(settings.mq_prefix, settings.ingest_shards)
        pool = make_pool(settings, name="dispatch-hub", min_size=2, max_size=POOL_MAX)
        await pool.open(wait=True, timeout=30)
        amqp = await mq_connect(settings.amqp_url, name=f"dispatch-hub-{settings.instance_id}")
        publisher = AmqpResultPublisher(amqp, topology, timeout=settings.hub_result_confirm_timeout_s)
        await publisher.start()
        gateway = Gateway(
            pool, amqp, topology, hub_id=settings.instance_id,
            heartbeat_interval_s=settings.hub_ping_interval_s,
            heartbeat_timeout_s=settings.heartbeat_timeout_seconds,
            heartbeat_flush_s=settings.hub_heartbeat_flush_s,
            max_sockets_per_client=settings.hub_max_sockets_per_client,
            revocation_check_s=settings.hub_revocation_check_s,
            on_revoked=lambda client_id: app[AUTH].forget(client_id),
            write_health=(health := writer_health(settings, "hub")))
        await gateway.start()
        app[AUTH] = ClientAuthenticator(pool, cache_ttl_s=settings.hub_auth_cache_s,
                                        negative_ttl_s=settings.hub_auth_negative_cache_s)
        app[GATEWAY] = gateway
        app[CONTEXT] = HubContext(pool=pool, settings=SettingsCache(pool, max_age_s=5.0), platforms=PlatformCodes(),
                                  safe_points=SafePointStats(), publisher=publisher,
                                  ingest_shards=settings.ingest_shards, write_health=health)
        add_pool_check(app, pool)

        async def broker() -> None:
            if not (gateway.ready() and publisher.ready()):
                raise ConnectionError("broker connection not ready")

        add_readiness_check(app, "rabbitmq", broker)
        async with publishing(health, pool, settings.write_health_publish_s):
            yield
        await gateway.drain()
        await gateway.heartbeats.flush()
        with contextlib.suppress(Exception):
            await app[CONTEXT].safe_points.flush(pool)
        await gateway.close()
        await publisher.close()
        await amqp.close()
        await pool.close()

    async def on_shutdown(app: web.Application) -> None:
        await app[GATEWAY].close_all()

    app.cleanup_ctx.append(resources)
    app.on_shutdown.append(on_shutdown)
    background(app, "heartbeat-writer", lambda stop: app[GATEWAY].heartbeats.run(stop))
    background(app, "websocket-pinger", lambda stop: app[GATEWAY].run_pinger(stop))
    background(app, "revocation-sweep", lambda stop: app[GATEWAY].run_revocation_sweep(stop))
    background(app, "safe-point-flush", lambda stop: app[CONTEXT].safe_points.run(
        app[CONTEXT].pool, stop, app[SETTINGS].hub_safe_point_flush_s))
    return app


def main() -> None:
    serve("dispatch-hub", build)
