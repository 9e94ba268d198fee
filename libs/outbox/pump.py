"""The outbox pump: claim committed rows, publish with confirms, mark published after the confirm."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import aio_pika
import msgspec
import psycopg
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection
from pamqp.commands import Basic
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import MESSAGE_TYPES
from libs.db.listen import listen_forever
from libs.db.pool import Conn
from libs.mq.connection import connect as mq_connect
from libs.mq.topology import LOGICAL_EXCHANGES, Topology, declare_exchanges
from libs.outbox import queries as q
from libs.outbox.state import FailureKind, after_failure
from libs.outbox.writer import NOTIFY_CHANNEL, PRIORITY_WAKE
from libs.telemetry import metrics

log = logging.getLogger("outbox.pump")


@dataclass(frozen=True, slots=True)
class ClaimedEvent:
    id: int
    event_id: Any
    exchange: str
    routing_key: str
    message_type: str
    payload: bytes
    headers: dict[str, Any]
    ordering_key: str | None
    tenant_id: int | None
    traceparent: str | None
    attempts: int
    max_attempts: int
    created_at: datetime
    priority: int = 0


class PublishError(Exception):
    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Publisher(Protocol):
    def ready(self) -> bool: ...

    async def wait_ready(self, timeout: float) -> bool: ...

    async def publish(self, event: ClaimedEvent) -> None: ...


def validate_payload(event: ClaimedEvent) -> None:
    """Only events whose payload matches their contract leave the outbox (payload allow-list)."""
    if event.exchange not in LOGICAL_EXCHANGES:
        raise PublishError("permanent", f"unknown exchange {event.exchange!r}")
    contract = MESSAGE_TYPES.get(event.message_type)
    if contract is None:
        raise PublishError("permanent", f"unknown message_type {event.message_type!r}")
    try:
        msgspec.json.decode(event.payload, type=contract)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PublishError("permanent", f"payload does not match {event.message_type}: {exc}") from exc


class AmqpPublisher:
    """Publishes with publisher confirms on one robust channel."""

    def __init__(self, amqp_url: str, topology: Topology, *, timeout: float, name: str) -> None:
        self._url = amqp_url
        self._topology = topology
        self._timeout = timeout
        self._name = name
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._channel_lock = asyncio.Lock()

    async def start(self) -> None:
        self._connection = await mq_connect(self._url, name=self._name)
        await self._open_channel()

    async def _open_channel(self) -> None:
        assert self._connection is not None
        self._channel = await self._connection.channel(publisher_confirms=True)
        self._exchanges = await declare_exchanges(self._channel, self._topology)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    def ready(self) -> bool:
        return (self._connection is not None and self._connection.connected.is_set()
                and self._channel is not None and not self._channel.is_closed)

    async def wait_ready(self, timeout: float) -> bool:
        if self._connection is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connection.connected.wait(), timeout)
        if self._connection.connected.is_set() and (self._channel is None or self._channel.is_closed):
            async with self._channel_lock:
                if self._channel is None or self._channel.is_closed:
                    with contextlib.suppress(Exception):
                        await self._open_channel()
        return self.ready()

    async def publish(self, event: ClaimedEvent) -> None:
        validate_payload(event)
        exchange = self._exchanges.get(event.exchange)
        if exchange is None or not self.ready():
            raise PublishError("transient", "broker connection is not ready")
        headers: dict[str, Any] = {k: v for k, v in event.headers.items() if isinstance(v, str | int | bool)}
        if event.traceparent:
            headers["traceparent"] = event.traceparent
        headers["x-outbox-id"] = event.id
        # The AMQP properties are built directly (not through aio_pika.Message): the pump is CPU-bound in
        # Python at a few thousand events/s, and this is its per-event hot path.
        properties = Basic.Properties(
            content_type="application/json",
            delivery_mode=2,  # persistent
            message_id=str(event.event_id),
            message_type=event.message_type,
            timestamp=event.created_at,
            headers=headers,
        )
        try:
            assert self._channel is not None
            underlay = await self._channel.get_underlay_channel()
            # mandatory=False: a dispatch event for an offline client is unroutable by design (the hub
            # replays from the database on reconnect), not an error.
            await underlay.basic_publish(event.payload, exchange=exchange.name, routing_key=event.routing_key,
                                         properties=properties, mandatory=False, timeout=self._timeout)
        except aio_pika.exceptions.DeliveryError as exc:
            raise PublishError("transient", f"broker refused the message: {exc}") from exc
        except TimeoutError as exc:
            raise PublishError("transient", "no publisher confirm before the timeout") from exc
        except Exception as exc:  # connection and channel failures of any kind: retry later
            raise PublishError("transient", f"{type(exc).__name__}: {exc}") from exc


Outcome = Literal["published", "failed", "unattempted"]


@dataclass(slots=True)
class PumpConfig:
    claimed_by: str
    batch_size: int = 200
    poll_interval_s: float = 1.0
    listen: bool = True
    lease_seconds: float = 30.0
    backoff_base_ms: int = 500
    backoff_max_ms: int = 300_000
    retention_hours: int = 24
    concurrency: int = 2
    # One more claim loop for prioritised rows only (priority > 0: high dispatch, collect-now control), so
    # they never wait for the other loops to finish publishing a batch of normal events.
    express: bool = True
    express_batch_size: int = 50


class OutboxPump:
    def __init__(self, pool: AsyncConnectionPool[Conn], publisher: Publisher, config: PumpConfig,
                 *, listen_url: str | None = None) -> None:
        self._pool = pool
        self._publisher = publisher
        self._config = config
        self._listen_url = listen_url
        # One wake-up event per claim loop (see wake(): a NOTIFY wakes one idle regular loop).
        self._regular = max(1, config.concurrency)
        self._wakes = [asyncio.Event() for _ in range(self._regular + (1 if config.express else 0))]
        # Which regular loops are between a claim and the end of its batch's publishing.
        self._busy = [False] * self._regular
        self._stopping = False
        self.listening = asyncio.Event()
        self.published_total = 0

    def wake(self, *, prioritised: bool = True) -> None:
        """New work: wake one regular loop (the first that is not publishing a batch, so the new event does
        not wait for a busy loop to finish), and the priority loop when prioritised rows may be waiting.
        Further regular loops are woken in turn by a loop that claimed a full batch (a backlog), so a lone
        event does not make every loop queue up on the claim lock."""
        idle = next((i for i, busy in enumerate(self._busy) if not busy), 0)
        self._wakes[idle].set()
        if self._config.express and prioritised:
            self._wakes[-1].set()

    def _wake_all(self) -> None:
        for event in self._wakes:
            event.set()

    # ---- claim / publish / mark --------------------------------------------------------------
    async def claim(self, limit: int | None = None, *, min_priority: int = 0) -> list[ClaimedEvent]:
        """Claim up to `limit` rows in priority DESC, id order (`min_priority` > 0: prioritised rows only)."""
        async with self._pool.connection() as conn, conn.pipeline():
            # One round trip: BEGIN, the claim lock, the claim and COMMIT go out in one pipeline (the rows
            # are read after the commit is queued). The commit does not wait for the WAL flush (ASYNC_COMMIT).
            async with conn.transaction():
                await conn.execute(q.ASYNC_COMMIT)
                if min_priority <= 0:  # prioritised-only claims need no claim lock (queries.CLAIM)
                    await conn.execute(q.LOCK_CLAIMS, {"lock": q.OUTBOX_CLAIM_LOCK})
                cur = await conn.execute(q.CLAIM, {
                    "limit": limit or self._config.batch_size,
                    "min_priority": min_priority,
                    "claimed_by": self._config.claimed_by,
                    "lease_seconds": self._config.lease_seconds,
                })
            rows = await cur.fetchall()
        return [ClaimedEvent(**row) for row in rows]

    async def reclaim_expired(self) -> int:
        """Claims whose lease ran out (a pump died or stalled) go back to retryable, or to
        dead_letter once out of attempts. Runs under the claim lock, off the publish path."""
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(q.LOCK_CLAIMS, {"lock": q.OUTBOX_CLAIM_LOCK})
            cur = await conn.execute(q.RECLAIM_EXPIRED)
            rows = await cur.fetchall()
        for row in rows:
            log.warning("reclaimed an expired outbox claim", extra={"outbox_id": row["id"], "status": row["status"]})
            if row["status"] == "dead_letter":
                metrics.outbox_dead_letter_count.inc()
        if rows:
            self.wake()
        return len(rows)

    async def _publish_chain(self, chain: list[ClaimedEvent], outcomes: dict[int, tuple[Outcome, Any]]) -> None:
        """Events of one ordering key, one after another; stop the chain at the first failure.

        A published event's outcome carries the time of its broker confirm: that is its `published_at`."""
        for index, event in enumerate(chain):
            try:
                await self._publisher.publish(event)
            except PublishError as exc:
                outcomes[event.id] = ("failed", exc)
                for rest in chain[index + 1:]:
                    outcomes[rest.id] = ("unattempted", None)
                return
            outcomes[event.id] = ("published", datetime.now(UTC))

    async def process(self, batch: list[ClaimedEvent]) -> int:
        chains: dict[str, list[ClaimedEvent]] = defaultdict(list)
        singles: list[list[ClaimedEvent]] = []
        # Prioritised events first (their chains start publishing first); per key, id order (= commit order).
        for event in sorted(batch, key=lambda e: (-e.priority, e.id)):
            if event.ordering_key is None:
                singles.append([event])
            else:
                chains[event.ordering_key].append(event)
        outcomes: dict[int, tuple[Outcome, Any]] = {}
        try:
            await asyncio.gather(*(self._publish_chain(c, outcomes) for c in [*chains.values(), *singles]))
        finally:
            await asyncio.shield(self._record(batch, outcomes, keys=list(chains)))
        return sum(1 for o, _ in outcomes.values() if o == "published")

    async def _record(self, batch: list[ClaimedEvent], outcomes: dict[int, tuple[Outcome, Any]],
                      *, keys: list[str]) -> None:
        """Write the batch's outcomes in one pipelined transaction. `keys`: the batch's ordering keys; when
        later events of those keys are waiting (claimable only now), NOTIFY wakes the pumps for them."""
        by_id = {e.id: e for e in batch}
        published = {i: at for i, (o, at) in outcomes.items() if o == "published"}
        unattempted = [e.id for e in batch if outcomes.get(e.id, ("unattempted", None))[0] == "unattempted"]
        async with self._pool.connection() as conn, conn.pipeline(), conn.transaction():
            await conn.execute(q.ASYNC_COMMIT)
            if keys:
                await conn.execute(q.NOTIFY_IF_SUCCESSORS, {"channel": NOTIFY_CHANNEL, "keys": keys})
            if published:
                await conn.execute(q.MARK_PUBLISHED, {"ids": list(published), "published_at": list(published.values()),
                                                      "claimed_by": self._config.claimed_by})
            if unattempted:
                await conn.execute(q.RELEASE_UNATTEMPTED, {"ids": unattempted,
                                                           "claimed_by": self._config.claimed_by})
            for event_id, (outcome, exc) in outcomes.items():
                if outcome != "failed":
                    continue
                event = by_id[event_id]
                decision = after_failure(
                    attempts=event.attempts, max_attempts=event.max_attempts, kind=exc.kind, error=str(exc),
                    base_ms=self._config.backoff_base_ms, max_ms=self._config.backoff_max_ms)
                metrics.outbox_publish_failed_count.inc(exchange=event.exchange)
                if decision.status == "dead_letter":
                    metrics.outbox_dead_letter_count.inc()
                    await conn.execute(q.MARK_DEAD_LETTER, {"id": event.id, "error": decision.reason,
                                                            "claimed_by": self._config.claimed_by})
                    log.error("outbox event dead-lettered", extra={
                        "outbox_id": event.id, "event_id": str(event.event_id), "tenant_id": event.tenant_id,
                        "attempts": event.attempts, "reason": decision.reason[:300]})
                else:
                    await conn.execute(q.MARK_RETRYABLE, {"id": event.id, "error": decision.reason,
                                                          "delay_s": decision.delay_ms / 1000,
                                                          "claimed_by": self._config.claimed_by})
                    log.warning("outbox publish failed, will retry", extra={
                        "outbox_id": event.id, "event_id": str(event.event_id), "tenant_id": event.tenant_id,
                        "attempts": event.attempts, "retry_in_ms": decision.delay_ms,
                        "error": decision.reason[:300]})
        for event_id, confirmed_at in published.items():
            event = by_id[event_id]
            metrics.outbox_published_count.inc(exchange=event.exchange)
            metrics.outbox_commit_to_publish_ms.observe((confirmed_at - event.created_at).total_seconds() * 1000)
        self.published_total += len(published)

    async def run_once(self, *, express: bool = False, loop: int | None = None) -> int:
        """Claim and publish one batch; returns how many rows were claimed.

        `express`: prioritised rows only, in a small batch (the express loop). `loop`: the regular claim
        loop running this (marked busy meanwhile).
        """
        if loop is not None:
            self._busy[loop] = True
        try:
            batch = await (self.claim(self._config.express_batch_size, min_priority=1) if express
                           else self.claim())
            if batch:
                await self.process(batch)
        finally:
            if loop is not None:
                self._busy[loop] = False
        return len(batch)

    # ---- loops --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._stop_watch(stop), name="outbox-stop-watch"),
                 asyncio.create_task(self._maintain(stop), name="outbox-maintenance")]
        if self._config.listen and self._listen_url:
            tasks.append(asyncio.create_task(self._listen(stop), name="outbox-listen"))
        try:
            regular = self._regular  # the express loop, if any, is the last one
            await asyncio.gather(*(
                self._claim_loop(stop, wake, express=index >= regular, loop=index if index < regular else None,
                                 next_wake=self._wakes[index + 1] if index + 1 < regular else None)
                for index, wake in enumerate(self._wakes)))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _claim_loop(self, stop: asyncio.Event, wake: asyncio.Event, *, express: bool = False,
                          loop: int | None = None, next_wake: asyncio.Event | None = None) -> None:
        # Several loops overlap one batch's claim with another's publishing; the claim lock and the
        # ordering rule of the CLAIM query keep per-key order across loops as across pumps.
        while not stop.is_set():
            if not self._publisher.ready():
                # Broker away: claim nothing (attempts are not burnt by an outage).
                await self._publisher.wait_ready(timeout=1.0)
                continue
            wake.clear()
            try:
                claimed = await self.run_once(express=express, loop=loop)
            except (psycopg.OperationalError, psycopg_pool_errors()) as exc:
                log.warning("outbox claim failed; database unavailable?", extra={"error": str(exc)})
                claimed = 0
            if claimed >= (self._config.express_batch_size if express else self._config.batch_size):
                if next_wake is not None:
                    next_wake.set()  # a backlog: bring the next loop in
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self._config.poll_interval_s)

    async def _stop_watch(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake_all()

    async def _listen(self, stop: asyncio.Event) -> None:
        assert self._listen_url is not None

        def on_notify(payload: str | None) -> None:
            # None: (re)connected, anything committed meanwhile is waiting.
            self.wake(prioritised=payload is None or payload == PRIORITY_WAKE)

        await listen_forever(self._listen_url, NOTIFY_CHANNEL, on_notify, stop=stop, listening=self.listening,
                             name="outbox-pump-listen", meanwhile="polling")

    async def _maintain(self, stop: asyncio.Event) -> None:
        last_cleanup = last_depth = 0.0
        while not stop.is_set():
            try:
                await self.reclaim_expired()
                if time.monotonic() - last_depth >= 5:
                    await self._record_depth()
                    last_depth = time.monotonic()
                if time.monotonic() - last_cleanup > 60:
                    async with self._pool.connection() as conn:
                        await conn.execute(q.DELETE_PUBLISHED_BEFORE, {
                            "hours": self._config.retention_hours, "limit": 5000})
                    last_cleanup = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox maintenance failed", extra={"error": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _record_depth(self) -> None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(q.DEPTH_BY_STATUS)
            rows = {r["status"]: r for r in await cur.fetchall()}
        oldest = 0
        for status in ("queued", "running", "retryable", "dead_letter"):
            row = rows.get(status)
            metrics.outbox_depth.labels(status=status).set(row["n"] if row else 0)
            if row and status != "dead_letter":
                oldest = max(oldest, int(row["oldest_ms"]))
        metrics.outbox_oldest_pending_age_ms.set(oldest)


def psycopg_pool_errors() -> type[Exception]:
    from psycopg_pool import PoolTimeout

    return PoolTimeout
