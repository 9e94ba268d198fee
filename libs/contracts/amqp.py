"""Messages on `monitor.result`, `monitor.projection` and `monitor.lifecycle`.

Our own services publish them, but some of their text came from a client (a result's answer and error, a
cancel's reason): it carries the same constraints as at the HTTP edge, which refuses it first. A message that
breaks them anyway fails to decode and is dead-lettered with its reason by its consumer, instead of failing the
database statement it would have been written by (a NUL in `text`), again at every redelivery.
"""

from __future__ import annotations

import uuid
from datetime import date, datetime
from typing import Annotated, Literal

import msgspec

from libs.contracts.common import SINGLE_LINE, AnswerText, ErrorText, ShortText
from libs.contracts.http import Citation
from libs.contracts.wire import TaskAvailable, TaskControl

# A task's collector_type, run_mode and lane: varchar(20) columns.
ColumnCode = Annotated[str, msgspec.Meta(min_length=1, max_length=20, pattern=SINGLE_LINE)]


class MonitorResult(msgspec.Struct, tag="monitor_result", tag_field="type", kw_only=True):
    """A desktop result callback, accepted by the hub and routed to `shard.{k}`."""

    result_id: uuid.UUID
    task_id: uuid.UUID
    monitor_task_id: int
    lease_epoch: int
    tenant_id: int
    workspace_id: int
    brand_id: int
    question_id: int
    ai_platform_id: int
    collector_type: ColumnCode
    run_mode: ColumnCode
    business_date: date
    client_id: uuid.UUID
    status: Literal["succeeded", "failed"]
    answer_text: AnswerText | None = None
    citations: Annotated[list[Citation], msgspec.Meta(max_length=200)] = []
    brand_mentioned: bool = False
    error: ErrorText | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    received_at: datetime
    collect_request_id: uuid.UUID | None = None
    shard: int = 0
    # The routing epoch the hub routed it by (libs/ingest/routing.py): with `shard`, which queue it belongs on.
    routing_epoch: int = 0


class ProjectionRebuild(msgspec.Struct, tag="projection_rebuild", tag_field="type", kw_only=True):
    tenant_id: int
    brand_id: int
    business_date: date
    requested_at: datetime


LifecycleKind = Literal[
    "task.leased", "task.completed", "task.failed", "task.aborted", "task.released",
    "client.online", "client.offline", "collect_now.accepted",
    # Operator actions on a client (monitorctl client disable | enable | rotate-token), for the audit trail.
    "client.disabled", "client.enabled", "client.token_rotated",
]


class LifecycleEvent(msgspec.Struct, tag="lifecycle", tag_field="type", kw_only=True, omit_defaults=True):
    event: LifecycleKind
    tenant_id: int
    occurred_at: datetime
    client_id: uuid.UUID | None = None
    task_id: uuid.UUID | None = None
    monitor_task_id: int | None = None
    ai_platform_id: int | None = None
    lane: ColumnCode | None = None
    reason: ShortText | None = None
    collect_request_id: uuid.UUID | None = None


# ---- dispatch batch: many clients' dispatch events towards one hub, in one broker message -------------------
DISPATCH_BATCH = "dispatch_batch"
# The envelope's layout version: a hub refuses (dead-letters) a version it does not know. Fields added with
# defaults keep the version; a layout an older hub would misread gets the next one.
DISPATCH_BATCH_VERSION = 1


class DispatchBatchItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One dispatch event inside a `dispatch_batch`: what its own broker message would have carried."""

    key: str  # its routing key as routed (`hub.<hub>.monitor.<lane>.<client>`, `hub.<hub>.publish.<client>`)
    message_id: str  # the outbox row's event_id
    message_type: Literal["task_available", "task_control"]
    # The event's payload byte for byte as its outbox row holds it (the hub forwards it to the socket unchanged).
    event: msgspec.Raw
    traceparent: str | None = None
    outbox_id: int | None = None


class DispatchBatch(msgspec.Struct, tag=DISPATCH_BATCH, tag_field="type", kw_only=True):
    """Dispatch events of many clients of one hub, published by the outbox relay as one message
    (`desktop.task.dispatch` / `hub.<hub>.batch`, AMQP type `dispatch_batch`): a burst costs the hub one broker
    delivery per relay batch instead of one per event (docs/architecture.md, "Dispatch batches")."""

    v: int = DISPATCH_BATCH_VERSION
    events: list[DispatchBatchItem]


class DispatchBatchFrame(msgspec.Struct, tag=DISPATCH_BATCH, tag_field="type", kw_only=True):
    """How a hub first reads a `dispatch_batch`: the version, and each item still undecoded, so that one malformed
    item is refused alone (`DispatchBatchItem` decoded item by item) and never takes the others with it."""

    v: int
    events: list[msgspec.Raw]


AnyMessage = TaskAvailable | TaskControl | MonitorResult | ProjectionRebuild | LifecycleEvent

result_decoder: msgspec.json.Decoder[MonitorResult] = msgspec.json.Decoder(MonitorResult)
projection_decoder: msgspec.json.Decoder[ProjectionRebuild] = msgspec.json.Decoder(ProjectionRebuild)
lifecycle_decoder: msgspec.json.Decoder[LifecycleEvent] = msgspec.json.Decoder(LifecycleEvent)
any_message_decoder: msgspec.json.Decoder[AnyMessage] = msgspec.json.Decoder(AnyMessage)
dispatch_batch_decoder: msgspec.json.Decoder[DispatchBatchFrame] = msgspec.json.Decoder(DispatchBatchFrame)
dispatch_batch_item_decoder: msgspec.json.Decoder[DispatchBatchItem] = msgspec.json.Decoder(DispatchBatchItem)


def message_type(message: msgspec.Struct) -> str:
    """The wire tag (`type`) of a message Struct."""
    tag = type(message).__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{type(message).__name__} has no string tag")
    return tag


MESSAGE_TYPES: dict[str, type[msgspec.Struct]] = {
    "task_available": TaskAvailable,
    "task_control": TaskControl,
    "monitor_result": MonitorResult,
    "projection_rebuild": ProjectionRebuild,
    "lifecycle": LifecycleEvent,
}
# What the outbox relay may publish: the rows' types, and the envelope it makes itself from dispatch rows (never
# an outbox row of its own: writers enqueue the events, the relay packs them).
PUBLISHED_MESSAGE_TYPES: dict[str, type[msgspec.Struct]] = {**MESSAGE_TYPES, DISPATCH_BATCH: DispatchBatch}
