"""dispatch-hub: composition root. Resources open in cleanup_ctx; loops run via background()."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aio_pika.abc import AbstractRobustConnection
from aiohttp import web
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.db.write_health import WriterHealth, publishing, writer_health
from libs.dispatch_settings import SettingsCache
from libs.gc_control import CalmFullCollections
from libs.http import make_app
from libs.mq.topology import Topology
from libs.runtime import SETTINGS, Lifetime, Service, add_broker_check, background
from services.dispatch_hub.auth import ClientAuthenticator
from services.dispatch_hub.gateway import Gateway
from services.dispatch_hub.http_api import (
    AUTH,
    CONTEXT,
    GATEWAY,
    HANDSHAKES,
    MAX_BODY,
    UPGRADE_LIMITS,
    UpgradeLimits,
    add_routes,
)
from services.dispatch_hub.leases import HubContext, PlatformCodes, SafePointStats
from services.dispatch_hub.logic import TokenBuckets
from services.dispatch_hub.results import AmqpResultPublisher, RoutingTableRouter

SERVICE = Service("dispatch-hub")
POOL_MAX = 6
# The hub is calm (its full garbage collection may run) with no handshake waiting for a slot and at most this many
# sockets opened or closed since the last look (a second before).
CALM_SOCKET_CHANGES = 20


def build(settings: Settings) -> web.Application:
    settings.push_lease_key()  # fail closed: push-lease enabled without PUSH_LEASE_SECRET, no service
    app = SERVICE.app(settings, _start, http=make_app(max_body_bytes=settings.max_body_bytes))
    app[MAX_BODY] = settings.max_body_bytes
    app[UPGRADE_LIMITS] = _upgrade_limits(settings)
    app[HANDSHAKES] = asyncio.Semaphore(settings.hub_handshake_concurrency)
    add_routes(app)
    app.on_shutdown.append(_close_sockets)
    _run_loops(app)
    return app


def _upgrade_limits(settings: Settings) -> UpgradeLimits:
    """WebSocket upgrades allowed per address and per client (token buckets)."""
    return UpgradeLimits(
        by_address=TokenBuckets(settings.hub_upgrades_per_address_per_s, settings.hub_upgrade_burst_per_address),
        by_client=TokenBuckets(settings.hub_upgrades_per_client_per_s, settings.hub_upgrade_burst_per_client),
        trusted_proxies=settings.trusted_proxy_networks())


async def _start(life: Lifetime) -> None:
    """Postgres pool, broker connection, result publisher and gateway for the app's lifetime; on the way out the
    gateway drains first and everything closes in reverse order."""
    app, settings = life.app, life.settings
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    pool = await life.pool(min_size=2, max_size=POOL_MAX)
    amqp = await life.broker()
    router = RoutingTableRouter(pool, settings.ingest_shards)
    publisher = await life.start(AmqpResultPublisher(amqp, topology, timeout=settings.hub_result_confirm_timeout_s,
                                                     router=router))
    health = writer_health(settings, "hub")
    gateway = _gateway(app, settings, pool, amqp, topology, health)
    gateway.on_live_hubs = app[UPGRADE_LIMITS].share_among
    await gateway.start()
    _install(app, settings, pool, gateway, publisher, health, router)
    life.on_stop(lambda: _drain_gateway(app, pool, gateway))
    await life.enter(publishing(health, pool, settings.write_health_publish_s))


def _gateway(app: web.Application, settings: Settings, pool: AsyncConnectionPool[Conn],
             amqp: AbstractRobustConnection, topology: Topology, health: WriterHealth) -> Gateway:
    return Gateway(
        pool, amqp, topology, hub_id=settings.instance_id,
        heartbeat_interval_s=settings.hub_ping_interval_s,
        heartbeat_timeout_s=settings.heartbeat_timeout_seconds,
        heartbeat_flush_s=settings.hub_heartbeat_flush_s,
        max_sockets_per_client=settings.hub_max_sockets_per_client,
        revocation_check_s=settings.hub_revocation_check_s,
        on_revoked=lambda client_id: app[AUTH].forget(client_id),
        write_health=health, push_key=settings.push_lease_key(), rebalance_slack=settings.hub_rebalance_slack,
        reconnect_spread_ms=settings.hub_drain_reconnect_spread_ms)


def _install(app: web.Application, settings: Settings, pool: AsyncConnectionPool[Conn], gateway: Gateway,
             publisher: AmqpResultPublisher, health: WriterHealth, router: RoutingTableRouter) -> None:
    """What the handlers use (client auth, the gateway, the calls' context) and the readiness checks."""
    app[AUTH] = ClientAuthenticator(pool, cache_ttl_s=settings.hub_auth_cache_s,
                                    negative_ttl_s=settings.hub_auth_negative_cache_s)
    app[GATEWAY] = gateway
    app[CONTEXT] = HubContext(pool=pool, settings=SettingsCache(pool, max_age_s=5.0), platforms=PlatformCodes(),
                              safe_points=SafePointStats(), publisher=publisher,
                              ingest_shards=settings.ingest_shards, router=router, write_health=health)
    add_broker_check(app, lambda: gateway.ready() and publisher.ready())


async def _drain_gateway(app: web.Application, pool: AsyncConnectionPool[Conn], gateway: Gateway) -> None:
    """Drain the gateway, write what is buffered (heartbeats, safe points: best effort), then close it (before the
    result publisher, the broker connection and the pool)."""
    await gateway.drain()
    await gateway.heartbeats.flush()
    with contextlib.suppress(Exception):
        await app[CONTEXT].safe_points.flush(pool)
    await gateway.close()


async def _close_sockets(app: web.Application) -> None:
    settings = app[SETTINGS]
    await app[GATEWAY].close_all(reconnect_spread_ms=settings.hub_drain_reconnect_spread_ms,
                                 deadline_s=settings.hub_drain_deadline_s)


def _run_loops(app: web.Application) -> None:
    """The gateway's background loops and the safe-point flush, for the app's lifetime."""
    background(app, "heartbeat-writer", lambda stop: app[GATEWAY].heartbeats.run(stop))
    background(app, "websocket-pinger", lambda stop: app[GATEWAY].run_pinger(stop))
    background(app, "revocation-sweep", lambda stop: app[GATEWAY].run_revocation_sweep(stop))
    background(app, "safe-point-flush", lambda stop: app[CONTEXT].safe_points.run(
        app[CONTEXT].pool, stop, app[SETTINGS].hub_safe_point_flush_s))
    settings = app[SETTINGS]
    if settings.hub_gc_full_collection_s:  # no full collection over every socket's objects in the middle of a storm
        collections = CalmFullCollections(every_s=settings.hub_gc_full_collection_s, calm=_calm(app))
        background(app, "gc-full-collections", collections.run)


def _calm(app: web.Application) -> Callable[[], bool]:
    """Whether no storm is on: no handshake waits for a slot and few sockets came or went since the last call."""
    seen = [-1]

    def calm() -> bool:
        gateway = app.get(GATEWAY)
        if gateway is None:  # still starting
            return False
        changed, seen[0] = gateway.sockets_changed - seen[0], gateway.sockets_changed
        return changed <= CALM_SOCKET_CHANGES and not app[HANDSHAKES].locked()

    return calm


def main() -> None:
    SERVICE.serve(build)
