"""Dispatch batches: the outbox relay's dispatch events towards one hub, packed into `dispatch_batch` envelopes.

Why: a hub's CPU per dispatch event was mostly the AMQP delivery itself (aiormq/pamqp and aio-pika's message
object and task, pure Python), so a burst of one event to each of 10,000 sockets could not reach them in a second
(docs/benchmarks.md, "Fan-out"). One broker message per hub per relay batch, carrying each event's payload byte for
byte, makes that cost per batch instead of per event. What the hub does with each event is unchanged
(services/dispatch_hub/envelope.py unwraps; the per-event path forwards).

Which events are packed (`plan`): the chains (ordering keys) whose every event is a dispatch event routed to one
and the same hub (`hub.<hub>.<key>`), with a valid payload. Anything else (a chain that mixes hubs or exchanges,
an event whose client has no hub yet, an invalid payload that must dead-letter on its own) is published one event
per message, as before. A hub with a single packable event gets it as a single message too: an envelope of one
saves nothing, and a click's one `task_available` keeps its path.

Bounds: an envelope holds at most MAX_EVENTS events and MAX_BYTES of body; above, the hub's events are split over
several envelopes, published one after another (in order: a chain's events keep their order across envelopes,
and the first failure stops the rest, as a chain's would).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from libs.contracts.amqp import DispatchBatch, DispatchBatchItem
from libs.mq.hub_routing import HUB_KEY_PREFIX

# An envelope's bounds. The pump's batch (200 rows) is below the count; a burst of task_available (~450 bytes
# each) reaches the bytes at ~550 events: a broker message of a quarter MiB stays cheap to route and to hold.
MAX_EVENTS = 1000
MAX_BYTES = 256 * 1024
# The JSON around one item's payload (key, ids, type, traceparent): counted towards MAX_BYTES before encoding.
_ITEM_OVERHEAD = 256
BATCHABLE_TYPES = frozenset({"task_available", "task_control"})
BATCH_KEY_TAIL = "batch"


class BatchableEvent(Protocol):
    """What packing reads of a claimed outbox row (libs/outbox/relay.py `ClaimedEvent`)."""

    @property
    def id(self) -> int: ...
    @property
    def event_id(self) -> Any: ...
    @property
    def exchange(self) -> str: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def message_type(self) -> str: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def traceparent(self) -> str | None: ...


E = TypeVar("E", bound=BatchableEvent)


def hub_of(routing_key: str) -> str | None:
    """`hub.<word>.monitor.high.<client>` -> `<word>`; None for a key not routed to a hub."""
    prefix, _, rest = routing_key.partition(".")
    if prefix != HUB_KEY_PREFIX:
        return None
    word, dot, tail = rest.partition(".")
    return word if dot and word and tail else None


def batch_routing_key(hub_word: str) -> str:
    """The routing key of a hub's envelopes (inside its binding `hub.<word>.#`; no client in it)."""
    return f"{HUB_KEY_PREFIX}.{hub_word}.{BATCH_KEY_TAIL}"


@dataclass(frozen=True, slots=True)
class Envelope:
    """One `dispatch_batch` message: its routing key, body, and the events it carries (in publish order)."""

    routing_key: str
    body: bytes
    event_ids: tuple[int, ...]
    message_id: str


def _item(event: BatchableEvent) -> DispatchBatchItem:
    return DispatchBatchItem(key=event.routing_key, message_id=str(event.event_id),
                             message_type=event.message_type,  # type: ignore[arg-type]  # checked by the caller
                             event=msgspec.Raw(event.payload), traceparent=event.traceparent, outbox_id=event.id)


def pack(hub_word: str, events: Sequence[BatchableEvent], *, max_events: int = MAX_EVENTS,
         max_bytes: int = MAX_BYTES) -> list[Envelope]:
    """`events` (all routed to `hub_word`, in publish order) as envelopes within the bounds; an event larger than
    `max_bytes` on its own still goes, alone in its envelope."""
    envelopes: list[Envelope] = []
    current: list[BatchableEvent] = []
    size = 0

    def close() -> None:
        body = msgspec.json.encode(DispatchBatch(events=[_item(e) for e in current]))
        envelopes.append(Envelope(batch_routing_key(hub_word), body, tuple(e.id for e in current),
                                  str(uuid.uuid4())))

    for event in events:
        weight = len(event.payload) + len(event.routing_key) + _ITEM_OVERHEAD
        if current and (len(current) >= max_events or size + weight > max_bytes):
            close()
            current, size = [], 0
        current.append(event)
        size += weight
    if current:
        close()
    return envelopes


@dataclass(frozen=True, slots=True)
class Plan(Generic[E]):
    """A relay batch split into what goes in envelopes (per hub word, in publish order) and what goes alone."""

    by_hub: dict[str, list[E]]
    single: list[list[E]]


def plan(runs: Sequence[Sequence[E]], *, dispatch_exchange: str, valid: Callable[[E], bool]) -> Plan[E]:
    """Which chains (`runs`, each one ordering key's events in order, already routed) go in a hub's envelopes:
    those whose every event is a dispatch event of a batchable type routed to one hub and `valid`. A hub left with
    one packable event gets it alone (an envelope of one saves nothing)."""
    by_hub: dict[str, list[E]] = {}
    single: list[list[E]] = []
    for run in runs:
        hubs = {hub_of(e.routing_key) if e.exchange == dispatch_exchange and e.message_type in BATCHABLE_TYPES
                else None for e in run}
        hub = next(iter(hubs)) if len(hubs) == 1 else None
        if hub is None or not all(valid(e) for e in run):
            single.append(list(run))
        else:
            by_hub.setdefault(hub, []).extend(run)
    for hub, events in list(by_hub.items()):
        if len(events) == 1:
            single.append(events)
            del by_hub[hub]
    return Plan(by_hub, single)
