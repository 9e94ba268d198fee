"""Capture what reaches an exchange: an exclusive queue bound with a pattern.

A `dispatch_batch` envelope (libs/outbox/dispatch_batches.py: the relay's dispatch events towards one hub in one
message) is captured as the events it carries whose routing keys match the pattern, each as a message of its own
would have been (`CapturedEvent`), so a test sees the same events whichever way the relay packed them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from libs.mq.hub_routing import HUB_KEY_PREFIX
from libs.outbox.dispatch_batches import BATCH_KEY_TAIL
from services.dispatch_hub.envelope import is_envelope, unwrap


@dataclass(frozen=True, slots=True)
class CapturedEvent:
    """One event of a captured envelope, as its own message would have been."""

    routing_key: str
    body: bytes
    message_id: str | None
    type: str | None
    headers: dict[str, Any]


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching (`*` one word, `#` zero or more)."""
    def match(p: list[str], k: list[str]) -> bool:
        if not p:
            return not k
        if p[0] == "#":
            return any(match(p[1:], k[i:]) for i in range(len(k) + 1))
        return bool(k) and (p[0] in ("*", k[0])) and match(p[1:], k[1:])
    return match(pattern.split("."), key.split("."))


class Capture:
    def __init__(self, pattern: str = "#") -> None:
        self.pattern = pattern
        self.messages: list[AbstractIncomingMessage | CapturedEvent] = []
        self.arrived = asyncio.Event()

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        if is_envelope(message):
            for event in unwrap(message.body).events:
                if topic_matches(self.pattern, event.routing_key):
                    self.messages.append(CapturedEvent(event.routing_key, event.body, event.message_id,
                                                       event.message_type, dict(event.headers or {})))
        else:
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
    batches = f"{HUB_KEY_PREFIX}.*.{BATCH_KEY_TAIL}"
    if not topic_matches(pattern, f"{HUB_KEY_PREFIX}.x.{BATCH_KEY_TAIL}"):
        await queue.bind(ex, routing_key=batches)  # envelopes carrying events that match (filtered on arrival)
    cap = Capture(pattern)
    tag = await queue.consume(cap.on_message)
    try:
        yield cap
    finally:
        with contextlib.suppress(Exception):
            await queue.cancel(tag)
        await channel.close()
