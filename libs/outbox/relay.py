"""Publishing claimed outbox rows: the publisher, and the relay that publishes a claimed batch and records
each outcome (published, retryable, dead letter, released) under the claimer's name.

The pump (libs/outbox/pump.py) claims rows and hands them to its relay. A writer whose events are on a
latency-critical path (the dispatch coordinator's high TaskAvailable) may also claim its own rows in the
writing transaction (`claim_own`) and relay them right after its commit, saving the NOTIFY -> pump -> claim
hop. Same state machine and rules as the pump (the outbox rulebook): the claim is an atomic UPDATE with a lease, it
counts the attempt, per-key order holds (a row is claimed only when no earlier unfinished row of its key
exists outside the claimer's own batch), and a claimer that dies after its commit leaves running rows whose
lease expires, which any pump then reclaims and publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import aio_pika
import msgspec
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection
from pamqp.commands import Basic
from psycopg import AsyncCursor
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import DISPATCH_BATCH, PUBLISHED_MESSAGE_TYPES
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.mq import hub_routing
from libs.mq.connection import connect as mq_connect
from libs.mq.topology import DISPATCH, LOGICAL_EXCHANGES, Topology, declare_exchanges
from libs.outbox import dispatch_batches
from libs.outbox import queries as q
from libs.outbox.state import (
    TRANSITION_EVENT,
    FailureKind,
    FailureOutcome,
    after_failure,
    broker_failure_kind,
    error_summary,
    transition_fields,
)
from libs.outbox.writer import NOTIFY_CHANNEL, PRIORITY_WAKE
from libs.telemetry import metrics, tracing

log = logging.getLogger("outbox.relay")


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
    previous_status: str = "queued"  # before the claim: queued or retryable


def event_source(event: ClaimedEvent) -> dict[str, object]:
    """The source fields of a claimed row's transition log lines (state.SOURCE_FIELDS)."""
    return {"outbox_id": event.id, "event_id": str(event.event_id), "tenant_id": event.tenant_id,
            "exchange": event.exchange, "routing_key": event.routing_key, "ordering_key": event.ordering_key,
            "message_type": event.message_type, "attempt": event.attempts, "max_attempts": event.max_attempts}


def log_claimed(events: Sequence[ClaimedEvent], owner: str) -> None:
    """One transition line per claimed row (queued or retryable -> running), from what the claim returned."""
    if not log.isEnabledFor(logging.INFO):  # the per-row fields cost more than the line when it is dropped
        return
    for event in events:
        log.info(TRANSITION_EVENT, extra=transition_fields("claimed", event.previous_status, "running", owner=owner,
                                                           source=event_source(event)))


class PublishError(Exception):
    """`broker_unavailable`: the broker could not take any message (not connected, blocked by a memory or disk
    alarm, no confirm in time), which says nothing about this one: its claim's attempt is given back instead of
    counted, so an outage or an alarm of any length holds the rows and never dead-letters them."""

    def __init__(self, kind: FailureKind, message: str, *, broker_unavailable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.broker_unavailable = broker_unavailable


class Publisher(Protocol):
    def ready(self) -> bool: ...

    async def wait_ready(self, timeout: float) -> bool: ...

    async def publish(self, event: ClaimedEvent) -> None: ...


def validate_payload(event: ClaimedEvent) -> None:
    """Only events whose payload matches their contract leave the outbox (payload allow-list)."""
    if event.exchange not in LOGICAL_EXCHANGES:
        raise PublishError("permanent", f"unknown exchange {event.exchange!r}")
    contract = PUBLISHED_MESSAGE_TYPES.get(event.message_type)
    if contract is None:
        raise PublishError("permanent", f"unknown message_type {event.message_type!r}")
    try:
        msgspec.json.decode(event.payload, type=contract)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PublishError("permanent", f"payload does not match {event.message_type}: {exc}") from exc


def _publishable(event: ClaimedEvent) -> bool:
    try:
        validate_payload(event)
    except PublishError:
        return False  # published alone, so that it dead-letters alone
    return True


def envelope_event(envelope: dispatch_batches.Envelope, carried: Sequence[ClaimedEvent]) -> ClaimedEvent:
    """A `dispatch_batch` envelope as the one message the publisher sends for `carried` (its events, in order):
    the publish span's parent is the first event's context; each event keeps its own in the envelope."""
    first = carried[0]
    return ClaimedEvent(id=first.id, event_id=envelope.message_id, exchange=DISPATCH,
                        routing_key=envelope.routing_key, message_type=DISPATCH_BATCH, payload=envelope.body,
                        headers={"x-dispatch-batch-events": len(carried)}, ordering_key=None,
                        tenant_id=first.tenant_id, traceparent=first.traceparent, attempts=first.attempts,
                        max_attempts=first.max_attempts, created_at=min(e.created_at for e in carried),
                        priority=max(e.priority for e in carried))


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
        if not tracing.enabled():
            return await self._publish(event, event.traceparent)
        # A producer span per event, a child of the context its writer stored in the row; its own traceparent
        # goes in the AMQP headers, so the consumer's spans are its children.
        with tracing.span("outbox.publish", kind=tracing.SpanKind.PRODUCER,
                          parent=tracing.context_from_traceparent(event.traceparent), attributes={
                              "messaging.system": "rabbitmq", "messaging.destination.name": event.exchange,
                              "messaging.rabbitmq.destination.routing_key": event.routing_key,
                              "messaging.message.id": str(event.event_id), "monitoring.message_type":
                              event.message_type, "monitoring.outbox_id": event.id,
                              "monitoring.attempt": event.attempts, tracing.TENANT_ID: event.tenant_id}) as span:
            return await self._publish(event, tracing.traceparent_of(span) or event.traceparent)

    async def _publish(self, event: ClaimedEvent, traceparent: str | None) -> None:
        validate_payload(event)
        exchange = self._exchanges.get(event.exchange)
        if exchange is None or not self.ready():
            raise PublishError("transient", "broker connection is not ready", broker_unavailable=True)
        headers: dict[str, Any] = {k: v for k, v in event.headers.items() if isinstance(v, str | int | bool)}
        if traceparent:
            headers["traceparent"] = traceparent
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
        except aio_pika.exceptions.DeliveryError as exc:  # a nack (transient), or the message returned (permanent)
            raise PublishError(broker_failure_kind(exc), f"broker refused the message: {exc}") from exc
        except TimeoutError as exc:  # a publisher blocked by a broker alarm waits here too
            raise PublishError("transient", "no publisher confirm before the timeout",
                               broker_unavailable=True) from exc
        except Exception as exc:  # connection and channel failures of any kind: retry later
            raise PublishError("transient", f"{type(exc).__name__}: {exc}", broker_unavailable=True) from exc


Outcome = Literal["published", "failed", "unattempted"]


class OutboxRelay:
    """Publishes a claimed batch (per ordering key in id order, keys in parallel) and records every outcome in
    one transaction, under `claimed_by` (the claimer's name: only rows it still holds are marked)."""

    def __init__(self, pool: AsyncConnectionPool[Conn], publisher: Publisher, *, claimed_by: str,
                 backoff_base_ms: int = 500, backoff_max_ms: int = 300_000) -> None:
        self._pool = pool
        self._publisher = publisher
        self.claimed_by = claimed_by
        self._backoff_base_ms = backoff_base_ms
        self._backoff_max_ms = backoff_max_ms
        self.published_total = 0

    def ready(self) -> bool:
        """Can it publish now? (A claimer whose broker is away should leave rows to the pumps.)"""
        return self._publisher.ready()

    async def _publish_chain(self, chain: list[ClaimedEvent], outcomes: dict[int, tuple[Outcome, Any]]) -> None:
        """Events of one ordering key, one after another; stop the chain at the first failure.

        A published event's outcome carries the time of its broker confirm: that is its `published_at`."""
        for index, event in enumerate(chain):
            try:
                await self._publisher.publish(event)
            except PublishError as exc:
                # A broker that takes nothing is not this message's failure: released with its attempt given back.
                outcomes[event.id] = ("unattempted", None) if exc.broker_unavailable else ("failed", exc)
                for rest in chain[index + 1:]:
                    outcomes[rest.id] = ("unattempted", None)
                return
            outcomes[event.id] = ("published", datetime.now(UTC))

    async def process(self, batch: list[ClaimedEvent]) -> int:
        """Publish `batch` and record the outcomes; how many were published."""
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
            # Unresolved (the database went away): nothing is published, every row is released unattempted.
            runs = await self._route_to_hubs([*chains.values(), *singles])
            # Dispatch events towards the same hub go in envelopes (libs/outbox/dispatch_batches.py), the rest alone.
            packed = dispatch_batches.plan(runs, dispatch_exchange=DISPATCH, valid=_publishable)
            work = [*(self._publish_chain(c, outcomes) for c in packed.single),
                    *(self._publish_envelopes(hub, events, outcomes) for hub, events in packed.by_hub.items())]
            if len(work) == 1:  # the usual writer's batch: publish now, not from a task scheduled for later
                await work[0]
            else:
                await asyncio.gather(*work)
        finally:
            await asyncio.shield(self._record(batch, outcomes, keys=list(chains)))
        return sum(1 for o, _ in outcomes.values() if o == "published")

    async def _publish_envelopes(self, hub: str, events: list[ClaimedEvent],
                                 outcomes: dict[int, tuple[Outcome, Any]]) -> None:
        """A hub's events (its chains, in order) as envelopes, one after another; stop at the first failure, which
        is each carried event's failure (the events of the envelopes after it are not attempted)."""
        by_id = {e.id: e for e in events}
        envelopes = dispatch_batches.pack(hub, events)
        for index, envelope in enumerate(envelopes):
            carried = [by_id[i] for i in envelope.event_ids]
            try:
                await self._publisher.publish(envelope_event(envelope, carried))
            except PublishError as exc:
                failed: tuple[Outcome, Any] = ("unattempted", None) if exc.broker_unavailable else ("failed", exc)
                for event in carried:
                    outcomes[event.id] = failed
                for rest in envelopes[index + 1:]:
                    for event_id in rest.event_ids:
                        outcomes[event_id] = ("unattempted", None)
                return
            confirmed_at = datetime.now(UTC)
            metrics.outbox_dispatch_batches_published_count.inc()
            for event in carried:
                outcomes[event.id] = ("published", confirmed_at)

    async def _route_to_hubs(self, runs: list[list[ClaimedEvent]]) -> list[list[ClaimedEvent]]:
        """Dispatch events re-keyed towards the hub that holds their client, read now, after their commit
        (libs/mq/hub_routing.py: why then); other events unchanged. One statement per batch with dispatch events."""
        wanted = hub_routing.clients_to_resolve([e for run in runs for e in run], DISPATCH)
        if not wanted:
            return runs
        async with self._pool.connection() as conn:
            hubs = await hub_routing.read_client_hubs(conn, wanted)
        return [[dataclasses.replace(e, routing_key=hub_routing.routed_key(e, DISPATCH, hubs)) for e in run]
                for run in runs]

    async def _record(self, batch: list[ClaimedEvent], outcomes: dict[int, tuple[Outcome, Any]],
                      *, keys: list[str]) -> None:
        """Write the batch's outcomes in one pipelined transaction. `keys`: the batch's ordering keys; when
        later events of those keys are waiting (claimable only now), NOTIFY wakes the pumps for them."""
        by_id = {e.id: e for e in batch}
        published = {i: at for i, (o, at) in outcomes.items() if o == "published"}
        unattempted = [e.id for e in batch if outcomes.get(e.id, ("unattempted", None))[0] == "unattempted"]
        marked = released = None
        failures: list[tuple[ClaimedEvent, FailureOutcome, PublishError, AsyncCursor[dict[str, Any]]]] = []
        async with self._pool.connection() as conn:
            async with pipelined_transaction(conn):
                await conn.execute(q.ASYNC_COMMIT)
                if keys:
                    await conn.execute(q.NOTIFY_IF_SUCCESSORS, {"channel": NOTIFY_CHANNEL, "keys": keys})
                if published:
                    marked = await conn.execute(q.MARK_PUBLISHED, {
                        "ids": list(published), "published_at": list(published.values()),
                        "claimed_by": self.claimed_by})
                if unattempted:
                    released = await conn.execute(q.RELEASE_UNATTEMPTED, {"ids": unattempted,
                                                                          "claimed_by": self.claimed_by})
                for event_id, (outcome, exc) in outcomes.items():
                    if outcome != "failed":
                        continue
                    event = by_id[event_id]
                    decision = after_failure(
                        attempts=event.attempts, max_attempts=event.max_attempts, kind=exc.kind, error=str(exc),
                        base_ms=self._backoff_base_ms, max_ms=self._backoff_max_ms)
                    metrics.outbox_publish_failed_count.inc(exchange=event.exchange)
                    if decision.status == "dead_letter":
                        metrics.outbox_dead_letter_count.inc()
                        cur = await conn.execute(q.MARK_DEAD_LETTER, {
                            "id": event.id, "error": decision.reason, "error_class": decision.error_class,
                            "claimed_by": self.claimed_by})
                    else:
                        cur = await conn.execute(q.MARK_RETRYABLE, {"id": event.id, "error": decision.reason,
                                                                    "delay_s": decision.delay_ms / 1000,
                                                                    "claimed_by": self.claimed_by})
                    failures.append((event, decision, exc, cur))
            # Committed: the rows the marks changed (a row they did not match was no longer this claimer's).
            published_ids = [int(r["id"]) for r in await marked.fetchall()] if marked is not None else []
            released_rows = await released.fetchall() if released is not None else []
            failed = [(event, decision, exc, mark) for event, decision, exc, cur in failures
                      if (mark := await cur.fetchone()) is not None]
        self._log_outcomes(by_id, published, published_ids, released_rows, failed)
        for event_id, confirmed_at in published.items():
            event = by_id[event_id]
            metrics.outbox_published_count.inc(exchange=event.exchange)
            metrics.outbox_commit_to_publish_ms.observe((confirmed_at - event.created_at).total_seconds() * 1000)
        self.published_total += len(published)

    def _log_outcomes(self, by_id: dict[int, ClaimedEvent], published: dict[int, datetime], published_ids: list[int],
                      released: list[dict[str, Any]],
                      failed: list[tuple[ClaimedEvent, FailureOutcome, PublishError, dict[str, Any]]]) -> None:
        """One transition line per row a mark changed, from the rows the marks returned."""
        owner = self.claimed_by
        if log.isEnabledFor(logging.INFO):
            for outbox_id in published_ids:
                log.info(TRANSITION_EVENT, extra=transition_fields(
                    "published", "running", "published", owner=owner, source=event_source(by_id[outbox_id]),
                    published_at=published[outbox_id].isoformat()))
        for row in released:
            log.info(TRANSITION_EVENT, extra=transition_fields(
                "released", "running", "queued", owner=owner, source=event_source(by_id[row["id"]]),
                attempts_after_release=row["attempts"],  # the claim's attempt given back: nothing was tried
                reason="not attempted (the broker took nothing, an earlier event of its key failed, or the claimer "
                       "stopped)"))
        for event, decision, exc, mark in failed:
            error_type, error = error_summary(exc)
            if decision.status == "dead_letter":
                log.error(TRANSITION_EVENT, extra=transition_fields(
                    "dead_lettered", "running", "dead_letter", owner=owner, source=event_source(event),
                    error_class=decision.error_class, error_type=error_type, error=error))
            else:
                log.warning(TRANSITION_EVENT, extra=transition_fields(
                    "retry_scheduled", "running", "retryable", owner=owner, source=event_source(event),
                    next_retry_at=mark["next_retry_at"].isoformat(), retry_in_ms=decision.delay_ms,
                    error_class=decision.error_class, error_type=error_type, error=error))


@dataclass(frozen=True, slots=True)
class OwnClaim:
    """A writer's claim on its own just-written rows, read once the writing transaction committed."""

    cursor: AsyncCursor[dict[str, Any]]
    claimed_by: str = ""

    async def events(self) -> list[ClaimedEvent]:
        events = [ClaimedEvent(**row) for row in await self.cursor.fetchall()]
        log_claimed(events, self.claimed_by)
        return events


async def claim_own(conn: Conn, event_ids: Sequence[uuid.UUID], *, claimed_by: str, lease_seconds: float,
                    notify_rest: bool = True) -> OwnClaim:
    """Inside the transaction that wrote `event_ids` (after `enqueue_many`, before COMMIT): claim those rows for
    the writer itself to relay after its commit. A row stays queued for the pumps when an earlier unfinished row
    of its ordering key exists outside this batch; `notify_rest` then wakes the pumps for it at commit (the
    payload wakes their priority loop). Queues its statements only: in a pipeline this costs no round trip, and
    the rows are read from the returned claim after the commit."""
    if not conn.info.transaction_status:
        raise RuntimeError("outbox.claim_own must run inside the writing transaction")
    params = {"event_ids": list(event_ids), "claimed_by": claimed_by, "lease_seconds": lease_seconds}
    cursor = await conn.execute(q.CLAIM_OWN, params)
    if notify_rest:
        await conn.execute(q.NOTIFY_IF_UNCLAIMED, {"event_ids": list(event_ids), "channel": NOTIFY_CHANNEL,
                                                   "payload": PRIORITY_WAKE})
    return OwnClaim(cursor, claimed_by)
