"""projection-worker loops: ProjectionRebuild events (fast path) and a periodic sweep of the queue table
(requests whose event was lost, keys requested again during a rebuild, abandoned claims).

Merge mode (§12.4): while the dispatch-coordinator publishes auto slow-down, events are acked without
a rebuild (their queue rows stay the durable requests) and once per merge window the queued keys are
rebuilt in batches of up to `merge_batch`, one transaction each, batch after batch while they come back
full. When slow-down ends, per-event rebuilds resume and the sweep drains what is left. Sweep and merge
batches are claimed tenant-fair (`Rebuilder.claim_oldest`): tenants take turns, each tenant's keys oldest
first, so one tenant's burst does not hold back every other tenant's aggregates.

Failures: an event's rebuild that fails transiently (connection, deadlock, lock timeout) is requeued; one
refused for any other reason (a poison key) is dead-lettered with the reason and acked, since its queue row
stays the durable request that the sweep retries up to `max_attempts`. A dead letter (that one, or an event
that does not decode) is acked only once the broker confirmed the copy in the projection DLQ
(`DeadLetterPublisher`); otherwise the event is requeued after a pause, never dropped. The broker's own
dead-lettering (the queue's delivery limit) is left as the backstop for events requeued too often: it is
at-most-once and carries no reason, so the worker does not reject events into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError

from libs.contracts.amqp import ProjectionRebuild, projection_decoder
from libs.mq.dead_letter import DeadLetterPublisher, DeadLetterUnconfirmed
from libs.mq.poison import describe_failure, is_transient
from libs.mq.topology import Topology
from libs.telemetry import metrics as m
from libs.telemetry import tracing
from services.projection_worker.mode import RebuildMode, rebuild_mode
from services.projection_worker.rebuild import Rebuilder

log = logging.getLogger("projection.consumer")

BROKER_ERRORS = (AMQPError, ChannelInvalidStateError, ConnectionError, asyncio.TimeoutError)
REQUEUE_PAUSE_S = 0.5
# Longer: a DLQ that refuses copies is a broker or topology problem that takes a while to fix.
DEAD_LETTER_UNCONFIRMED_PAUSE_S = 2.0


class ProjectionWorker:
    def __init__(self, connection: AbstractRobustConnection, topology: Topology, rebuilder: Rebuilder, *,
                 concurrency: int = 2, sweep_interval_s: float = 1.0, sweep_batch: int = 50,
                 merge_window_s: float = 5.0, merge_batch: int = 200) -> None:
        self.connection = connection
        self.topology = topology
        self.rebuilder = rebuilder
        self.concurrency = max(1, concurrency)
        self.sweep_interval_s = sweep_interval_s
        self.sweep_batch = sweep_batch
        self.merge_window_s = merge_window_s
        self.merge_batch = max(1, merge_batch)
        self.mode = RebuildMode(merge=False)
        self.inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self.channel: AbstractChannel | None = None
        self.dead_letters = DeadLetterPublisher(connection, topology)
        self.subscribed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        channel = await self.connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=self.concurrency * 4)
        # Declared (passively), not just named: only a queue declared on the robust channel is restored with its
        # consumer when the connection comes back (`ensure=False` loses the consumer at the first reconnect).
        queue = await channel.get_queue(self.topology.projection_queue)
        m.projection_merge_mode_active.set(0)
        await self._refresh_mode()  # before the first event, so it is handled in the current mode
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
            await self.dead_letters.close()
            # Unacked events go back to the queue when the channel closes.
            with contextlib.suppress(*BROKER_ERRORS):
                await channel.close()
            log.info("projection worker stopped")

    async def _handle_events(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            message = await _next(self.inbox, stop)
            if message is not None:
                with tracing.span("projection.event", kind=tracing.SpanKind.CONSUMER,
                                  parent=tracing.context_from_headers(message.headers),
                                  attributes={"messaging.message.id": message.message_id}):
                    await self._handle(message)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        try:
            event = projection_decoder.decode(message.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await self._settle(message, dead_letter_reason=f"invalid_message: {exc}")
            return
        tracing.set_attributes(tenant_id=event.tenant_id, brand_id=event.brand_id, business_date=event.business_date,
                               merge_mode=self.mode.merge)
        if self.mode.merge:
            m.projection_rebuild_deferred_count.inc()
            await self._settle(message)
            return
        try:
            await self._rebuild_event(event)
        except Exception as exc:
            key = {"tenant_id": event.tenant_id, "brand_id": event.brand_id,
                   "business_date": event.business_date.isoformat(), "error": describe_failure(exc)}
            if is_transient(exc):
                log.warning("projection rebuild failed; requeued", extra=key)
                await self._requeue(message, REQUEUE_PAUSE_S)
                return
            # Poison key: the event stops circling; the queue row stays, so the sweep retries the key.
            log.warning("projection rebuild refused; event dead-lettered", exc_info=True, extra=key)
            await self._settle(message, dead_letter_reason=f"rebuild_failed: {describe_failure(exc)}")
            return
        await self._settle(message)

    async def _rebuild_event(self, event: ProjectionRebuild) -> None:
        claim = await self.rebuilder.claim_key(event.tenant_id, event.brand_id, event.business_date)
        if claim is None:
            return  # served already, or being rebuilt by someone else right now
        await self.rebuilder.rebuild(claim, "event")

    async def _settle(self, message: AbstractIncomingMessage, dead_letter_reason: str | None = None) -> None:
        """Ack the event; with a reason, only once its dead-letter copy is confirmed (else requeue it)."""
        if dead_letter_reason is not None:
            try:
                await self.dead_letters.publish(self.topology.projection_dlq, message, dead_letter_reason)
            except DeadLetterUnconfirmed as exc:
                m.projection_dead_letter_unconfirmed_count.inc()
                log.error("dead letter not confirmed; the event is requeued",
                          extra={"message_id": message.message_id, "reason": dead_letter_reason[:200],
                                 "error": str(exc)})
                await self._requeue(message, DEAD_LETTER_UNCONFIRMED_PAUSE_S)
                return
            m.projection_dead_letter_count.inc(reason=dead_letter_reason.split(":", 1)[0])
        try:
            await message.ack()
        except BROKER_ERRORS as exc:
            log.warning("could not settle a projection event; it will be redelivered", extra={"error": str(exc)})

    async def _requeue(self, message: AbstractIncomingMessage, pause_s: float) -> None:
        """Give the event back after a pause, so the delivery limit is not spent in a burst."""
        await asyncio.sleep(pause_s)
        with contextlib.suppress(*BROKER_ERRORS):
            await message.nack(requeue=True)

    async def _sweep(self, stop: asyncio.Event) -> None:
        next_merge: float | None = None
        while not stop.is_set():
            wait = self.sweep_interval_s
            try:
                await self._refresh_mode()
                if self.mode.merge:
                    now = time.monotonic()
                    if next_merge is None:  # just switched: let the first window fill
                        next_merge = now + self.merge_window_s
                    if now >= next_merge:
                        next_merge += self.merge_window_s
                        await self.merge_window(stop)
                        next_merge = max(next_merge, time.monotonic())
                    wait = min(wait, max(0.0, next_merge - time.monotonic()))
                else:
                    next_merge = None
                    await self.sweep_once()
                depth, lag = await self.rebuilder.queue_stats()
                m.projection_queue_depth.set(depth)
                m.monitor_projection_rebuild_lag_ms.set(lag)
            except Exception as exc:
                log.warning("projection sweep failed; retrying", exc_info=True, extra={"error": str(exc)[:300]})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)

    async def _refresh_mode(self) -> None:
        """Follow the coordinator's published slow-down; when it cannot be read, keep the current mode."""
        try:
            mode = rebuild_mode(await self.rebuilder.coordinator_state())
        except Exception as exc:
            log.warning("could not read the coordinator state; rebuild mode unchanged",
                        extra={"merge_mode": self.mode.merge, "error": str(exc)[:300]})
            return
        self.set_mode(mode)

    def set_mode(self, mode: RebuildMode) -> None:
        if mode.merge and not self.mode.merge:
            log.warning("projection merge mode on: events acked without a rebuild, the queue rebuilt in batches",
                        extra={"reasons": list(mode.reasons), "merge_window_ms": round(self.merge_window_s * 1000),
                               "merge_batch": self.merge_batch})
        elif self.mode.merge and not mode.merge:
            log.info("projection merge mode off: per-event rebuilds resume",
                     extra={"reasons": list(self.mode.reasons), "note": mode.note or "auto slow-down over"})
        elif mode.merge and mode.reasons != self.mode.reasons:
            log.info("projection merge mode continues", extra={"reasons": list(mode.reasons)})
        self.mode = mode
        m.projection_merge_mode_active.set(1 if mode.merge else 0)

    async def merge_window(self, stop: asyncio.Event) -> int:
        """One merge window's work: batches back to back while they come back full (a backlog of keys
        whose requests waited out the window), for at most one window's time, so the merge keeps up with
        any request rate instead of rebuilding `merge_batch` keys per window; returns the keys rebuilt."""
        deadline = time.monotonic() + self.merge_window_s
        total = 0
        while not stop.is_set():
            claimed, rebuilt = await self._merge_batch()
            total += rebuilt
            if claimed < self.merge_batch or time.monotonic() >= deadline:
                return total
        return total

    async def merge_once(self) -> int:
        """Claim up to `merge_batch` keys (tenants taking turns, each one's oldest first) and rebuild them
        in one transaction; returns how many keys were rebuilt."""
        return (await self._merge_batch())[1]

    async def _merge_batch(self) -> tuple[int, int]:
        """(keys claimed, keys rebuilt) of one merged batch."""
        claims = await self.rebuilder.claim_oldest(self.merge_batch)
        if not claims:
            return 0, 0
        return len(claims), (await self.rebuilder.rebuild_merged(claims)).rebuilt

    async def sweep_once(self) -> int:
        """Claim unclaimed keys (tenants taking turns, each one's oldest first) and rebuild them one by one
        (a poison key is skipped and released); returns how many were rebuilt."""
        claims = await self.rebuilder.claim_oldest(self.sweep_batch)
        return (await self.rebuilder.rebuild_each(claims, "sweep"))[0]


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
