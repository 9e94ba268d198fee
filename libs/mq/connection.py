"""RabbitMQ connection helpers: robust connections that reconnect, explicit prefetch, dead letters."""

from __future__ import annotations

import asyncio
import logging
import time

import aio_pika
from aio_pika.abc import AbstractRobustConnection

log = logging.getLogger("mq")


async def connect(amqp_url: str, *, name: str, timeout: float = 30.0) -> AbstractRobustConnection:
    """connect_robust, retried until `timeout` so a service can start before the broker."""
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            conn: AbstractRobustConnection = await aio_pika.connect_robust(
                amqp_url, client_properties={"connection_name": name}, timeout=10, reconnect_interval=1.0
            )
            return conn
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPConnectionError):
            if time.monotonic() >= deadline:
                raise
            log.warning("broker unreachable, retrying", extra={"delay_s": delay})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

