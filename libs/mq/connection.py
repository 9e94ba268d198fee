"""RabbitMQ connection helpers: robust connections that reconnect, explicit prefetch, dead letters."""

from __future__ import annotations

import asyncio
import logging
import time

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from libs.mq.topology import Topology

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


async def dead_letter(channel: AbstractChannel, topology: Topology, dlq: str,
                      message: AbstractIncomingMessage, reason: str) -> None:
    """Copy a message to its DLQ with the reason in headers; the caller then acks the original."""
    headers = dict(message.headers or {})
    headers["x-dead-letter-reason"] = reason[:1000]
    headers["x-original-routing-key"] = message.routing_key or ""
    headers["x-original-exchange"] = message.exchange or ""
    exchange = await channel.get_exchange(topology.dlx_exchange, ensure=False)
    await exchange.publish(
        aio_pika.Message(
            body=message.body,
            headers=headers,
            content_type=message.content_type,
            message_id=message.message_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        routing_key=dlq,
    )
    log.warning("message dead-lettered", extra={"dlq": dlq, "reason": reason[:200],
                                                 "message_id": message.message_id})
