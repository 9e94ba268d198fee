"""Dead letters a consumer may ack after: the copy is published with publisher confirms, mandatory, and the
confirm is awaited (with a timeout) before `publish` returns.

Why the consumer copies a refused message itself rather than leaving it to the broker's own dead-lettering
(`reject(requeue=False)` towards the queue's `x-dead-letter-exchange`, or the quorum delivery limit): on our
quorum queues that path is at-most-once (a copy the DLX cannot route, or one in flight during a leader change,
is dropped) and the dead letter carries no reason, only `x-death` with "rejected" or "delivery_limit". Here
the reason travels in the headers, and a copy that is not confirmed as routed to the DLQ raises
`DeadLetterUnconfirmed`, so the caller gives the original back (nack with requeue) instead of acking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from libs.mq.topology import Topology

log = logging.getLogger("mq.dead_letter")

REASON_HEADER = "x-dead-letter-reason"


def broker_dead_letter_reason(headers: Mapping[str, object] | None) -> str | None:
    """Why the broker dead-lettered a message (its latest `x-death` reason: `delivery_limit`, `rejected`, ...), or
    None for a copy a consumer published itself (it carries REASON_HEADER and was counted when published)."""
    if not headers or REASON_HEADER in headers:
        return None
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        reason = deaths[0].get("reason")
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        if isinstance(reason, str) and reason:
            return reason
    return "broker_unknown"


class DeadLetterUnconfirmed(Exception):
    """The broker did not confirm the dead-letter copy: the original must not be acked."""


def dead_letter_copy(message: AbstractIncomingMessage, reason: str) -> aio_pika.Message:
    """The message as it goes to a DLQ: same body, id and headers, plus why and where it came from."""
    headers = dict(message.headers or {})
    headers[REASON_HEADER] = reason[:1000]
    headers["x-original-routing-key"] = message.routing_key or ""
    headers["x-original-exchange"] = message.exchange or ""
    return aio_pika.Message(body=message.body, headers=headers, content_type=message.content_type,
                            message_id=message.message_id, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)


class DeadLetterPublisher:
    """Publishes dead letters on a channel of its own (opened on first use), one at a time.

    A channel of its own: a failed publish (an unknown exchange closes the channel) never takes a consumer's
    channel, and its unacked deliveries, down with it. One at a time: the broker names a returned message only
    by its message id, and a redelivered message keeps its id, so two copies in flight could be confused.
    """

    def __init__(self, connection: AbstractConnection, topology: Topology, *, timeout: float = 5.0) -> None:
        self._connection = connection
        self._topology = topology
        self._timeout = timeout
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()

    async def publish(self, dlq: str, message: AbstractIncomingMessage, reason: str, *,
                      routing_key: str | None = None) -> None:
        """Copy `message` to `dlq` (by `routing_key` on the DLX, `dlq` itself by default) with `reason`; return once
        the broker confirmed it routed the copy.

        Raises DeadLetterUnconfirmed when it was returned unroutable, nacked, not confirmed in time, or the
        channel or connection failed meanwhile."""
        async with self._lock:
            try:
                async with asyncio.timeout(self._timeout):
                    channel = await self._open()
                    exchange = await channel.get_exchange(self._topology.dlx_exchange, ensure=False)
                    confirmation = await exchange.publish(dead_letter_copy(message, reason),
                                                          routing_key=routing_key or dlq, mandatory=True)
            except (aiormq.exceptions.AMQPError, aio_pika.exceptions.ChannelInvalidStateError, OSError) as exc:
                # TimeoutError is an OSError. The channel may be closed or hold a late confirm: start afresh.
                await self._discard()
                raise DeadLetterUnconfirmed(f"{type(exc).__name__}: {exc}"[:300]) from exc
            if not isinstance(confirmation, aiormq.spec.Basic.Ack):
                await self._discard()
                raise DeadLetterUnconfirmed(f"not confirmed: {type(confirmation).__name__}")
        log.warning("message dead-lettered", extra={"dlq": dlq, "reason": reason[:200],
                                                     "message_id": message.message_id})

    async def close(self) -> None:
        async with self._lock:
            await self._discard()

    async def _open(self) -> AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            # on_return_raises: a copy the DLX cannot route fails the publish instead of "succeeding".
            self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        return self._channel

    async def _discard(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), self._timeout)


async def dead_letter_or_give_back(publisher: DeadLetterPublisher, dlq: str, message: AbstractIncomingMessage,
                                   reason: str, *, retry_after_s: float = 1.0) -> bool:
    """Dead-letter `message` and ack it once the copy is confirmed; otherwise give it back (nack, requeue) after
    `retry_after_s`, so a refused message is never lost to a dead-letter path that is down. True if acked."""
    try:
        await publisher.publish(dlq, message, reason)
    except DeadLetterUnconfirmed as exc:
        log.error("dead letter not confirmed; the message is given back", extra={
            "dlq": dlq, "message_id": message.message_id, "reason": reason[:200], "error": str(exc)})
        await asyncio.sleep(retry_after_s)  # a pause before the redelivery, not a wait for anything
        with contextlib.suppress(Exception):
            await message.nack(requeue=True)
        return False
    await message.ack()
    return True
