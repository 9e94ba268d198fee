"""RabbitMQ connection helpers: robust connections that reconnect, explicit prefetch, dead letters."""

from __future__ import annotations

import asyncio
import logging
import time

import aio_pika
from aio_pika.abc import AbstractRobustConnection
from yarl import URL

log = logging.getLogger("mq")

# A lost broker connection is re-made this often (aio-pika's robust connection waits a fixed interval, never
# longer): back within about a second of the broker.
RECONNECT_INTERVAL_S = 1.0
# The AMQP heartbeat asked for (the lower of client's and server's wins; RabbitMQ's own is 60 s, and values under
# 5 s risk false alarms): aiormq declares a silent broker dead after three missed heartbeats plus a margin, about
# 18 s with 5 s, instead of ~3 minutes with the server's 60 s.
DEFAULT_HEARTBEAT_S = 5


def with_heartbeat(amqp_url: str, heartbeat_s: int) -> str:
    """`amqp_url` asking for `heartbeat_s`, unless it asks for a heartbeat of its own."""
    url = URL(amqp_url)
    if "heartbeat" in url.query:
        return amqp_url
    return str(url.update_query(heartbeat=heartbeat_s))


async def connect(amqp_url: str, *, name: str, timeout: float = 30.0,
                  heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> AbstractRobustConnection:
    """connect_robust, retried until `timeout` so a service can start before the broker; once connected it
    reconnects every RECONNECT_INTERVAL_S for as long as the broker is away."""
    deadline = time.monotonic() + timeout
    delay = 0.2
    url = with_heartbeat(amqp_url, heartbeat_s)
    while True:
        try:
            conn: AbstractRobustConnection = await aio_pika.connect_robust(
                url, client_properties={"connection_name": name}, timeout=10,
                reconnect_interval=RECONNECT_INTERVAL_S,
            )
            return conn
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPConnectionError):
            if time.monotonic() >= deadline:
                raise
            log.warning("broker unreachable, retrying", extra={"delay_s": delay})
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_INTERVAL_S)

