"""The reconciler's `monitor.lifecycle` queue: events that make a job worth running at once.

`client.offline` (from a hub whose socket closed, or from this service) re-runs the offline-clients
job so unbinding and releasing follow as soon as the heartbeat timeout allows. Other events are only
acknowledged. A message that does not decode is dead-lettered, never dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from libs.contracts.amqp import LifecycleEvent, lifecycle_decoder
from libs.contracts.common import ContractError, decode_json
from libs.mq.dead_letter import DeadLetterPublisher, dead_letter_or_give_back
from libs.mq.topology import Topology, declare_lifecycle
from services.reconciler.runner import JobScheduler

log = logging.getLogger("reconciler.lifecycle")

CONSUMER = "reconciler"
WAKES: dict[str, tuple[str, ...]] = {"client.offline": ("offline_clients",)}


RETRY_SECONDS = 2.0


async def consume_lifecycle(connection: AbstractRobustConnection, topology: Topology, scheduler: JobScheduler,
                            stop: asyncio.Event) -> None:
    """Consume until `stop`. The events are only hints (every job also runs on its interval), so a broker
    outage never stops reconciling: the consumer retries in the background."""
    while not stop.is_set():
        try:
            await _consume(connection, topology, scheduler, stop)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("lifecycle consumer failed; jobs keep running on their intervals",
                        extra={"error": f"{type(exc).__name__}: {exc}"})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RETRY_SECONDS)


async def _consume(connection: AbstractRobustConnection, topology: Topology, scheduler: JobScheduler,
                   stop: asyncio.Event) -> None:
    channel = await connection.channel()
    dead_letters = DeadLetterPublisher(connection, topology)
    try:
        await channel.set_qos(prefetch_count=50)
        queue = await declare_lifecycle(channel, topology, CONSUMER)

        async def on_message(message: AbstractIncomingMessage) -> None:
            try:
                event = decode_json(message.body, LifecycleEvent, decoder=lifecycle_decoder)
            except ContractError as exc:
                reason = f"{exc.code}: {exc.message}" + (f" (field {exc.field})" if exc.field else "")
                await dead_letter_or_give_back(dead_letters, topology.lifecycle_dlq(CONSUMER), message, reason)
                return
            for job in WAKES.get(event.event, ()):
                scheduler.wake(job)
            await message.ack()

        tag = await queue.consume(on_message)
        await stop.wait()
        await queue.cancel(tag)
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
        await dead_letters.close()
