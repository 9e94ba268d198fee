"""HTTP bodies: tenant API (§13.1, §13.5) and desktop API (docs/architecture.md, Interfaces)."""

from __future__ import annotations

import uuid
from datetime import date, datetime
from typing import Annotated, Literal

import msgspec

from libs.contracts.common import (
    MULTI_LINE,
    SINGLE_LINE,
    AnswerText,
    ErrorText,
    ExecutionPhase,
    Lane,
    NonNegativeInt,
    PositiveInt,
    ShortText,
    Token,
)

# The versions of the two HTTP APIs (each document's `info.version`; docs/api.md, Versioning): a minor step for
# what only adds (a field, an operation, a status a client cannot yet receive), a major one for a change a written
# client could notice. 2.0.0: RFC 9457 problems, `Idempotency-Key`, a body naming a keyword, question or platform
# that is not there answered 422 (was 400). The desktop HTTP API's 1.1.0: RFC 9457 problems (members added).
TENANT_API_VERSION = "2.0.0"
DESKTOP_HTTP_API_VERSION = "1.1.0"

# ---- errors -----------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Every error answer of every HTTP API: an RFC 9457 problem (`application/problem+json`). `type`, `title`,
    `status`, `detail` and `instance` are the RFC's members; `error` (the stable code clients branch on),
    `message` (= `detail`), `field` and the rest are extension members, kept from before the RFC form so a
    client that reads `error` keeps working. `request_id` is also the answer's `X-Request-Id` header."""

    error: str
    message: str
    field: str | None = None
    current_generation: int | None = None
    retry_after_s: int | None = None
    # `scope_too_large`: how many tasks the collect-now would touch, and the most one may.
    scope_task_count: int | None = None
    max_scope_tasks: int | None = None
    # RFC 9457 members: `type` is `urn:monitoring-dispatch:problem:<error>` (docs/api.md lists them), `title` the
    # code in words, `instance` `urn:monitoring-dispatch:request:<request_id>`.
    type: str
    title: str
    status: Annotated[int, msgspec.Meta(ge=400, le=599)]
    detail: str
    instance: str | None = None
    request_id: str | None = None
    # The W3C trace id (32 hex) of the request's trace, when it has one (tracing on, or a `traceparent` sent).
    trace_id: str | None = None


# ---- tenant: collect-now ----------------------------------------------------------------------


class CollectNowRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    keyword_id: PositiveInt | None = None
    preempt: bool = True
    wait_for_first_dispatch: bool = False
    target_client_id: uuid.UUID | None = None
    # Narrower scopes (additions): only these questions / platforms of the brand.
    question_ids: Annotated[list[PositiveInt], msgspec.Meta(min_length=1, max_length=500)] | None = None
    ai_platform_ids: Annotated[list[PositiveInt], msgspec.Meta(min_length=1, max_length=50)] | None = None


class CollectNowResponse(msgspec.Struct, kw_only=True):
    request_id: uuid.UUID
    collection_mode: Literal["desktop"] = "desktop"
    target_client_id: uuid.UUID | None
    affected_task_count: int
    promoted_task_count: int
    aborted_queued_count: int
    interrupt_requested_count: int
    interrupt_generation: int
    ttl_expires_at: datetime
    message: str
    status: str = "accepted"
    idempotent_replay: bool = False
    superseded_request_id: uuid.UUID | None = None


class CollectRequestTask(msgspec.Struct, kw_only=True):
    monitor_task_id: int
    question_id: int
    ai_platform_id: int
    status: str
    lane: str
    execution_status: str | None = None
    execution_phase: str | None = None


class CollectRequestStatus(msgspec.Struct, kw_only=True):
    request_id: uuid.UUID
    status: str
    brand_id: int
    keyword_id: int | None
    target_client_id: uuid.UUID | None
    interrupt_generation: int
    requested_task_count: int
    dispatched_task_count: int
    completed_task_count: int
    failed_task_count: int
    aborted_queued_count: int
    interrupt_requested_count: int
    preempted: bool
    started: bool
    first_dispatched_at: datetime | None
    first_result_at: datetime | None
    ttl_expires_at: datetime
    ttl_remaining_ms: int
    superseded_by_request_id: uuid.UUID | None
    created_at: datetime
    updated_at: datetime
    # One page of the request's tasks (monitor_task_id order); `next_cursor` fetches the next (null: last page).
    tasks: list[CollectRequestTask] = []
    next_cursor: str | None = None


# ---- desktop ----------------------------------------------------------------------------------


class LeaseRequest(msgspec.Struct, kw_only=True):
    max_tasks: Annotated[int, msgspec.Meta(ge=1, le=10)] = 1


class BrandRef(msgspec.Struct, kw_only=True):
    brand_id: int
    name: str


class QuestionRef(msgspec.Struct, kw_only=True):
    question_id: int
    text: str


class PlatformRef(msgspec.Struct, kw_only=True, omit_defaults=True):
    ai_platform_id: int
    code: str
    # The mode the question runs in on this platform (§10.5, e.g. OpenAI `quick` / `deep_reasoning`): its interrupt
    # timeouts are the mode's. None: the platform's default mode.
    mode: str | None = None


class LeasedTask(msgspec.Struct, kw_only=True):
    task_id: uuid.UUID
    monitor_task_id: int
    lane: Lane
    priority: int
    lease_token: str
    lease_expires_at: datetime
    interrupt_generation: int
    business_date: date
    brand: BrandRef
    question: QuestionRef
    platform: PlatformRef
    lease_epoch: int = 1
    interrupt_requested: bool = False
    # Which execution path the task is on (docs/legacy-path.md): `desktop_tasks` (preempted at safe points) or
    # `legacy` (Phase 1: yields to an interrupt only while PREPARING or NAVIGATING, otherwise finishes). The calls are
    # the same on both; task_id is opaque either way.
    execution_owner: Annotated[Literal["desktop_tasks", "legacy"], msgspec.Meta(
        description="The task's execution path: desktop_tasks (yields to an interrupt at a safe point) or legacy "
                    "(Phase 1: yields only while PREPARING or NAVIGATING, otherwise runs to its result)")] = (
        "desktop_tasks")


class LeaseResponse(msgspec.Struct, kw_only=True):
    tasks: list[LeasedTask]


class ExtendRequest(msgspec.Struct, kw_only=True):
    lease_token: Token
    execution_phase: ExecutionPhase | None = None
    # Milliseconds since the previous safe point (docs/architecture.md §10.4), reported for §10.5 tuning.
    safe_point_interval_ms: NonNegativeInt | None = None


class ExtendResponse(msgspec.Struct, kw_only=True):
    lease_expires_at: datetime
    interrupt_requested: bool = False
    interrupt_generation: int = 0


class CancelRequest(msgspec.Struct, kw_only=True):
    lease_token: Token
    reason: ShortText
    interrupt_generation: NonNegativeInt
    execution_phase: ExecutionPhase | None = None
    safe_point_interval_ms: NonNegativeInt | None = None


class CancelResponse(msgspec.Struct, kw_only=True):
    status: Literal["aborted"] = "aborted"


class Citation(msgspec.Struct, kw_only=True):
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048, pattern=SINGLE_LINE)]
    title: Annotated[str, msgspec.Meta(max_length=1000, pattern=MULTI_LINE)] | None = None
    position: Annotated[int, msgspec.Meta(ge=0, le=10_000)] | None = None


class ResultRequest(msgspec.Struct, kw_only=True):
    lease_token: Token
    status: Literal["succeeded", "failed"]
    answer_text: AnswerText | None = None
    citations: Annotated[list[Citation], msgspec.Meta(max_length=200)] = []
    brand_mentioned: bool = False
    error: ErrorText | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None


class ResultResponse(msgspec.Struct, kw_only=True):
    accepted: bool = True
    result_id: uuid.UUID | None = None


__all__ = [
    "BrandRef", "CancelRequest", "CancelResponse", "Citation", "CollectNowRequest", "CollectNowResponse",
    "CollectRequestStatus", "CollectRequestTask", "ErrorBody", "ExtendRequest", "ExtendResponse",
    "LeaseRequest", "LeaseResponse", "LeasedTask", "PlatformRef", "QuestionRef", "ResultRequest",
    "ResultResponse", "ShortText",
]
