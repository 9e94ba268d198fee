"""Capture what reaches an exchange: an exclusive queue bound with a pattern."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection


class Capture:
    def __init__(self) -> None:
        self.messages: list[AbstractIncomingMessage] = []
        self.arrived = asyncio.Event()

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        self.messages.append(message)
        await message.ack()
        self.arrived.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m.body for m in self.messages]


@contextlib.asynccontextmanager
async def capture(connection: AbstractRobustConnection, exchange: str, pattern: str = "#") -> (
    AsyncIterator[Capture]
):
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=1000)
    ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True, auto_delete=True)
    await queue.bind(ex, routing_key=pattern)
    cap = Capture()
    tag = await queue.consume(cap.on_message)
    try:
        yield cap
    finally:
        with contextlib.suppress(Exception):
            await queue.cancel(tag)
        await channel.close()
