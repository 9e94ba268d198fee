"""Shard consumers: every replica consumes every shard queue; single active consumer makes one replica
active per shard, and each shard's deliveries are applied serially, in batches, in delivery order.

Acknowledgement: a batch is acked (one `multiple` ack) after its transaction committed and after each of its
poison messages was copied to the ingest DLQ with its reason AND the broker confirmed that copy as routed
(`DeadLetterPublisher`: publisher confirms, mandatory, a timeout). When a copy is not confirmed, the rest of
the batch is acked one by one and that original is given back (nack with requeue, after a back-off), to be
dead-lettered on a later delivery: a poison message is never acked without its copy in the DLQ. The consumer
never rejects a message into the queue's own x-dead-letter-exchange: on quorum queues that broker-side path
is at-most-once (an unroutable dead letter is dropped) and it carries no reason.

Errors while applying: a batch refused by an error that is not transient (a constraint, a value Postgres
cannot store, a trigger, a bug on one input) is applied again one result per transaction, in order, so only
the results that fail on their own are dead-lettered (reason `db_rejected: ...` or `apply_error: ...`, with
the exception type, SQLSTATE and first line of the message) and every other result is applied exactly once:
the refused batch was rolled back whole, and the applied-result ledger (`RECORD_APPLIED`, unique on
result_id) turns any second apply of a result, in this fallback or on a redelivery, into a no-op.

A transient error (connection lost or refused, pool timeout, serialization failure, deadlock, lock timeout,
admin shutdown, too many connections: `is_transient`) is never a reason to dead-letter, and it does not spend
the shard queue's delivery limit either: the shard stops taking work and holds its in-flight deliveries
unacked while it retries the batch in process, every `db_retry_delay` (at most 1 s), until the database
answers. Holding is the one wait that is free: on RabbitMQ 3.10 quorum queues every return of a delivery (a
nack with requeue, a closed channel) adds to `x-delivery-count`, and past `INGEST_DELIVERY_LIMIT` the broker
dead-letters the message itself. The hold is bounded by `db_outage_hold_s` (`INGEST_DB_OUTAGE_HOLD_SECONDS`),
which must stay below the broker's `consumer_timeout` (30 min by default): a delivery unacked for longer makes
the broker close the channel, which returns everything on it and counts a delivery anyway. When an outage
outlasts the hold, the shard gives its deliveries back (one delivery counted) and holds the redelivered ones
again, so results survive about `INGEST_DELIVERY_LIMIT` holds of database outage before the broker
dead-letters them; those broker-side dead letters are counted too (`BrokerDeadLetterCounter`).

A shard is never processed by two loops at once: handing it over (shutdown, yielding to another replica)
closes its channel after the in-flight batch, which returns the unapplied deliveries to the head of the
queue for the next consumer in line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import aio_pika
import msgspec
import psycopg
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import MonitorResult, result_decoder
from libs.db.pool import Conn
from libs.db.write_health import WriterHealth
from libs.dispatch_settings import SettingsCache
from libs.ingest.routing import DRAIN_MARKER_TYPE, Routing, RoutingState, RoutingStore, may_consume, routed
from libs.ingest.shards import assign_shards, lag_ms
from libs.ingest.write_rate import WriteRateGauge
from libs.mq.dead_letter import DeadLetterPublisher, DeadLetterUnconfirmed
from libs.mq.poison import describe_failure, is_transient
from libs.mq.topology import Topology
from libs.telemetry import metrics as m
from libs.telemetry import tracing
from services.ingest_shard_workers import queries as q
from services.ingest_shard_workers.apply import BatchOutcome, apply_batch
from services.ingest_shard_workers.dead_letter_tally import BrokerDeadLetterCounter

log = logging.getLogger("ingest.consumer")

# The first pause after a transient error, and the longest one: a database that comes back is used again within
# about a second (a capped delay, not an exponential one that overshoots the outage).
DB_RETRY_FIRST_DELAY_S = 0.2
DB_RETRY_MAX_DELAY_S = 1.0
# How long a retry during an outage waits for a pooled connection (the pool's own wait is 10 s).
DB_OUTAGE_POOL_WAIT_S = 1.0
# Pauses between attempts to dead-letter one message before it is given back to the queue.
DEAD_LETTER_RETRIES = (0.2, 1.0)
BROKER_ERRORS = (AMQPError, ChannelInvalidStateError, ConnectionError, asyncio.TimeoutError)
# How long a start-up step the broker or database interrupted waits before it is tried again (`IngestWorker._start`).
START_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class IngestConfig:
    instance_id: str
    batch_size: int = 200
    prefetch: int = 400
    member_heartbeat_s: float = 2.0
    member_timeout_s: float = 10.0
    retention_hours: int = 168
    # Longest continuous database outage a shard holds its deliveries through (below the broker's consumer_timeout).
    db_outage_hold_s: float = 1200.0
    # How often the lag gauges are recomputed from what each shard holds (no I/O): a stuck batch keeps raising them.
    lag_refresh_s: float = 1.0


def _alive(message: AbstractIncomingMessage) -> bool:
    try:
        return not message.channel.is_closed
    except ChannelInvalidStateError:
        return False


def _poison_reason(exc: BaseException) -> str:
    """Dead-letter reason of a result that fails when applied alone; its first word is the metric label."""
    kind = "db_rejected" if isinstance(exc, psycopg.Error) else "apply_error"
    return f"{kind}: {describe_failure(exc)}"


def _decode(message: AbstractIncomingMessage) -> MonitorResult | str:
    try:
        return result_decoder.decode(message.body)
    except msgspec.ValidationError as exc:
        return f"invalid_message: {exc}"
    except msgspec.DecodeError as exc:
        return f"malformed_json: {exc}"


class ShardConsumer:
    """The consumer of one shard queue in this replica, with its own channel and serial loop."""

    def __init__(self, shard: int, connection: AbstractRobustConnection, topology: Topology,
                 pool: AsyncConnectionPool[Conn], config: IngestConfig, settings: SettingsCache,
                 dead_letters: DeadLetterPublisher, write_health: WriterHealth, epoch: int = 0) -> None:
        self.shard = shard
        self.epoch = epoch
        # The gauges' `shard` label: the shard number in epoch 0, `<epoch>.<shard>` after a reshard.
        self.label = str(shard) if epoch == 0 else f"{epoch}.{shard}"
        self.subscribed_at = 0.0
        self.write_health = write_health
        self.connection = connection
        self.topology = topology
        self.pool = pool
        self.config = config
        self.settings = settings
        self.dead_letters = dead_letters
        self.channel: AbstractChannel | None = None
        # Deliveries not taken into a batch yet, and beside them (same order) the wall-clock time, epoch ms, each
        # reached this replica: asyncio.Queue has no peek, and the lag gauge needs the head's age.
        self.buffer: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self._arrivals: deque[float] = deque()
        # The hub's receive time (epoch ms) of the oldest result in the batch being applied; None between batches.
        self._held_since_ms: float | None = None
        self._busy = False
        self._channel_lock = asyncio.Lock()
        # Deliveries taken from the buffer but put back behind a drain marker, served before the buffer.
        self._carry: deque[AbstractIncomingMessage] = deque()
        # A draining epoch's shard whose marker was reached: anything delivered after it arrived late (routed just
        # before the unbind) and is forwarded to the active epoch, never applied here (`IngestWorker._forward`).
        self.drained = False
        self.forward: Callable[[AbstractIncomingMessage], Awaitable[bool]] | None = None
        self.on_marker: Callable[[ShardConsumer], Awaitable[bool]] | None = None
        self.last_delivery_at = 0.0
        self.yield_requested = False
        self._subscriptions = 0
        self._stop = asyncio.Event()
        # When the current run of transient errors began (monotonic), or None while the database answers.
        self._outage_since: float | None = None

    @property
    def queue_name(self) -> str:
        return self.topology.ingest_queue(self.shard, self.epoch)

    @property
    def subscribed(self) -> bool:
        return self.channel is not None and not self.channel.is_closed

    def idle(self, quiet_s: float) -> bool:
        """Holding nothing (no buffered delivery, no batch being applied), and no delivery for `quiet_s`."""
        return (self.buffer.empty() and self._held_since_ms is None and not self._busy
                and time.monotonic() - max(self.last_delivery_at, self.subscribed_at) > quiet_s)

    async def subscribe(self) -> None:
        """Open the shard's channel and consume (a no-op when subscribed): serialized with `close`, since the loop
        (handing over) and the worker (resharding) both call them, and two channels would be two consumers."""
        async with self._channel_lock:
            if not self.subscribed:
                await self._subscribe()

    async def _subscribe(self) -> None:
        channel = await self.connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=self.config.prefetch)
        # Declared (passively), not just named: only a queue declared on the robust channel is restored with its
        # consumer when the connection comes back; `ensure=False` would leave the shard without a consumer for good.
        queue = await channel.get_queue(self.queue_name)
        self._subscriptions += 1
        await queue.consume(self._on_message, consumer_tag=f"{self.config.instance_id}.e{self.epoch}.s{self.shard}."
                                                           f"{self._subscriptions}")
        self.channel = channel
        self.subscribed_at = time.monotonic()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        self.last_delivery_at = time.monotonic()
        self._arrivals.append(time.time() * 1000)
        self.buffer.put_nowait(message)

    def _take(self) -> AbstractIncomingMessage:
        if self._carry:
            return self._carry.popleft()
        message = self.buffer.get_nowait()
        self._arrivals.popleft()
        return message

    def lag_ms(self, now_epoch_ms: float) -> float:
        """Age of the oldest result this shard holds and has not applied: the batch being applied (its oldest
        result's receive time at the hub), else the oldest buffered delivery (its arrival here). Read on a timer
        (`IngestWorker._refresh_lag`), so a batch that is stuck keeps raising it."""
        oldest = self._held_since_ms
        if oldest is None and self._arrivals:
            oldest = self._arrivals[0]
        return lag_ms(now_epoch_ms, oldest)

    async def close(self) -> None:
        """Closing the channel returns every unacked delivery to the head of the queue."""
        async with self._channel_lock:
            channel, self.channel = self.channel, None
            if channel is not None and not channel.is_closed:
                with contextlib.suppress(Exception):
                    await channel.close()
        while self._carry or not self.buffer.empty():
            self._take()
        self._held_since_ms = None
        m.monitor_result_ingest_lag_ms.labels(shard=self.label).set(0)

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        lag = m.monitor_result_ingest_lag_ms.labels(shard=self.label)
        lag.set(0)
        while not stop.is_set():
            if self.yield_requested:
                await self._hand_over()
                continue
            first = await self._next(stop)
            if first is None:
                continue
            batch = [first]
            self._busy = True
            while len(batch) < self.config.batch_size and (self._carry or not self.buffer.empty()):
                batch.append(self._take())
            batch = [message for message in batch if _alive(message)]
            cut = next((i for i, message in enumerate(batch) if message.type == DRAIN_MARKER_TYPE), None)
            if cut is not None and cut > 0:
                # Apply what came before the marker first, as a batch of its own.
                self._carry.extendleft(reversed(batch[cut:]))
                batch = batch[:cut]
            if batch and (self.drained or cut == 0):
                await self._after_marker(batch)
            elif batch:
                try:
                    # Tracing: the batch span is a child of its first result's context and links to the others';
                    # each result also gets a span in its own trace. Projection events it writes carry the batch's.
                    with tracing.consume_batch(
                            "ingest.batch", "ingest.result", [message.headers for message in batch],
                            attributes={tracing.SHARD: self.shard, "monitoring.batch_size": len(batch)},
                            message_attributes=[{"messaging.message.id": message.message_id} for message in batch]):
                        await self._process(batch)
                except Exception:
                    # A bug outside applying (which sorts its own errors): the batch goes back, the loop lives on.
                    log.exception("unexpected error handling a batch; requeued", extra={"shard": self.shard})
                    await self._requeue_outstanding(batch[-1])
                finally:
                    self._held_since_ms = None
            self._busy = False
            lag.set(self.lag_ms(time.time() * 1000))

    async def _next(self, stop: asyncio.Event) -> AbstractIncomingMessage | None:
        if self._carry or not self.buffer.empty():
            return self._take()
        getter = asyncio.ensure_future(self.buffer.get())
        stopper = asyncio.ensure_future(stop.wait())
        try:
            # Wake up regularly to honour yield requests on an idle shard.
            done, _ = await asyncio.wait({getter, stopper}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not getter.done():
                getter.cancel()
        if getter in done and not getter.cancelled():
            self._arrivals.popleft()
            return getter.result()
        return None

    async def _after_marker(self, batch: list[AbstractIncomingMessage]) -> None:
        """The drain marker (first in `batch` unless reached before) and what came after it: the marker recorded and
        acked (everything before it was applied and acked already), the late results forwarded, each acked once the
        active epoch's queue confirmed it; a result not forwarded is given back, to be forwarded again."""
        for message in batch:
            try:
                if message.type == DRAIN_MARKER_TYPE:
                    if not self.drained and self.on_marker is not None:
                        # Only a draining epoch's shard becomes drained; a stray marker elsewhere is dropped.
                        self.drained = await self.on_marker(self)
                    await message.ack()
                elif self.forward is not None and await self.forward(message):
                    m.ingest_reshard_forwarded_count.inc()
                    await message.ack()
                else:
                    await self._give_back([message])
            except (psycopg.Error, OSError) as exc:
                log.warning("recording a drained shard failed; the marker goes back", extra={
                    "epoch": self.epoch, "shard": self.shard, "error": str(exc)[:200]})
                await self._give_back([message])
            except BROKER_ERRORS as exc:
                log.warning("ack after the drain marker failed", extra={"shard": self.shard, "error": str(exc)})

    async def _hand_over(self) -> None:
        self.yield_requested = False
        log.info("yielding shard to its assigned replica", extra={"shard": self.shard})
        m.ingest_shard_yield_count.inc()
        await self.close()
        # The broker connection may be down right now (the robust connection is reconnecting): opening the new
        # channel then fails, and must be retried, not end the replica (every shard loop of it would stop).
        while not self._stop.is_set():
            try:
                await self.subscribe()
                return
            except (*BROKER_ERRORS, RuntimeError) as exc:  # aio-pika: RuntimeError("Connection was not opened")
                log.warning("re-subscribing after a yield failed; retrying", extra={"shard": self.shard,
                                                                                    "error": str(exc)[:200]})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0)

    async def _process(self, batch: list[AbstractIncomingMessage]) -> None:
        started = time.monotonic()
        decoded: list[tuple[AbstractIncomingMessage, MonitorResult]] = []
        poison: list[tuple[AbstractIncomingMessage, str]] = []
        for message in batch:
            value = _decode(message)
            if isinstance(value, str):
                poison.append((message, value))
            elif value.shard != self.shard or value.routing_epoch != self.epoch:
                poison.append((message, f"wrong_shard: result for shard {value.shard} of epoch {value.routing_epoch} "
                                        f"on shard {self.shard} of epoch {self.epoch}"))
            else:
                decoded.append((message, value))
        if decoded:
            self._held_since_ms = min(r.received_at.timestamp() for _, r in decoded) * 1000
            m.monitor_result_ingest_lag_ms.labels(shard=self.label).set(self.lag_ms(time.time() * 1000))
        try:
            outcome = await self._apply_with_retries([r for _, r in decoded])
        except _Requeue:
            await self._requeue_outstanding(batch[-1])
            return
        by_id = {r.result_id: message for message, r in decoded}
        poison += [(by_id[rid], reason) for rid, reason in outcome.rejected.items()]
        if await self._settle(batch, poison):
            self._record(outcome, len(batch), time.monotonic() - started)

    async def _settle(self, batch: list[AbstractIncomingMessage],
                      poison: list[tuple[AbstractIncomingMessage, str]]) -> bool:
        """Dead-letter the poison messages (each copy confirmed), then ack the batch. An original whose copy
        was not confirmed is left out of the acks and given back. False when the acks failed."""
        unconfirmed = [message for message, reason in poison if not await self._dead_letter(message, reason)]
        try:
            if not unconfirmed:
                await batch[-1].ack(multiple=True)
                return True
            kept = {id(message) for message in unconfirmed}
            for message in batch:
                if id(message) not in kept:
                    await message.ack()
        except BROKER_ERRORS as exc:
            # Committed but not acked: the redelivery is recognised by the ledger and changes nothing.
            log.warning("ack failed after commit; the broker will redeliver",
                        extra={"shard": self.shard, "error": str(exc)})
            return False
        await self._give_back(unconfirmed)
        return True

    async def _apply_with_retries(self, results: list[MonitorResult]) -> BatchOutcome:
        if not results:
            return BatchOutcome()
        try:
            return await self._retrying(partial(self._apply, results))
        except _Requeue:
            raise
        except Exception as exc:
            m.ingest_poison_fallback_count.inc()
            log.warning("batch refused; applying its results one by one", exc_info=not isinstance(exc, psycopg.Error),
                        extra={"shard": self.shard, "results": len(results), "error": describe_failure(exc)})
            return await self._apply_one_by_one(results)

    async def _retrying(self, apply: Callable[[], Awaitable[BatchOutcome]]) -> BatchOutcome:
        """`apply()`, retried in process on transient errors while holding the deliveries (no delivery counted),
        every `db_retry_delay` seconds; _Requeue once the outage outlasts `db_outage_hold_s` or on shutdown. Any
        other error propagates."""
        attempt = 0
        while True:
            try:
                outcome = await apply()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                attempt += 1
                now = time.monotonic()
                if self._outage_since is None:
                    self._outage_since = now
                m.ingest_transient_error_count.inc()
                log.warning("transient error applying results; holding the shard's deliveries and retrying",
                            exc_info=not isinstance(exc, psycopg.Error | OSError),
                            extra={"shard": self.shard, "attempt": attempt, "error": describe_failure(exc),
                                   "outage_s": round(now - self._outage_since, 1)})
                delay = db_retry_delay(attempt)
                if self._stop.is_set() or now + delay - self._outage_since > self.config.db_outage_hold_s:
                    # Given back before the broker's consumer_timeout would: the redelivery starts a new hold.
                    self._outage_since = None
                    raise _Requeue from exc
                await self._pause(delay)
                continue
            self._outage_since = None
            return outcome

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)

    async def _apply(self, results: list[MonitorResult]) -> BatchOutcome:
        # During an outage, a short wait for a connection: the retry, not the pool's queue, paces the attempts.
        wait = DB_OUTAGE_POOL_WAIT_S if self._outage_since is not None else None
        async with self.write_health.timed(), self.pool.connection(timeout=wait) as conn:
            return await apply_batch(conn, results, applied_by=self.config.instance_id, settings=self.settings)

    async def _apply_one_by_one(self, results: list[MonitorResult]) -> BatchOutcome:
        """Isolate the results that cannot be applied: each in its own transaction, in delivery order.

        A transient error holds and retries that one result as it would the batch (`_retrying`); past the hold the
        batch is requeued: the results applied so far stay committed, and their redelivery is a no-op (ledger)."""
        total = BatchOutcome()
        for r in results:
            try:
                one = await self._retrying(partial(self._apply, [r]))
            except _Requeue:
                raise
            except Exception as exc:
                total.rejected[r.result_id] = _poison_reason(exc)
                log.warning("result refused; dead-lettering it", exc_info=not isinstance(exc, psycopg.Error),
                            extra={"shard": self.shard, "result_id": str(r.result_id), "tenant_id": r.tenant_id,
                                   "task_id": str(r.task_id), "error": describe_failure(exc)})
                continue
            total.applied += one.applied
            total.duplicates += one.duplicates
            total.rejected.update(one.rejected)
            total.rows_written += one.rows_written
            total.rebuilds_requested += one.rebuilds_requested
            total.first_result_latencies_ms += one.first_result_latencies_ms
        return total

    async def _dead_letter(self, message: AbstractIncomingMessage, reason: str) -> bool:
        """Copy to the ingest DLQ, retried a little; True once the broker confirmed the copy."""
        for attempt, backoff in enumerate((*DEAD_LETTER_RETRIES, None)):
            try:
                await self.dead_letters.publish(self.topology.ingest_dlq, message, reason,
                                                routing_key=self.topology.ingest_dlq_copy_key)
            except DeadLetterUnconfirmed as exc:
                m.ingest_dead_letter_unconfirmed_count.inc()
                log.error("dead letter not confirmed; the message is kept", extra={
                    "shard": self.shard, "message_id": message.message_id, "attempt": attempt + 1,
                    "reason": reason[:200], "error": str(exc)})
                if backoff is None or self._stop.is_set() or not _alive(message):
                    return False
                await self._pause(backoff)
                continue
            m.ingest_dead_letter_count.inc(reason=reason.split(":", 1)[0])
            return True
        raise AssertionError("unreachable")

    async def _give_back(self, messages: list[AbstractIncomingMessage]) -> None:
        """Requeue poison messages whose dead letter was not confirmed, after the same back-off as a requeued
        batch, so a broker that keeps refusing the copy spends the delivery limit slowly."""
        await self._pause(_requeue_backoff(messages[-1]))
        for message in messages:
            with contextlib.suppress(*BROKER_ERRORS):
                await message.nack(requeue=True)

    async def _requeue_outstanding(self, last: AbstractIncomingMessage) -> None:
        """Return the batch and everything buffered behind it, in order, for a later delivery.

        Backs off first (longer for messages already redelivered), so an outage that outlasts the hold, or a bug
        outside applying, spends the delivery limit slowly rather than in a burst.
        """
        await self._pause(_requeue_backoff(last))
        while self._carry or not self.buffer.empty():
            queued = self._take()
            if _alive(queued):
                last = queued
        with contextlib.suppress(*BROKER_ERRORS):
            await last.nack(multiple=True, requeue=True)

    def _record(self, outcome: BatchOutcome, delivered: int, elapsed_s: float) -> None:
        for r in outcome.applied:
            m.ingest_results_applied_count.inc(status=r.status)
        if outcome.duplicates:
            m.ingest_results_duplicate_count.inc(outcome.duplicates)
        for latency in outcome.first_result_latencies_ms:
            m.collect_now_first_result_latency_ms.observe(latency)
        m.ingest_batch_size.observe(delivered)
        m.ingest_batch_duration_ms.observe(elapsed_s * 1000)


class _Requeue(Exception):
    """A transient failure that outlasted the hold (or met a shutdown): the deliveries go back to the queue."""


def db_retry_delay(attempt: int) -> float:
    """Seconds before retrying after the `attempt`-th transient error in a row: doubling from 0.2 s, capped at 1 s."""
    return min(DB_RETRY_FIRST_DELAY_S * 2.0 ** (attempt - 1), DB_RETRY_MAX_DELAY_S)


def _requeue_backoff(message: AbstractIncomingMessage) -> float:
    """Seconds to wait before giving `message` back: longer for a message redelivered already."""
    count = (message.headers or {}).get("x-delivery-count")
    redeliveries = count if isinstance(count, int) else 0
    return min(2.0 ** redeliveries, 15.0)


class IngestWorker:
    """All shard consumers of this replica (every shard of the active routing epoch, and of the epoch draining
    during a reshard), plus membership (shard spreading), the reshard barrier and housekeeping."""

    def __init__(self, connection: AbstractRobustConnection, topology: Topology, pool: AsyncConnectionPool[Conn],
                 config: IngestConfig, write_health: WriterHealth | None = None) -> None:
        self.connection = connection
        self.topology = topology
        self.pool = pool
        self.config = config
        self.write_rate = WriteRateGauge()
        self.write_health = write_health or WriterHealth("ingest", config.instance_id)
        self._settings = SettingsCache(pool, max_age_s=5.0)
        # Shared by the shards: dead letters are rare, and it publishes them one at a time anyway.
        self.dead_letters = DeadLetterPublisher(connection, topology)
        self.broker_dead_letters = BrokerDeadLetterCounter(connection, topology)
        self.routing_store = RoutingStore(topology.ingest_shards)
        self.routing = RoutingState(Routing(0, topology.ingest_shards))
        self.consumers: dict[tuple[int, int], ShardConsumer] = {}
        self._loops: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._forwarder: AbstractChannel | None = None
        self.subscribed = asyncio.Event()
        self._assigned: dict[tuple[int, int], str] = {}
        self._stop = asyncio.Event()

    @property
    def shards(self) -> list[ShardConsumer]:
        return list(self.consumers.values())

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        started: list[asyncio.Task[None]] = []
        try:
            if not await self._start(stop):
                return
            self.subscribed.set()
            housekeeping = asyncio.create_task(self._housekeeping(stop), name="ingest-housekeeping")
            lag = asyncio.create_task(self._refresh_lag(stop), name="ingest-lag")
            started = [housekeeping, lag]
            while not stop.is_set():
                watched = [*self._loops.values(), housekeeping, lag]
                done, _ = await asyncio.wait(watched, timeout=1.0, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                if housekeeping in done or lag in done:
                    break
        finally:
            stop.set()
            await asyncio.gather(*self._loops.values(), *started, return_exceptions=True)
            for shard in self.consumers.values():
                await shard.close()
            if self._forwarder is not None:
                with contextlib.suppress(Exception):
                    await self._forwarder.close()
            await self.broker_dead_letters.close()
            await self.dead_letters.close()
            with contextlib.suppress(Exception):
                async with self.pool.connection() as conn:
                    await conn.execute(q.LEAVE_MEMBERS, {"instance_id": self.config.instance_id})
            log.info("ingest worker stopped", extra={"instance_id": self.config.instance_id})

    async def _start(self, stop: asyncio.Event) -> bool:
        """The routing state, a consumer on every shard this replica may take, the broker's dead letters, then the
        membership (joined only once subscribed everywhere: peers yield shards to members that can take them). A
        broker or database that drops the connection meanwhile (a broker restart while a replica starts) is waited
        for and the start carried on, as housekeeping does later: every step is a no-op where it was done. False:
        stopped first."""
        while not stop.is_set():
            try:
                async with self.pool.connection() as conn:
                    self.routing = await self.routing_store.state(conn)
                await self._sync_consumers()
                if self.broker_dead_letters.channel is None:
                    await self.broker_dead_letters.subscribe()
                await self._heartbeat()
                return True
            except (psycopg.Error, OSError, *BROKER_ERRORS, RuntimeError) as exc:
                # aio-pika's RuntimeError("Connection was not opened"): a channel asked for while the robust
                # connection reconnects. Any other RuntimeError is a bug and stops the service.
                if isinstance(exc, RuntimeError) and self.connection.connected.is_set():
                    raise
                log.warning("ingest start-up interrupted; carrying on", extra={"error": str(exc)[:300]})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=START_RETRY_S)
        return False

    def _consumer(self, epoch: int, shard: int) -> ShardConsumer:
        key = (epoch, shard)
        consumer = self.consumers.get(key)
        if consumer is None:
            consumer = ShardConsumer(shard, self.connection, self.topology, self.pool, self.config, self._settings,
                                     self.dead_letters, self.write_health, epoch=epoch)
            # Set from the start: a marker can reach a shard before this replica has read that a reshard began.
            consumer.forward, consumer.on_marker = self._forward, self._on_marker
            self.consumers[key] = consumer
            self._loops[key] = asyncio.create_task(consumer.run(self._stop), name=f"shard-e{epoch}-{shard}")
        return consumer

    async def _sync_consumers(self) -> None:
        """Consumers for the routing state: the active epoch's shards (each once the old shards it takes keys from
        are drained), the draining epoch's (applying until their drain marker, forwarding after it); retired epochs'
        consumers closed."""
        state = self.routing
        active, old = state.active, state.draining
        for shard in range(active.shards):
            consumer = self._consumer(active.epoch, shard)
            if not consumer.subscribed and may_consume(shard, old, active.shards, set(state.drained)):
                if old is not None:
                    log.info("taking over a resharded shard", extra={"epoch": active.epoch, "shard": shard})
                await consumer.subscribe()
        live = {active.epoch} | ({old.epoch} if old is not None else set())
        if old is not None:
            for shard in range(old.shards):
                consumer = self._consumer(old.epoch, shard)
                consumer.yield_requested = False
                consumer.drained = consumer.drained or shard in state.drained
                await consumer.subscribe()
        for key in [k for k in self.consumers if k[0] not in live]:
            await self._drop(key)

    async def _on_marker(self, consumer: ShardConsumer) -> bool:
        async with self.pool.connection() as conn:
            drained = await self.routing_store.mark_drained(conn, consumer.epoch, consumer.shard,
                                                            self.config.instance_id)
        if drained:
            log.info("old shard drained", extra={"epoch": consumer.epoch, "shard": consumer.shard})
        else:
            log.warning("a drain marker on a shard whose epoch is not draining; dropped",
                        extra={"epoch": consumer.epoch, "shard": consumer.shard})
        return drained

    async def _forward(self, message: AbstractIncomingMessage) -> bool:
        """Re-route a result that reached a drained old shard to the active epoch (confirmed, mandatory)."""
        value = _decode(message)
        if isinstance(value, str):
            return False
        forwarded = routed(value, self.routing.active)
        try:
            if self._forwarder is None or self._forwarder.is_closed:
                self._forwarder = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await self._forwarder.get_exchange(self.topology.result_exchange, ensure=False)
            await exchange.publish(aio_pika.Message(
                body=msgspec.json.encode(forwarded), content_type="application/json", message_id=message.message_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT, type=message.type, headers=message.headers),
                routing_key=self.routing.active.routing_key(forwarded.shard), mandatory=True, timeout=5.0)
        except (*BROKER_ERRORS, RuntimeError) as exc:
            log.warning("forwarding a late result failed; it goes back", extra={"error": str(exc)[:200]})
            return False
        log.info("late result forwarded to the active epoch", extra={
            "result_id": str(value.result_id), "epoch": forwarded.routing_epoch, "shard": forwarded.shard})
        return True

    async def _drop(self, key: tuple[int, int]) -> None:
        consumer = self.consumers.pop(key)
        loop = self._loops.pop(key)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await consumer.close()

    async def _heartbeat(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(q.HEARTBEAT_MEMBER, {"instance_id": self.config.instance_id})

    async def _housekeeping(self, stop: asyncio.Event) -> None:
        last_purge = 0.0
        while not stop.is_set():
            try:
                async with self.pool.connection() as conn:
                    self.routing = await self.routing_store.state(conn)
                await self._sync_consumers()
                await self._rebalance()
                if time.monotonic() - last_purge > 600:
                    last_purge = time.monotonic()
                    async with self.pool.connection() as conn:
                        await conn.execute(q.PURGE_APPLIED, {"hours": self.config.retention_hours, "limit": 10_000})
                async with self.pool.connection() as conn:
                    rate = await self.write_rate.update(conn)
                if rate is not None:
                    m.monitoring_pg_write_qps.set(rate)
            except (psycopg.Error, OSError, *BROKER_ERRORS) as exc:
                log.warning("ingest housekeeping failed; retrying", extra={"error": str(exc)[:300]})
            except RuntimeError as exc:
                # aio-pika's "Connection was not opened": a channel asked for while the broker is away (the
                # robust connection reconnects by itself). Anything else is a bug and stops the service.
                if self.connection.connected.is_set():
                    raise
                log.warning("ingest housekeeping: the broker is away; retrying", extra={"error": str(exc)[:300]})
            recent = time.monotonic() - 5.0
            m.ingest_active_shards.set(sum(1 for s in self.consumers.values() if s.last_delivery_at > recent))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.member_heartbeat_s)

    async def _refresh_lag(self, stop: asyncio.Event) -> None:
        """Every `lag_refresh_s`, each shard's lag from what it holds now, not from when its batch started."""
        while not stop.is_set():
            now_ms = time.time() * 1000
            for shard in list(self.consumers.values()):
                m.monitor_result_ingest_lag_ms.labels(shard=shard.label).set(shard.lag_ms(now_ms))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.lag_refresh_s)

    async def _rebalance(self) -> None:
        """Heartbeat, then yield the active epoch's shards that are assigned to another live member (once per
        change)."""
        async with self.pool.connection() as conn:
            await conn.execute(q.HEARTBEAT_MEMBER, {"instance_id": self.config.instance_id})
            await conn.execute(q.FORGET_STALE_MEMBERS, {"timeout_s": self.config.member_timeout_s})
            cur = await conn.execute(q.LIVE_MEMBERS, {"timeout_s": self.config.member_timeout_s})
            members = [str(row["instance_id"]) for row in await cur.fetchall()]
        if self.config.instance_id not in members:
            members.append(self.config.instance_id)
        active = self.routing.active
        assignment = assign_shards(members, active.shards)
        for shard, owner in assignment.items():
            consumer = self.consumers.get((active.epoch, shard))
            if consumer is None or not consumer.subscribed:
                continue
            if self._assigned.get((active.epoch, shard)) != owner:
                self._assigned[(active.epoch, shard)] = owner
                if owner != self.config.instance_id:
                    consumer.yield_requested = True
