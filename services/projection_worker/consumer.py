"""projection-worker loops: ProjectionRebuild events (fast path) and a periodic sweep of the queue table
(requests whose event was lost, keys requested again during a rebuild, abandoned claims).

Event path, tenant-fair: the durable request is the key's row in `projection_rebuild_queue` (ingest writes it in the
transaction that applies the result); the event only says there is one. An event is held (not acked) while its key
waits there and wakes the claim loops (`concurrency` of them per replica); each takes a round of keys with the fair
claim (`Rebuilder.claim_oldest`: tenants take turns, each tenant's keys oldest first; replicas share the table by
SKIP LOCKED) and rebuilds them one by one, as long as any event is held. An event is acked once its key was rebuilt
(by this round, or by anyone: a key no longer claimable is served, claimed by another worker, or out of attempts).
So the order of rebuilds does not follow the order events arrive in: one tenant's burst of events (thousands of keys)
does not delay another tenant's key, which is rebuilt within the first turns of the next round.

Merge mode (§12.4): while the dispatch-coordinator publishes auto slow-down, events are acked without
a rebuild (their queue rows stay the durable requests) and once per merge window the queued keys are
rebuilt in batches of up to `merge_batch`, one transaction each, batch after batch while they come back
full. When slow-down ends, the event path resumes and the sweep drains what is left. Sweep and merge
batches are claimed tenant-fair as well.

Failures: a round whose claim or rebuild fails transiently (connection, deadlock, lock timeout) gives back the keys
it holds and is tried again after a pause, its events still held. A key whose rebuild is refused for any other
reason (a poison key) is released with its attempt counted, skipped by the event path for `refused_hold_s`, and its
events are dead-lettered with the reason and acked: its queue row stays the durable request that the sweep retries
up to `max_attempts`. A dead letter (that one, or an event that does not decode) is acked only once the broker
confirmed the copy in the projection DLQ (`DeadLetterPublisher`); otherwise the event is requeued after a pause,
never dropped. The broker's own dead-lettering (the queue's delivery limit) is left as the backstop for events
requeued too often: it is at-most-once and carries no reason, so the worker does not reject events into it.

Tracing: each event has its `projection.event` span (a child of the publisher's context) from its arrival until it
is settled; the rebuild of a key with an event held is its child (`projection.rebuild`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import date
from typing import Any

import msgspec
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError
from opentelemetry.trace import Span

from libs.contracts.amqp import projection_decoder
from libs.mq.dead_letter import DeadLetterPublisher, DeadLetterUnconfirmed
from libs.mq.poison import describe_failure, is_transient
from libs.mq.topology import Topology
from libs.telemetry import metrics as m
from libs.telemetry import tracing
from services.projection_worker.mode import RebuildMode, rebuild_mode
from services.projection_worker.rebuild import Claim, Rebuilder

log = logging.getLogger("projection.consumer")

BROKER_ERRORS = (AMQPError, ChannelInvalidStateError, ConnectionError, asyncio.TimeoutError)
REQUEUE_PAUSE_S = 0.5
# Longer: a DLQ that refuses copies is a broker or topology problem that takes a while to fix.
DEAD_LETTER_UNCONFIRMED_PAUSE_S = 2.0
# At most this many refused keys are remembered (the oldest forgotten first).
REFUSED_MAX = 1000

Key = tuple[int, int, date]


@dataclass(slots=True)
class _Held:
    """An event in hand, held until its key is rebuilt."""

    message: AbstractIncomingMessage
    span: Span | None


class ProjectionWorker:
    def __init__(self, connection: AbstractRobustConnection, topology: Topology, rebuilder: Rebuilder, *,
                 concurrency: int = 2, sweep_interval_s: float = 1.0, sweep_batch: int = 50,
                 merge_window_s: float = 5.0, merge_batch: int = 200, event_batch: int = 20,
                 refused_hold_s: float = 60.0) -> None:
        self.connection = connection
        self.topology = topology
        self.rebuilder = rebuilder
        self.concurrency = max(1, concurrency)
        self.sweep_interval_s = sweep_interval_s
        self.sweep_batch = sweep_batch
        self.merge_window_s = merge_window_s
        self.merge_batch = max(1, merge_batch)
        self.event_batch = max(1, event_batch)
        self.refused_hold_s = refused_hold_s
        self.mode = RebuildMode(merge=False)
        self.inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self.channel: AbstractChannel | None = None
        self.dead_letters = DeadLetterPublisher(connection, topology)
        self.subscribed = asyncio.Event()
        # The event path: events held per key; keys this worker holds claims on (a claim round's, until rebuilt);
        # keys whose rebuild was refused lately (reason, when); the claim loops' wake-up.
        self._held: dict[Key, list[_Held]] = {}
        self._in_flight: set[Key] = set()
        self._refused: dict[Key, tuple[str, float]] = {}
        self._wake = asyncio.Event()

    @property
    def held_events(self) -> int:
        """Events in hand waiting for their key's rebuild."""
        return sum(len(held) for held in self._held.values())

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
        tasks = [asyncio.create_task(self._handle_events(stop), name="projection-events")]
        tasks += [asyncio.create_task(self._claim_loop(stop), name=f"projection-claims-{i}")
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
            for held in self._held.values():  # unacked: back to the queue with the channel
                for event in held:
                    _end(event.span)
            self._held.clear()
            await self.dead_letters.close()
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
        """Decode the event and hold it for its key (merge mode: ack it, the queue row is the request)."""
        span = tracing.start_span("projection.event", kind=tracing.SpanKind.CONSUMER,
                                  parent=tracing.context_from_headers(message.headers),
                                  attributes={"messaging.message.id": message.message_id})
        try:
            event = projection_decoder.decode(message.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await self._settle(message, dead_letter_reason=f"invalid_message: {exc}")
            _end(span)
            return
        _annotate(span, tenant_id=event.tenant_id, brand_id=event.brand_id, business_date=event.business_date,
                  merge_mode=self.mode.merge)
        if self.mode.merge:
            m.projection_rebuild_deferred_count.inc()
            await self._settle(message)
            _end(span)
            return
        self._held.setdefault((event.tenant_id, event.brand_id, event.business_date), []).append(
            _Held(message, span))
        self._wake.set()

    async def _claim_loop(self, stop: asyncio.Event) -> None:
        """Claim rounds while events are held; asleep otherwise."""
        while not stop.is_set():
            await _first(self._wake, stop)
            self._wake.clear()
            while self._held and not stop.is_set():
                try:
                    pause = await self.claim_round()
                except Exception as exc:
                    log.warning("projection claim round failed; retried after a pause", exc_info=True,
                                extra={"held_keys": len(self._held), "error": describe_failure(exc)})
                    pause = REQUEUE_PAUSE_S
                if pause:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), pause)

    async def claim_round(self) -> float:
        """One round of the event path: settle the held events whose keys need nothing more, claim up to
        `event_batch` keys tenant-fair and rebuild them one by one, settling each one's events. Returns the pause
        before the next round (0: go on at once)."""
        if self.mode.merge:  # switched meanwhile: the merge rebuilds the keys
            for key in list(self._held):
                m.projection_rebuild_deferred_count.inc(len(self._held.get(key, [])))
                await self._settle_key(key)
            return 0.0
        await self._settle_unclaimable()
        if not self._held:
            return 0.0
        # Skipped: keys refused lately, and this worker's own claims (a failed one is released before it is known
        # refused).
        claims = await self.rebuilder.claim_oldest(self.event_batch, skip=self._refused_keys() | self._in_flight)
        if not claims:
            return REQUEUE_PAUSE_S  # the held keys are locked right now (being re-requested): soon again
        keys = [c.key_tuple for c in claims]
        self._in_flight.update(keys)
        try:
            for index, claim in enumerate(claims):
                if not await self._rebuild_claim(claim):
                    rest = claims[index + 1:]
                    if rest:
                        await self.rebuilder.release_failed_keys(rest)
                    return REQUEUE_PAUSE_S
        finally:
            self._in_flight.difference_update(keys)
        return 0.0

    async def _rebuild_claim(self, claim: Claim) -> bool:
        """Rebuild one claimed key and settle the events held for it; False on a transient failure (the key was
        given back, its events still held)."""
        key = claim.key_tuple
        before = len(self._held.get(key, []))  # events that came after the claim may need a later rebuild
        first = self._held[key][0].span if before else None
        try:
            with tracing.attached(tracing.traceparent_of(first)):
                await self.rebuilder.rebuild(claim, "event")
        except Exception as exc:
            if is_transient(exc):
                log.warning("projection rebuild failed; retried after a pause", extra={
                    **_key_extra(key), "error": describe_failure(exc)})
                return False
            reason = f"rebuild_failed: {describe_failure(exc)}"
            self._refuse(key, reason)
            log.warning("projection rebuild refused; key released and skipped, its events dead-lettered",
                        exc_info=True, extra={**_key_extra(key), "error": describe_failure(exc)})
            await self._settle_key(key, dead_letter_reason=reason)
            return True
        await self._settle_key(key, count=before)
        return True

    async def _settle_unclaimable(self) -> None:
        """Held events whose key no claim of this worker will take: acked when the key is served, claimed by another
        worker or out of attempts; dead-lettered when its rebuild was refused lately."""
        refused = self._refused_keys()
        waiting = [k for k in self._held if k not in self._in_flight]
        for key in [k for k in waiting if k in refused]:
            await self._settle_key(key, dead_letter_reason=self._refused[key][0])
        rest = [k for k in waiting if k not in refused]
        if not rest:
            return
        claimable = await self.rebuilder.claimable(rest)
        for key in rest:
            if key not in claimable and key not in self._in_flight:
                await self._settle_key(key)

    async def _settle_key(self, key: Key, *, dead_letter_reason: str | None = None, count: int | None = None) -> None:
        """Settle the events held for `key` (the first `count` of them; all by default)."""
        held = self._held.pop(key, [])
        settle, keep = (held, []) if count is None else (held[:count], held[count:])
        if keep:
            self._held.setdefault(key, [])[:0] = keep
        for event in settle:
            try:
                await self._settle(event.message, dead_letter_reason=dead_letter_reason)
            except Exception:
                log.warning("could not settle a projection event; requeued", exc_info=True,
                            extra={"message_id": event.message.message_id})
                with contextlib.suppress(*BROKER_ERRORS):
                    await event.message.nack(requeue=True)
            finally:
                _end(event.span)

    def _refuse(self, key: Key, reason: str) -> None:
        self._refused.pop(key, None)
        self._refused[key] = (reason, time.monotonic())
        while len(self._refused) > REFUSED_MAX:
            del self._refused[next(iter(self._refused))]

    def _refused_keys(self) -> set[Key]:
        """The keys refused within `refused_hold_s` (older entries forgotten)."""
        cutoff = time.monotonic() - self.refused_hold_s
        for key in [k for k, (_, at) in self._refused.items() if at < cutoff]:
            del self._refused[key]
        return set(self._refused)

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
        keys = [c.key_tuple for c in claims]
        self._in_flight.update(keys)  # an event held for one of them waits for the event path's verdict
        try:
            return (await self.rebuilder.rebuild_each(claims, "sweep"))[0]
        finally:
            self._in_flight.difference_update(keys)


async def _first(wake: asyncio.Event, stop: asyncio.Event) -> None:
    """Wait until `wake` or `stop` is set."""
    if wake.is_set() or stop.is_set():
        return
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _annotate(span: Span | None, **attributes: Any) -> None:
    """`tracing.set_attributes` for a span that is not the current one."""
    values = tracing.clean({f"monitoring.{k}": v for k, v in attributes.items()})
    if span is not None and values and span.is_recording():
        span.set_attributes(values)


def _end(span: Span | None) -> None:
    if span is not None:
        span.end()


def _key_extra(key: Key) -> dict[str, object]:
    return {"tenant_id": key[0], "brand_id": key[1], "business_date": key[2].isoformat()}


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
