"""Counts the dead letters the broker made of shard-queue messages, into the metric the IngestDeadLetters alert reads.

The consumer counts the copies it dead-letters itself (`ingest_dead_letter_count{reason}` at the confirm). The
broker also dead-letters on its own: a message returned more than `INGEST_DELIVERY_LIMIT` times (a database outage
that outlasted every hold, a replica crash-looping on it) goes to the queue's x-dead-letter-exchange with only an
`x-death` header, and no process sees it. The tally queue is bound beside the ingest DLQ on the broker's own
dead-letter key (the consumer's copies use another key, bound to the DLQ only), so it receives exactly the broker's
dead letters; each is counted with its `x-death` reason (`delivery_limit`, `rejected`, ...) and acked. The DLQ
keeps the message itself for a human. Every replica consumes the tally queue: a message goes to one of them, so
each dead letter is counted once, in the replica that took it (the alert sums over replicas).
"""

from __future__ import annotations

import contextlib
import logging

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from libs.mq.dead_letter import broker_dead_letter_reason
from libs.mq.topology import Topology
from libs.telemetry import metrics as m

log = logging.getLogger("ingest.dead_letter_tally")


class BrokerDeadLetterCounter:
    """Consumes the ingest dead-letter tally queue: one `ingest_dead_letter_count{reason}` per broker dead letter."""

    def __init__(self, connection: AbstractRobustConnection, topology: Topology) -> None:
        self.connection = connection
        self.topology = topology
        self.channel: AbstractChannel | None = None

    async def subscribe(self) -> None:
        channel = await self.connection.channel()
        await channel.set_qos(prefetch_count=100)
        # Declared passively (not `ensure=False`): the robust channel restores the consumer after a reconnect.
        queue = await channel.get_queue(self.topology.ingest_dead_letter_tally)
        await queue.consume(self._on_message)
        self.channel = channel

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        reason = broker_dead_letter_reason(message.headers)
        if reason is not None:
            m.ingest_dead_letter_count.inc(reason=reason)
            log.error("the broker dead-lettered a result from a shard queue", extra={
                "reason": reason, "message_id": message.message_id, "routing_key": message.routing_key})
        await message.ack()

    async def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await channel.close()
