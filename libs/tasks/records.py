"""The values the `Executions` operations answer (libs/tasks/execution_paths.py), the same on either execution path:
msgspec Structs read from the statements' rows (`msgspec.convert`, unknown columns ignored)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Literal, TypeVar

import msgspec

from libs.tasks.statuses import ClientCancelReason, EndReason

ExecutionOwner = Literal["desktop_tasks", "legacy"]

S = TypeVar("S", bound=msgspec.Struct)


def from_row(row: dict[str, Any], kind: type[S]) -> S:
    return msgspec.convert(row, kind)


def from_rows(rows: list[dict[str, Any]], kind: type[S]) -> list[S]:
    return [msgspec.convert(row, kind) for row in rows]


class Offer(msgspec.Struct, frozen=True):
    """Work queued for a client that its lease call may take: a queued execution, or an offer not pulled yet."""

    id: uuid.UUID
    monitor_task_id: int
    lane: str
    lane_weight: int
    priority: int
    lease_epoch: int
    interrupt_generation: int
    business_date: date
    tenant_id: int
    ai_platform_id: int
    collect_request_id: uuid.UUID | None
    control_flags: dict[str, Any] | None
    enqueued_at: datetime
    brand_id: int
    brand_name: str
    question_id: int
    question_text: str
    platform_code: str
    platform_mode: str | None
    execution_owner: ExecutionOwner


class Leased(msgspec.Struct, frozen=True, tag=True):
    lease_expires_at: datetime


class Extended(msgspec.Struct, frozen=True, tag=True):
    lease_expires_at: datetime
    interrupt_generation: int
    control_flags: dict[str, Any] | None
    ai_platform_id: int | None
    execution_owner: ExecutionOwner


class LeaseState(msgspec.Struct, frozen=True, tag=True):
    """A lease as the hub fences it (desktop_tasks' column names on either path)."""

    id: uuid.UUID
    target_client_id: uuid.UUID
    status: str
    lease_epoch: int
    lease_token_hash: str | None
    interrupt_generation: int
    control_flags: dict[str, Any] | None
    monitor_task_id: int | None  # None: a `publish` execution (another system's)
    tenant_id: int
    workspace_id: int | None
    ai_platform_id: int | None
    lane: str
    kind: str
    collect_request_id: uuid.UUID | None
    brand_id: int | None
    question_id: int | None
    business_date: date | None
    interrupt_reason: str | None
    result_digest: str | None
    result_received_at: datetime | None
    execution_phase: str | None
    execution_owner: ExecutionOwner


class ResultClaim(msgspec.Struct, frozen=True, tag=True):
    """The lease's result claimed: `previous` is the digest an earlier post stored (None: this post is the first)."""

    previous: str | None
    received: bool


class Done(msgspec.Struct, frozen=True, tag=True):
    """The move took."""

    task_id: uuid.UUID


class ScheduledWork(msgspec.Struct, frozen=True):
    """A client's scheduled work a click cancelled (queued) or asked to yield (running)."""

    id: uuid.UUID
    monitor_task_id: int
    ai_platform_id: int | None
    lane: str


class Preempted(msgspec.Struct, frozen=True):
    cancelled: list[ScheduledWork]
    interrupted: list[ScheduledWork]


class ReleasedWork(msgspec.Struct, frozen=True):
    """Queued work released (a broken login at the hub)."""

    id: uuid.UUID
    monitor_task_id: int
    tenant_id: int
    target_client_id: uuid.UUID
    ai_platform_id: int
    lane: str
    interrupt_generation: int
    collect_request_id: uuid.UUID | None


class ExpiringLease(msgspec.Struct, frozen=True):
    """A lease past its expiry without a result, locked (the reconciler's expired_leases)."""

    id: uuid.UUID
    tenant_id: int
    monitor_task_id: int
    target_client_id: uuid.UUID
    lease_epoch: int
    interrupted_at: datetime | None
    interrupt_generation: int
    collect_request_id: uuid.UUID | None
    lane: str
    ai_platform_id: int | None
    execution_phase: str | None


class QueuedWork(msgspec.Struct, frozen=True):
    """Queued work (an execution not leased, an offer not pulled), locked."""

    id: uuid.UUID
    tenant_id: int
    monitor_task_id: int
    target_client_id: uuid.UUID
    lane: str
    ai_platform_id: int | None
    collect_request_id: uuid.UUID | None


class OverdueInterrupt(msgspec.Struct, frozen=True):
    """Running work asked to yield that is past its hard timeout, locked."""

    id: uuid.UUID
    tenant_id: int
    workspace_id: int
    monitor_task_id: int
    target_client_id: uuid.UUID
    lease_epoch: int
    lane: str
    ai_platform_id: int | None
    interrupt_generation: int
    interrupted_at: datetime
    execution_phase: str | None
    control_flags: dict[str, Any] | None
    hard_timeout_ms: float
    overdue_ms: float


class UnknownMarked(msgspec.Struct, frozen=True):
    id: uuid.UUID
    tenant_id: int
    monitor_task_id: int
    target_client_id: uuid.UUID


class UnknownExecution(msgspec.Struct, frozen=True):
    """An execution whose result was accepted but never applied, locked."""

    id: uuid.UUID
    tenant_id: int
    monitor_task_id: int
    target_client_id: uuid.UUID
    lease_epoch: int
    lane: str
    ai_platform_id: int | None
    collect_request_id: uuid.UUID | None
    leased_at: datetime | None
    execution_phase: str | None
    lease_alive: bool


ExecutionOutcome = Literal["succeeded", "failed", "aborted", "expired"]


@dataclass(frozen=True, slots=True)
class ExecutionEnd:
    """One execution (or legacy lease) to end (`end`, `end_many`): its outcome, the epoch it must still be at (None:
    any), why, and the error."""

    task_id: uuid.UUID
    outcome: ExecutionOutcome
    lease_epoch: int | None = None
    reason: EndReason | ClientCancelReason | None = None
    error: str | None = None
    phase: str | None = None


@dataclass(frozen=True, slots=True)
class EndedExecution:
    """An execution (or legacy lease) that was live and is now ended; `previous_status` is the state it left."""

    task_id: uuid.UUID
    monitor_task_id: int
    tenant_id: int
    client_id: uuid.UUID
    ai_platform_id: int | None
    lane: str
    lease_epoch: int
    previous_status: str


def ended_from_rows(rows: list[dict[str, Any]]) -> list[EndedExecution]:
    return [EndedExecution(task_id=row["id"], monitor_task_id=row["monitor_task_id"], tenant_id=row["tenant_id"],
                           client_id=row["target_client_id"], ai_platform_id=row["ai_platform_id"], lane=row["lane"],
                           lease_epoch=row["lease_epoch"], previous_status=row["previous_status"])
            for row in rows]


class QueuedReplay(msgspec.Struct, frozen=True):
    """Work queued for a (re)connecting client, on either path: its task_available again."""

    kind: str
    id: uuid.UUID
    target_client_id: uuid.UUID
    priority: int
    lane: str
    scheduler_group_key: str | None
    business_date: date | None
    interrupt_generation: int
    updated_at: datetime
    monitor_task_id: int | None
    collect_request_id: uuid.UUID | None


class InterruptReplay(msgspec.Struct, frozen=True):
    """An interrupt still outstanding on a (re)connecting client's running work: its task_control again."""

    kind: str
    id: uuid.UUID
    target_client_id: uuid.UUID
    interrupt_generation: int
    control_flags: dict[str, Any] | None
    interrupt_reason: str | None
    updated_at: datetime
    collect_request_id: uuid.UUID | None
