"""Dispatch batches without I/O: which events the relay packs per hub (libs/outbox/dispatch_batches.py), the
envelope's bounds and split, and the hub's unwrap (services/dispatch_hub/envelope.py) of good and malformed
envelopes, one bad item never taking the others with it."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from libs.contracts.amqp import (
    DISPATCH_BATCH,
    PUBLISHED_MESSAGE_TYPES,
    DispatchBatch,
    dispatch_batch_decoder,
)
from libs.contracts.wire import TaskAvailable
from libs.mq.hub_routing import hub_routing_key
from libs.mq.topology import DISPATCH, LIFECYCLE
from libs.outbox import dispatch_batches as batches
from libs.outbox.relay import ClaimedEvent, OutboxRelay, PublishError, envelope_event, validate_payload
from libs.telemetry import metrics
from services.dispatch_hub import envelope as hub_envelope


def _task_available(client: uuid.UUID) -> bytes:
    return msgspec.json.encode(TaskAvailable(kind="monitor", task_id=uuid.uuid4(), target_client_id=client,
                                             priority=100, lane="normal", updated_at=datetime.now(UTC)))


def _event(n: int, *, hub: str | None = "pod-a", client: uuid.UUID | None = None, exchange: str = DISPATCH,
           message_type: str = "task_available", payload: bytes | None = None,
           traceparent: str | None = None) -> ClaimedEvent:
    client = client or uuid.uuid4()
    key = f"monitor.normal.{client}"
    return ClaimedEvent(id=n, event_id=uuid.uuid4(), exchange=exchange,
                        routing_key=hub_routing_key(hub, key) if hub else key, message_type=message_type,
                        payload=payload if payload is not None else _task_available(client), headers={},
                        ordering_key=f"client:{client}", tenant_id=1, traceparent=traceparent, attempts=1,
                        max_attempts=10, created_at=datetime.now(UTC))


def _valid(event: ClaimedEvent) -> bool:
    try:
        validate_payload(event)
    except Exception:
        return False
    return True


def test_hub_of_a_routed_key() -> None:
    assert batches.hub_of(hub_routing_key("pod-a.1", "monitor.high.x")) == "pod-a_1"
    assert batches.hub_of("monitor.high.x") is None
    assert batches.hub_of("hub.pod") is None and batches.hub_of("hub..x") is None
    assert batches.batch_routing_key("pod-a") == "hub.pod-a.batch"


def test_plan_packs_chains_of_one_hub_and_leaves_the_rest_alone() -> None:
    a1, a2, a3 = _event(1), _event(2), _event(3)
    b1 = _event(4, hub="pod-b")  # the only event for pod-b: alone (an envelope of one saves nothing)
    unrouted = _event(5, hub=None)  # no presence yet: its original key, which no hub binds
    lifecycle = _event(6, exchange=LIFECYCLE)
    invalid = _event(7, payload=b'{"type": "task_available"}')  # dead-letters alone in the outbox
    mixed = [_event(8), _event(9, hub="pod-b")]  # one chain over two hubs: published as a chain, in order
    plan = batches.plan([[a1, a2], [a3], [b1], [unrouted], [lifecycle], [invalid], mixed],
                        dispatch_exchange=DISPATCH, valid=_valid)
    assert {hub: [e.id for e in events] for hub, events in plan.by_hub.items()} == {"pod-a": [1, 2, 3]}
    assert sorted([e.id for e in run] for run in plan.single) == [[4], [5], [6], [7], [8, 9]]


def test_pack_keeps_order_and_payloads_byte_for_byte() -> None:
    events = [_event(n, traceparent=f"00-{'a' * 32}-{n:016x}-01") for n in range(1, 6)]
    [envelope] = batches.pack("pod-a", events)
    assert envelope.routing_key == "hub.pod-a.batch" and envelope.event_ids == (1, 2, 3, 4, 5)
    decoded = msgspec.json.decode(envelope.body, type=DispatchBatch)
    assert decoded.v == 1
    assert [bytes(i.event) for i in decoded.events] == [e.payload for e in events]
    assert [i.key for i in decoded.events] == [e.routing_key for e in events]
    assert [i.outbox_id for i in decoded.events] == [1, 2, 3, 4, 5]
    assert [i.traceparent for i in decoded.events] == [e.traceparent for e in events]


def test_pack_splits_above_the_count_and_the_bytes() -> None:
    events = [_event(n) for n in range(1, 11)]
    by_count = batches.pack("pod-a", events, max_events=4)
    assert [e.event_ids for e in by_count] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10)]
    weight = len(events[0].payload) + len(events[0].routing_key) + 256
    by_bytes = batches.pack("pod-a", events, max_bytes=weight * 3 + 10)
    assert [len(e.event_ids) for e in by_bytes] == [3, 3, 3, 1]
    assert all(len(e.body) <= weight * 3 + 10 for e in by_bytes)
    # One event above the bytes on its own still goes, alone.
    assert [e.event_ids for e in batches.pack("pod-a", events[:2], max_bytes=10)] == [(1,), (2,)]
    # Every split envelope is its own message (its own id).
    assert len({e.message_id for e in by_count}) == 3


def test_the_envelope_the_relay_publishes_passes_its_own_payload_check() -> None:
    events = [_event(n) for n in range(1, 4)]
    [envelope] = batches.pack("pod-a", events)
    message = envelope_event(envelope, events)
    assert (message.exchange, message.message_type, message.routing_key) == (DISPATCH, DISPATCH_BATCH,
                                                                             "hub.pod-a.batch")
    validate_payload(message)  # the allow-list knows the envelope (not an outbox row type)
    assert DISPATCH_BATCH in PUBLISHED_MESSAGE_TYPES


def test_unwrap_gives_each_event_as_a_message_of_its_own_would() -> None:
    events = [_event(n, traceparent="00-" + "b" * 32 + "-" + "c" * 16 + "-01" if n == 2 else None)
              for n in range(1, 4)]
    [envelope] = batches.pack("pod-a", events)
    unwrapped = hub_envelope.unwrap(envelope.body)
    assert unwrapped.refused == []
    assert [(e.routing_key, e.body, e.message_id, e.message_type) for e in unwrapped.events] == [
        (e.routing_key, e.payload, str(e.event_id), "task_available") for e in events]
    assert [e.headers for e in unwrapped.events] == [None, {"traceparent": events[1].traceparent}, None]


@pytest.mark.parametrize("body", [b"not json", b'{"type": "task_available"}', b'{"type": "dispatch_batch"}',
                                  b'{"type": "dispatch_batch", "v": 2, "events": []}',
                                  b'{"type": "dispatch_batch", "v": 1, "events": {}}'])
def test_unwrap_refuses_an_unreadable_envelope(body: bytes) -> None:
    with pytest.raises(hub_envelope.MalformedEnvelope):
        hub_envelope.unwrap(body)


def _with_bad_item(good: list[ClaimedEvent]) -> bytes:
    [envelope] = batches.pack("pod-a", good)
    frame = dispatch_batch_decoder.decode(envelope.body)
    items = [msgspec.json.decode(bytes(r)) for r in frame.events]
    items.insert(1, {"key": "hub.pod-a.x", "message_id": "m", "message_type": "lifecycle", "event": {}})
    return msgspec.json.encode({"type": DISPATCH_BATCH, "v": 1, "events": items})


def test_one_bad_item_is_refused_alone() -> None:
    good = [_event(n) for n in range(1, 4)]
    unwrapped = hub_envelope.unwrap(_with_bad_item(good))
    assert [e.body for e in unwrapped.events] == [e.payload for e in good]
    assert [index for index, _ in unwrapped.refused] == [1]
    assert "message_type" in unwrapped.refused[0][1]


@dataclass
class _Message:
    body: bytes
    type: str = DISPATCH_BATCH
    message_id: str = "env-1"
    routing_key: str = "hub.pod-a.batch"
    headers: dict[str, Any] = field(default_factory=dict)


async def test_consume_delivers_the_good_items_then_dead_letters_the_envelope_with_a_reason() -> None:
    good = [_event(n) for n in range(1, 4)]
    delivered: list[hub_envelope.DispatchEvent] = []
    dead: list[str] = []

    async def dead_letter(_: Any, reason: str) -> None:
        assert len(delivered) == 3, "the good items go first"
        dead.append(reason)

    malformed0 = metrics.hub_dispatch_events_malformed_total.value()
    count = await hub_envelope.consume_envelope(_Message(_with_bad_item(good)),  # type: ignore[arg-type]
                                                delivered.append, dead_letter)
    assert count == 3 and [e.body for e in delivered] == [e.payload for e in good]
    assert len(dead) == 1 and dead[0].startswith("malformed_items: 1 of 4 not delivered (item 1:")
    assert metrics.hub_dispatch_events_malformed_total.value() == malformed0 + 1

    # An unreadable envelope: nothing delivered, dead-lettered as a whole.
    delivered.clear()
    assert await hub_envelope.consume_envelope(_Message(b'{"type": "dispatch_batch", "v": 9, "events": []}'),  # type: ignore[arg-type]
                                               delivered.append, lambda _, r: _append(dead, r)) == 0
    assert delivered == [] and dead[-1].startswith("malformed: dispatch_batch version 9")

    # A DLQ that is away costs the delivered items nothing (logged; the replay carries the tasks).
    async def away(*_: Any) -> None:
        raise ConnectionError("broker gone")

    delivered.clear()
    assert await hub_envelope.consume_envelope(_Message(_with_bad_item(good)), delivered.append,  # type: ignore[arg-type]
                                               away) == 3


async def _append(into: list[str], reason: str) -> None:
    await asyncio.sleep(0)
    into.append(reason)


class _Publisher:
    """Takes envelopes until `fail_at` (0-based), which fails with `error`; records what it was given."""

    def __init__(self, fail_at: int, error: Exception) -> None:
        self.fail_at, self.error = fail_at, error
        self.published: list[ClaimedEvent] = []

    def ready(self) -> bool:
        return True

    async def wait_ready(self, timeout: float) -> bool:
        return True

    async def publish(self, event: ClaimedEvent) -> None:
        if len(self.published) == self.fail_at:
            raise self.error
        self.published.append(event)


@pytest.mark.parametrize(("error", "failed_as"), [
    (PublishError("transient", "nacked"), "failed"),
    (PublishError("transient", "no confirm", broker_unavailable=True), "unattempted")])
async def test_an_envelope_that_fails_is_each_of_its_events_failure_and_stops_the_hubs_rest(
        error: PublishError, failed_as: str) -> None:
    publisher = _Publisher(fail_at=1, error=error)
    relay = OutboxRelay(None, publisher, claimed_by="test")  # type: ignore[arg-type]  # no database touched here
    client = uuid.uuid4()
    n = 2 * batches.MAX_EVENTS + 1
    events = [_event(i, client=client, payload=b"{}") for i in range(1, n + 1)]
    first, second, *rest = [len(e.event_ids) for e in batches.pack("pod-a", events)]
    assert rest, "three envelopes at least"
    outcomes: dict[int, tuple[str, Any]] = {}
    await relay._publish_envelopes("pod-a", events, outcomes)  # type: ignore[arg-type]
    assert [p.message_type for p in publisher.published] == [DISPATCH_BATCH]
    expected = {i: "published" if i <= first else failed_as if i <= first + second else "unattempted"
                for i in range(1, n + 1)}
    assert {i: o for i, (o, _) in outcomes.items()} == expected
