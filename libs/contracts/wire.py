"""Events on the WebSocket and on `desktop.task.dispatch` (docs/architecture.md §13.2, §13.3), plus hello/heartbeat.

The hub forwards dispatch messages to the socket unchanged, so one set of Structs serves both.
"""

from __future__ import annotations

import uuid
from datetime import date, datetime
from typing import Annotated, Literal

import msgspec

from libs.contracts.common import (
    MAX_PLATFORM_HEALTH_ENTRIES,
    ExecutionPhase,
    Lane,
    NonNegativeInt,
    PlatformCode,
    PlatformHealthState,
    ShortText,
    TaskKind,
)
from libs.contracts.http import BrandRef, PlatformRef, QuestionRef

# The desktop protocol's version (docs/desktop-protocol.md, Versioning). Within a major every change is additive (a
# new field with a default, a new message type or control a client may ignore); MINOR counts those changes.
# A client names the majors it speaks as WebSocket subprotocols `monitor.desktop.v{major}`.
PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 3
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
SUBPROTOCOL_PREFIX = "monitor.desktop.v"
# The majors this hub serves; a newer major is refused at the upgrade, an older one is served while listed.
SUPPORTED_MAJORS: tuple[int, ...] = (1,)
# What each minor added (the AsyncAPI document marks each field with `x-since`).
FIELDS_SINCE: dict[str, dict[str, str]] = {
    "TaskAvailable": {"traceparent": "1.1", "lease_token": "1.3", "lease_epoch": "1.3", "lease_expires_at": "1.3",
                      "brand": "1.3", "question": "1.3", "platform": "1.3"},
    "TaskControl": {"traceparent": "1.1"},
    "Hello": {"protocol_version": "1.2", "capabilities": "1.3"},
}
# Optional behaviours a client asks for on its upgrade, comma-separated in this header or query parameter; the hub's
# hello lists the ones it granted (`capabilities`). `push_lease` (docs/desktop-protocol.md "Push-lease"):
# `task_available` may carry the lease itself (token, epoch, expiry and what the task runs), so the client starts
# without a lease call.
CAPABILITIES_HEADER = "X-Monitor-Capabilities"
# ... or in this query parameter of the upgrade URL (a browser-side WebSocket, e.g. an Electron renderer, cannot set
# headers).
CAPABILITIES_QUERY = "capabilities"
PUSH_LEASE = "push_lease"
KNOWN_CAPABILITIES: frozenset[str] = frozenset({PUSH_LEASE})


def requested_capabilities(values: list[str] | tuple[str, ...]) -> frozenset[str]:
    """The known capabilities a client's header values name (unknown ones are ignored: a newer client)."""
    return frozenset(part.strip() for value in values for part in value.split(",")) & KNOWN_CAPABILITIES


def subprotocol(major: int) -> str:
    return f"{SUBPROTOCOL_PREFIX}{major}"


class TaskAvailable(msgspec.Struct, tag="task_available", tag_field="type", kw_only=True):
    kind: TaskKind
    task_id: uuid.UUID
    target_client_id: uuid.UUID
    priority: int
    lane: Lane | Literal["urgent"]
    status: Literal["queued"] = "queued"
    scheduler_group_key: str | None = None
    business_date: date | None = None
    interrupt_generation: NonNegativeInt = 0
    updated_at: datetime
    # Additions (defaults keep old clients working).
    monitor_task_id: int | None = None
    collect_request_id: uuid.UUID | None = None
    # W3C trace context of the hub's delivery (set when tracing is on): a client sends it back as the
    # `traceparent` header of its lease/extend/cancel/result calls for this task.
    traceparent: str | None = None
    # Push-lease (since 1.3; only to a client whose hello granted `push_lease`): the execution is already leased to
    # it. Start at once and extend / post the result with `lease_token` as after a lease call; the lease lasts
    # until `lease_expires_at` unless extended. Absent: lease by pull. A replay re-sends the same lease.
    lease_token: str | None = None
    lease_epoch: int | None = None
    lease_expires_at: datetime | None = None
    brand: BrandRef | None = None
    question: QuestionRef | None = None
    platform: PlatformRef | None = None


ControlKind = Literal["interrupt_requested", "cancelled", "lease_revoked"]


class TaskControl(msgspec.Struct, tag="task_control", tag_field="type", kw_only=True):
    kind: TaskKind
    task_id: uuid.UUID
    target_client_id: uuid.UUID
    control: ControlKind
    reason: ShortText
    interrupt_generation: NonNegativeInt
    replacement_task_id: uuid.UUID | None = None
    updated_at: datetime
    collect_request_id: uuid.UUID | None = None
    traceparent: str | None = None  # as on TaskAvailable


class Hello(msgspec.Struct, tag="hello", tag_field="type", kw_only=True):
    client_id: uuid.UUID
    tenant_id: int
    hub_instance: str
    server_time: datetime
    heartbeat_interval_s: int
    interrupt_generation: int
    replayed_available: int = 0
    replayed_controls: int = 0
    # "MAJOR.MINOR" the hub speaks on this socket (docs/desktop-protocol.md, Versioning); a hello without it
    # came from a hub older than 1.2.
    protocol_version: str = "1.0"
    # The capabilities (CAPABILITIES_HEADER) the hub granted this socket (since 1.3).
    capabilities: list[str] = msgspec.field(default_factory=list)


class HeartbeatAck(msgspec.Struct, tag="heartbeat_ack", tag_field="type", kw_only=True):
    server_time: datetime


class ErrorEvent(msgspec.Struct, tag="error", tag_field="type", kw_only=True):
    error: str
    message: str
    field: str | None = None


ServerEvent = TaskAvailable | TaskControl | Hello | HeartbeatAck | ErrorEvent
DispatchMessage = TaskAvailable | TaskControl


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="type", kw_only=True, omit_defaults=True):
    """Client -> server. Keeps last_heartbeat_at fresh; may report local state."""

    sent_at: datetime | None = None
    # {"openai": "healthy", "gemini": "login_required"}: the client's whole current view, which replaces the
    # stored one (a platform left out is no longer reported). The hub also refuses codes it does not know.
    platform_health: Annotated[dict[PlatformCode, PlatformHealthState],
                               msgspec.Meta(max_length=MAX_PLATFORM_HEALTH_ENTRIES)] | None = None
    local_queue_depth: NonNegativeInt | None = None
    active_task_id: uuid.UUID | None = None
    execution_phase: ExecutionPhase | None = None


ClientMessage = Heartbeat

server_event_decoder: msgspec.json.Decoder[ServerEvent] = msgspec.json.Decoder(ServerEvent)
dispatch_decoder: msgspec.json.Decoder[DispatchMessage] = msgspec.json.Decoder(DispatchMessage)
client_message_decoder: msgspec.json.Decoder[Heartbeat] = msgspec.json.Decoder(Heartbeat)

# WebSocket close code of a hub that is draining (SIGTERM: a rolling restart, a scale-down): reconnect after the
# delay the close reason names (`draining; reconnect after <N> ms`, N drawn per socket so a hub's clients spread
# out instead of all arriving at the next hub at once), to any hub.
HUB_DRAINING_CLOSE = 4503
_DRAINING_REASON = "draining; reconnect after {} ms"


def draining_close_reason(delay_ms: int) -> str:
    """The close reason a draining hub sends with `HUB_DRAINING_CLOSE`."""
    return _DRAINING_REASON.format(max(0, int(delay_ms)))


def reconnect_delay_ms(reason: str) -> int | None:
    """The delay a `HUB_DRAINING_CLOSE` reason names, or None when it names none (reconnect with backoff)."""
    head, _, tail = reason.partition("reconnect after ")
    number, _, unit = tail.partition(" ")
    if not head.startswith("draining") or unit != "ms" or not number.isdigit():
        return None
    return int(number)
