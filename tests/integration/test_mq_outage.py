"""A broker that goes away and comes back, for one client (a TCP proxy cut and restored, the shared RabbitMQ left
running): readiness is false while the connection is lost and true again within seconds of the restore."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

from aiohttp import web

from libs.config import Settings
from libs.http import READINESS_CHECKS
from libs.mq.connection import connect
from libs.runtime import add_consumer_check
from tests.support.tcpproxy import TcpProxy
from tests.support.wait import eventually


async def _ready(app: web.Application) -> bool:
    try:
        await app[READINESS_CHECKS]["rabbitmq"]()
    except ConnectionError:
        return False
    return True


async def test_a_consumers_readiness_follows_its_broker_connection(settings: Settings) -> None:
    url = urlparse(settings.amqp_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 5672)
    await proxy.start()
    proxied = settings.amqp_url.replace(f"{url.hostname}:{url.port or 5672}", f"127.0.0.1:{proxy.port}")
    connection = await connect(proxied, name="mq-outage-under-test")
    try:
        subscribed = asyncio.Event()
        subscribed.set()
        app = web.Application()
        add_consumer_check(app, connection, subscribed, "test queues")
        assert await _ready(app)
        await proxy.cut()
        # A robust connection is not `is_closed` while it reconnects; readiness must still say it is lost.
        await eventually(lambda: _ready_negated(app), timeout=5, message="readiness false after the cut")
        down_until = time.monotonic() + 4.0

        async def outage_over() -> bool:
            assert not await _ready(app), "ready while the broker is unreachable"
            return time.monotonic() >= down_until

        await eventually(outage_over, timeout=10, interval=0.2, message="the outage")
        await proxy.restore()
        restored = time.monotonic()
        await eventually(lambda: _ready(app), timeout=5, message="readiness back within 5 s of the broker")
        assert time.monotonic() - restored < 5
    finally:
        await connection.close()
        await proxy.close()


async def _ready_negated(app: web.Application) -> bool:
    return not await _ready(app)
