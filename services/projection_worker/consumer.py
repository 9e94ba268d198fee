"""projection-worker loops: ProjectionRebuild events (fast path) and a periodic sweep of the queue table
(requests whose event was lost, keys requested again during a rebuild, abandoned claims)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError

from libs.contracts.amqp import ProjectionRebuild, projection_decoder
from libs.mq.connection import dead_letter
from libs.mq.topology import Topology
from libs.telemetry import metrics as m
from services.projection_worker.rebuild import Rebuilder

log = logging.getLogger("projection.consumer")

BROKER_ERRORS = (AMQPError, ChannelInvalidStateError, ConnectionError, asyncio.TimeoutError)


class ProjectionWorker:
    def __init__(self, connection: AbstractRobustConnection, topology: Topology, rebuilder: Rebuilder, *,
                 concurrency: int = 2, sweep_interval_s: float = 1.0, sweep_batch: int = 50) -> None:
        self.connection = connection
        self.topology = topology
        self.rebuilder = rebuilder
        self.concurrency = max(1, concurrency)
        self.sweep_interval_s = sweep_interval_s
        self.sweep_batch = sweep_batch
        self.inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self.channel: AbstractChannel | None = None
        self.subscribed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        channel = await self.connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=self.concurrency * 4)
        queue = await channel.get_queue(self.topology.projection_queue, ensure=False)
        tag = await queue.consume(self.inbox.put)
        self.channel = channel
        self.subscribed.set()
        tasks = [asyncio.create_task(self._handle_events(stop), name=f"projection-events-{i}")
                 for i in range(self.concurrency)]
        tasks.append(asyncio.create_task(self._sweep(stop), name="projection-sweep"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        finally:
            stop.set()
            with contextlib.suppress(*BROKER_ERRORS):
                await queue.cancel(tag)
            await asyncio.gather(*tasks, return_exceptions=True)
            # Unacked events go back to the queue when the channel closes.
            with contextlib.suppress(*BROKER_ERRORS):
                await channel.close()
            log.info("projection worker stopped")

    async def _handle_events(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            message = await _next(self.inbox, stop)
            if message is not None:
                await self._handle(message)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        try:
            event = projection_decoder.decode(message.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await self._settle(message, dead_letter_reason=f"invalid_message: {exc}")
            return
        try:
            await self._rebuild_event(event)
        except Exception as exc:
            # Transient (or not): requeued, so the queue's delivery limit bounds it, then the broker
            # dead-letters; the queue row stays, so the sweep retries the key either way.
            log.warning("projection rebuild failed; requeued", exc_info=True,
                        extra={"tenant_id": event.tenant_id, "brand_id": event.brand_id, "error": str(exc)[:300]})
            await asyncio.sleep(0.5)
            with contextlib.suppress(*BROKER_ERRORS):
                await message.nack(requeue=True)
            return
        await self._settle(message)

    async def _rebuild_event(self, event: ProjectionRebuild) -> None:
        claim = await self.rebuilder.claim_key(event.tenant_id, event.brand_id, event.business_date)
        if claim is None:
            return  # served already, or being rebuilt by someone else right now
        await self.rebuilder.rebuild(claim, "event")

    async def _settle(self, message: AbstractIncomingMessage, dead_letter_reason: str | None = None) -> None:
        try:
            if dead_letter_reason is not None and self.channel is not None:
                await dead_letter(self.channel, self.topology, self.topology.projection_dlq, message,
                                  dead_letter_reason)
            await message.ack()
        except BROKER_ERRORS as exc:
            log.warning("could not settle a projection event; it will be redelivered", extra={"error": str(exc)})

    async def _sweep(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep_once()
                depth, lag = await self.rebuilder.queue_stats()
                m.projection_queue_depth.set(depth)
                m.monitor_projection_rebuild_lag_ms.set(lag)
            except Exception as exc:
                log.warning("projection sweep failed; retrying", exc_info=True, extra={"error": str(exc)[:300]})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.sweep_interval_s)

    async def sweep_once(self) -> int:
        """Claim and rebuild the oldest unclaimed keys; returns how many were rebuilt."""
        claims = await self.rebuilder.claim_oldest(self.sweep_batch)
        for claim in claims:
            await self.rebuilder.rebuild(claim, "sweep")
        return len(claims)


async def _next(inbox: asyncio.Queue[AbstractIncomingMessage], stop: asyncio.Event) -> AbstractIncomingMessage | None:
    if not inbox.empty():
        return inbox.get_nowait()
    getter = asyncio.ensure_future(inbox.get())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not getter.done():
            getter.cancel()
    return getter.result() if getter in done and not getter.cancelled() else None
