"""The desktop protocol 1.0 as a client built against it sees it: the WebSocket messages as they were first
shipped (commit d55041e), frozen. Never edit these: they are what an old client compiled, and the compatibility
tests decode today's hub output with them (unknown fields ignored, as msgspec does by default) and send today's hub
their heartbeat. Open enumerations (`control`, `error`) are plain strings, as docs/desktop-protocol.md tells
clients to treat them."""

from __future__ import annotations

import uuid
from datetime import date, datetime
from typing import Literal

import msgspec

Lane = Literal["high", "normal", "normal_boosted", "retry"]
TaskKind = Literal["monitor", "publish"]
ExecutionPhase = Literal[
    "PREPARING", "NAVIGATING", "AUTHENTICATING", "INPUTTING", "SUBMITTING", "WAITING", "PARSING", "POSTING"
]


class TaskAvailable(msgspec.Struct, tag="task_available", tag_field="type", kw_only=True):
    kind: TaskKind
    task_id: uuid.UUID
    target_client_id: uuid.UUID
    priority: int
    lane: Lane | Literal["urgent"]
    status: Literal["queued"] = "queued"
    scheduler_group_key: str | None = None
    business_date: date | None = None
    interrupt_generation: int = 0
    updated_at: datetime
    monitor_task_id: int | None = None
    collect_request_id: uuid.UUID | None = None


class TaskControl(msgspec.Struct, tag="task_control", tag_field="type", kw_only=True):
    kind: TaskKind
    task_id: uuid.UUID
    target_client_id: uuid.UUID
    control: str
    reason: str
    interrupt_generation: int
    replacement_task_id: uuid.UUID | None = None
    updated_at: datetime
    collect_request_id: uuid.UUID | None = None


class Hello(msgspec.Struct, tag="hello", tag_field="type", kw_only=True):
    client_id: uuid.UUID
    tenant_id: int
    hub_instance: str
    server_time: datetime
    heartbeat_interval_s: int
    interrupt_generation: int
    replayed_available: int = 0
    replayed_controls: int = 0


class HeartbeatAck(msgspec.Struct, tag="heartbeat_ack", tag_field="type", kw_only=True):
    server_time: datetime


class ErrorEvent(msgspec.Struct, tag="error", tag_field="type", kw_only=True):
    error: str
    message: str
    field: str | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="type", kw_only=True, omit_defaults=True):
    sent_at: datetime | None = None
    platform_health: dict[str, str] | None = None
    local_queue_depth: int | None = None
    active_task_id: uuid.UUID | None = None
    execution_phase: ExecutionPhase | None = None


ServerEvent = TaskAvailable | TaskControl | Hello | HeartbeatAck | ErrorEvent
SERVER_MESSAGES: tuple[type[msgspec.Struct], ...] = (TaskAvailable, TaskControl, Hello, HeartbeatAck, ErrorEvent)
CLIENT_MESSAGES: tuple[type[msgspec.Struct], ...] = (Heartbeat,)
# strict: no "2" for 2; unknown fields are ignored all the same (forbid_unknown_fields is off on these Structs).
server_event_decoder: msgspec.json.Decoder[ServerEvent] = msgspec.json.Decoder(ServerEvent, strict=True)
