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


AnyMessage = TaskAvailable | TaskControl | MonitorResult | ProjectionRebuild | LifecycleEvent

result_decoder: msgspec.json.Decoder[MonitorResult] = msgspec.json.Decoder(MonitorResult)
projection_decoder: msgspec.json.Decoder[ProjectionRebuild] = msgspec.json.Decoder(ProjectionRebuild)
lifecycle_decoder: msgspec.json.Decoder[LifecycleEvent] = msgspec.json.Decoder(LifecycleEvent)
any_message_decoder: msgspec.json.Decoder[AnyMessage] = msgspec.json.Decoder(AnyMessage)


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
