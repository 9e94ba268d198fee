"""The hub's side of dispatch batches: a `dispatch_batch` envelope (libs/outbox/dispatch_batches.py) unwrapped into
the dispatch events it carries, each handed to the per-event path as if it had come in a message of its own.

Decisions (docs/architecture.md, "Dispatch batches"):
- An envelope that cannot be read at all (not JSON, not a `dispatch_batch`, a version this hub does not know) is
  copied to the hub's DLQ with the reason and none of it is delivered (there is nothing to deliver it by).
- An item that cannot be read (no key, an unknown type, ...) is dropped with a log line and
  `hub_dispatch_events_malformed_total`; every other item of the envelope is delivered, first; then the envelope
  is copied to the DLQ once, its reason naming the refused items, so nothing refused leaves no trace.
- The hub consumes without acks (its queue's events are a shortcut: the database's replay is the truth), so a
  dropped or dead-lettered event is never lost to its client: its task reaches it in the replay on reconnect.
- Old single-event messages keep coming the old way (a relay of before this change, or one event for the hub):
  the consumer tells them apart by the AMQP type, `dispatch_batch` or not.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from aio_pika.abc import AbstractIncomingMessage

from libs.contracts.amqp import (
    DISPATCH_BATCH,
    DISPATCH_BATCH_VERSION,
    dispatch_batch_decoder,
    dispatch_batch_item_decoder,
)
from libs.telemetry import metrics

log = logging.getLogger("hub.envelope")


@dataclass(frozen=True, slots=True)
class DispatchEvent:
    """One dispatch event as the hub forwards it: from a message of its own or from an envelope's item."""

    routing_key: str
    body: bytes
    message_id: str | None = None
    message_type: str | None = None
    headers: Mapping[str, Any] | None = None  # the publisher's trace context (`traceparent`)

    @classmethod
    def of_message(cls, message: AbstractIncomingMessage) -> DispatchEvent:
        return cls(message.routing_key or "", message.body, message.message_id, message.type, message.headers)


class MalformedEnvelope(ValueError):
    """The envelope as a whole cannot be read: nothing in it can be delivered."""


@dataclass(frozen=True, slots=True)
class Unwrapped:
    events: list[DispatchEvent]
    refused: list[tuple[int, str]]  # (item index, why) of the items that could not be read


def unwrap(body: bytes) -> Unwrapped:
    """The events of a `dispatch_batch` body, in order, and the items refused. Raises MalformedEnvelope."""
    try:
        frame = dispatch_batch_decoder.decode(body)
    except msgspec.MsgspecError as exc:
        raise MalformedEnvelope(f"not a dispatch_batch: {exc}") from exc
    if frame.v != DISPATCH_BATCH_VERSION:
        raise MalformedEnvelope(f"dispatch_batch version {frame.v} is unknown here (this hub reads "
                                f"{DISPATCH_BATCH_VERSION})")
    events: list[DispatchEvent] = []
    refused: list[tuple[int, str]] = []
    for index, raw in enumerate(frame.events):
        try:
            item = dispatch_batch_item_decoder.decode(raw)
        except msgspec.MsgspecError as exc:
            refused.append((index, str(exc)))
            continue
        headers = {"traceparent": item.traceparent} if item.traceparent else None
        events.append(DispatchEvent(item.key, bytes(item.event), item.message_id, item.message_type, headers))
    return Unwrapped(events, refused)


def is_envelope(message: AbstractIncomingMessage) -> bool:
    return message.type == DISPATCH_BATCH


def refused_reason(refused: list[tuple[int, str]], total: int) -> str:
    """The DLQ reason of an envelope with unreadable items (bounded: the first few are named)."""
    named = "; ".join(f"item {index}: {why[:120]}" for index, why in refused[:5])
    return f"malformed_items: {len(refused)} of {total} not delivered ({named})"


async def consume_envelope(message: AbstractIncomingMessage, deliver: Callable[[DispatchEvent], None],
                           dead_letter: Callable[[AbstractIncomingMessage, str], Awaitable[None]]) -> int:
    """Unwrap `message` and `deliver` each of its events; dead-letter what cannot be read. How many delivered."""
    metrics.hub_dispatch_batches_received_total.inc()
    try:
        unwrapped = unwrap(message.body)
    except MalformedEnvelope as exc:
        log.error("malformed dispatch batch; dead-lettered", extra={"message_id": message.message_id,
                                                                    "reason": str(exc)[:300]})
        await _dead_letter(dead_letter, message, f"malformed: {exc}", "malformed")
        return 0
    for event in unwrapped.events:
        deliver(event)
    if unwrapped.refused:
        total = len(unwrapped.events) + len(unwrapped.refused)
        metrics.hub_dispatch_events_malformed_total.inc(len(unwrapped.refused))
        reason = refused_reason(unwrapped.refused, total)
        log.warning("dispatch batch items not delivered; the batch is dead-lettered",
                    extra={"message_id": message.message_id, "reason": reason[:300]})
        await _dead_letter(dead_letter, message, reason, "malformed_items")
    return len(unwrapped.events)


async def _dead_letter(dead_letter: Callable[[AbstractIncomingMessage, str], Awaitable[None]],
                       message: AbstractIncomingMessage, reason: str, kind: str) -> None:
    try:
        await dead_letter(message, reason)
    except Exception:  # no acks to give back on this queue: logged, and the clients' replays carry the tasks
        log.exception("could not dead-letter a dispatch batch", extra={"message_id": message.message_id})
        return
    metrics.hub_dispatch_batches_dead_lettered_total.inc(reason=kind)
