"""Desktop execution calls (contracts 5-7 of docs/architecture.md): lease, extend, cancel / interrupt-ack, result.

Each function takes a pool, the authenticated client and a typed body, and returns a typed
response or raises ApiError; the HTTP layer only decodes and encodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
from psycopg import AsyncCursor
from psycopg_pool import AsyncConnectionPool

from libs.auth import hash_token, tokens_match
from libs.contracts.amqp import MonitorResult
from libs.contracts.http import (
    BrandRef,
    CancelRequest,
    CancelResponse,
    ExtendRequest,
    ExtendResponse,
    LeasedTask,
    LeaseRequest,
    LeaseResponse,
    PlatformRef,
    QuestionRef,
    ResultRequest,
    ResultResponse,
)
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.db.write_health import WriterHealth
from libs.dispatch_settings import SettingsCache
from libs.domain.safe_points import bucket_of
from libs.domain.shard import shard_for
from libs.http import ApiError
from libs.tasks import executions, legacy
from libs.tasks import requests as collect_requests
from libs.tasks.controls import send_control
from libs.tasks.statuses import ClientCancelReason
from libs.tasks.transitions import emit_lifecycle, end_execution, retry_business_task, yield_business_task
from libs.telemetry import metrics, tracing
from services.dispatch_hub import queries as q
from services.dispatch_hub.auth import ClientPrincipal
from services.dispatch_hub.logic import (
    PREEMPT_REASON,
    LeaseCheck,
    LeaseState,
    ResultPost,
    check_lease,
    classify_result_post,
    is_stale_generation,
    lease_token_epoch,
    new_lease_token,
    preempt_cancel_allowed,
    preempt_wasted_work,
    result_digest,
    result_id_for,
)
from services.dispatch_hub.results import BrokerUnavailable, ResultPublisher

log = logging.getLogger("hub.leases")


class PlatformCodes:
    """ai_platform_id -> code (labels of the safe-point metrics, the platform-health check); reloaded on an
    unknown id or code, at most every `reload_interval_s` for codes (a client can send any code it likes)."""

    def __init__(self, *, reload_interval_s: float = 30.0) -> None:
        self._codes: dict[int, str] = {}
        self._known: frozenset[str] = frozenset()
        self._reload_interval = reload_interval_s
        self._loaded_at = -math.inf

    async def _load(self, conn: Conn) -> None:
        cur = await conn.execute(q.PLATFORM_CODES)
        self._codes = {int(r["id"]): str(r["code"]) for r in await cur.fetchall()}
        self._known = frozenset(self._codes.values())
        self._loaded_at = time.monotonic()

    async def code(self, conn: Conn, platform_id: int | None) -> str:
        if platform_id is None:
            return "unknown"
        if platform_id not in self._codes:
            await self._load(conn)
        return self._codes.get(platform_id, "unknown")

    async def unknown_codes(self, pool: AsyncConnectionPool[Conn], codes: Iterable[str]) -> list[str]:
        """The codes that name no AI platform (sorted)."""
        unknown = sorted(set(codes) - self._known)
        if unknown and time.monotonic() - self._loaded_at >= self._reload_interval:
            async with pool.connection() as conn:
                await self._load(conn)
            unknown = sorted(set(unknown) - self._known)
        return unknown


ANONYMOUS_CLIENT = uuid.UUID(int=0)


class SafePointStats:
    """Safe-point intervals clients report: the replica's `safe_point_interval_ms` histogram, and hourly
    histogram rows in the database (`safe_point_histogram`), written every flush interval, from which the
    reconciler computes each platform's P95 across every replica (libs/domain/safe_points.py)."""

    def __init__(self) -> None:
        # (ai_platform_id, client, bucket upper bound) -> count; per client so that the tuning can keep any one
        # client from moving a platform's timeouts (libs/domain/safe_points.robust_p95)
        self._pending: dict[tuple[int, uuid.UUID, int], int] = {}
        self.flushed = 0

    def observe(self, platform_id: int | None, platform: str, interval_ms: float,
                client_id: uuid.UUID = ANONYMOUS_CLIENT) -> None:
        metrics.safe_point_interval_ms.labels(platform=platform).observe(interval_ms)
        if platform_id is not None:
            key = (platform_id, client_id, bucket_of(interval_ms))
            self._pending[key] = self._pending.get(key, 0) + 1

    async def flush(self, pool: AsyncConnectionPool[Conn]) -> int:
        pending, self._pending = self._pending, {}
        if not pending:
            return 0
        rows = [{"platform_id": p, "client_id": str(c), "le_ms": le, "n": n}
                for (p, c, le), n in sorted(pending.items())]
        try:
            async with pool.connection() as conn, conn.transaction():
                await conn.execute(q.RECORD_SAFE_POINTS, {"rows": msgspec.json.encode(rows).decode()})
        except Exception:
            for key, n in pending.items():  # kept for the next flush
                self._pending[key] = self._pending.get(key, 0) + n
            raise
        self.flushed += sum(pending.values())
        return len(rows)

    async def run(self, pool: AsyncConnectionPool[Conn], stop: asyncio.Event, interval_s: float) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            try:
                await self.flush(pool)
            except Exception:
                log.exception("writing safe-point intervals failed; kept for the next flush")


@dataclass(slots=True)
class HubContext:
    pool: AsyncConnectionPool[Conn]
    settings: SettingsCache
    platforms: PlatformCodes
    safe_points: SafePointStats
    publisher: ResultPublisher
    ingest_shards: int
    # This replica's write timings for the coordinator's auto slow-down (libs/db/write_health.py): the lease,
    # extend, cancel and result writes (and the gateway's heartbeat flushes).
    write_health: WriterHealth = field(default_factory=lambda: WriterHealth("hub", "hub"))


def _state(row: dict[str, Any] | None) -> LeaseState | None:
    if row is None:
        return None
    return LeaseState(target_client_id=row["target_client_id"], status=row["status"],
                      lease_epoch=int(row["lease_epoch"]), lease_token_hash=row["lease_token_hash"])


def _fence(row: dict[str, Any] | None, principal: ClientPrincipal, token: str) -> dict[str, Any]:
    verdict = check_lease(_state(row), caller=principal.client_id, token=token)
    if verdict is LeaseCheck.NOT_FOUND or row is None:
        raise ApiError(404, "not_found", "no such task for this client")
    if verdict is LeaseCheck.STALE:
        raise ApiError(409, "stale_lease", "the lease is no longer held by this token (expired, ended or re-leased)",
                       "lease_token")
    return row


# ---- lease ------------------------------------------------------------------------------------


@tracing.traced("hub.lease")
async def lease(ctx: HubContext, principal: ClientPrincipal, body: LeaseRequest) -> LeaseResponse:
    """Two round trips whatever the number of tasks: the client's lease lock + its capacity + the picked rows
    (locked); then every lease, attempt, request mark and lifecycle event with the COMMIT."""
    tracing.set_attributes(tenant_id=principal.tenant_id, client_id=principal.client_id, max_tasks=body.max_tasks)
    picked: list[tuple[dict[str, Any], int, str, AsyncCursor[dict[str, Any]]]] = []  # row, epoch, token, lease
    async with ctx.pool.connection() as conn:
        dispatch = await ctx.settings.get(conn)
        async with ctx.write_health.timed(), pipelined_transaction(conn) as pipe:
            params = {"client_id": principal.client_id, "tenant_id": principal.tenant_id,
                      "max_tasks": body.max_tasks}
            await conn.execute(q.LOCK_CLIENT_LEASES, params)
            capacity_cur = await conn.execute(q.CLIENT_CAPACITY, params)
            pick_cur = await conn.execute(q.PICK_QUEUED, params)
            offers_cur = await conn.execute(legacy.PICK_OFFERS, params)
            await pipe.sync()
            capacity = await capacity_cur.fetchone()
            if capacity is None:
                raise ApiError(404, "not_found", "client not found")
            for row in _best_first(await pick_cur.fetchall(), await offers_cur.fetchall(), int(capacity["free"])):
                epoch = int(row["lease_epoch"]) + 1
                token = new_lease_token(epoch)
                mark = legacy.MARK_LEASED if row["execution_owner"] == "legacy" else executions.MARK_LEASED
                leased_cur = await conn.execute(mark, {
                    "task_id": row["id"], "epoch": epoch, "token_hash": hash_token(token),
                    "ttl_s": dispatch.lease_ttl_seconds})
                if row["collect_request_id"] is not None:
                    await conn.execute(collect_requests.MARK_RUNNING, {"request_id": row["collect_request_id"],
                                                           "tenant_id": principal.tenant_id})
                await emit_lifecycle(conn, "task.leased", tenant_id=principal.tenant_id,
                                     client_id=principal.client_id, task_id=row["id"],
                                     monitor_task_id=row["monitor_task_id"], ai_platform_id=row["ai_platform_id"],
                                     lane=row["lane"], collect_request_id=row["collect_request_id"])
                picked.append((row, epoch, token, leased_cur))
    tasks: list[LeasedTask] = []
    for row, epoch, token, leased_cur in picked:
        leased = await leased_cur.fetchone()
        if leased is None:  # cannot happen under PICK_QUEUED's row lock; not handed out if it did
            log.error("a picked execution was not leased", extra={"task_id": str(row["id"])})
            continue
        flags = row["control_flags"] or {}
        tasks.append(LeasedTask(
            task_id=row["id"], monitor_task_id=int(row["monitor_task_id"]), lane=row["lane"],
            priority=int(row["priority"]), lease_token=token, lease_expires_at=leased["lease_expires_at"],
            interrupt_generation=int(row["interrupt_generation"]), business_date=row["business_date"],
            brand=BrandRef(brand_id=int(row["brand_id"]), name=row["brand_name"]),
            question=QuestionRef(question_id=int(row["question_id"]), text=row["question_text"]),
            platform=PlatformRef(ai_platform_id=int(row["ai_platform_id"]), code=row["platform_code"],
                                 mode=row["platform_mode"]),
            lease_epoch=epoch, interrupt_requested=bool(flags.get("interrupt_requested", False)),
            execution_owner=row["execution_owner"]))
    tracing.set_attributes(leased=len(tasks), task_id=tasks[0].task_id if len(tasks) == 1 else None,
                           execution_owner=tracing.execution_owners(t.execution_owner for t in tasks))
    for task in tasks:
        log.info("task leased", extra={"task_id": str(task.task_id), "client_id": str(principal.client_id),
                                       "tenant_id": principal.tenant_id, "lane": task.lane,
                                       "lease_epoch": task.lease_epoch, "execution_owner": task.execution_owner})
    return LeaseResponse(tasks=tasks)


def _best_first(queued: list[dict[str, Any]], offers: list[dict[str, Any]], free: int) -> list[dict[str, Any]]:
    """The client's queued executions and legacy offers merged in dispatch order (lane weight, priority, enqueued),
    as many as it has free slots."""
    rows = sorted([*queued, *offers], key=lambda r: (-int(r["lane_weight"]), -int(r["priority"]), r["enqueued_at"]))
    return rows[:free]


async def _lease_state(conn: Conn, task_id: uuid.UUID, tenant_id: int, *, for_update: bool = False) -> (
    dict[str, Any] | None
):
    """An execution's lease state, or a legacy lease's (same columns, plus `execution_owner`); None: neither."""
    params = {"task_id": task_id, "tenant_id": tenant_id}
    cur = await conn.execute(q.LEASE_STATE_FOR_UPDATE if for_update else q.LEASE_STATE, params)
    row = await cur.fetchone()
    if row is None:
        if for_update:  # the business row first (libs/tasks/legacy.py: lock order)
            await conn.execute(legacy.LOCK_BUSINESS_ROW, params)
        cur = await conn.execute(legacy.LEASE_STATE_FOR_UPDATE if for_update else legacy.LEASE_STATE, params)
        row = await cur.fetchone()
    return row


# ---- extend -----------------------------------------------------------------------------------


@tracing.traced("hub.extend")
async def extend(ctx: HubContext, principal: ClientPrincipal, task_id: uuid.UUID, body: ExtendRequest) -> (
    ExtendResponse
):
    tracing.set_attributes(tenant_id=principal.tenant_id, client_id=principal.client_id, task_id=task_id,
                           execution_phase=body.execution_phase)
    epoch = lease_token_epoch(body.lease_token)
    async with ctx.pool.connection() as conn:
        dispatch = await ctx.settings.get(conn)
        row = None
        if epoch is not None:
            params = {"task_id": task_id, "tenant_id": principal.tenant_id, "client_id": principal.client_id,
                      "epoch": epoch, "token_hash": hash_token(body.lease_token),
                      "ttl_s": dispatch.lease_ttl_seconds, "phase": body.execution_phase}
            async with ctx.write_health.timed():  # autocommit: one statement, a second for a legacy lease
                cur = await conn.execute(executions.EXTEND_LEASE, params)
                row = await cur.fetchone()
                owner = "desktop_tasks"
                if row is None:  # a lease of the legacy path?
                    cur = await conn.execute(legacy.EXTEND, params)
                    row = await cur.fetchone()
                    owner = "legacy"
            if row is not None:
                tracing.set_attributes(execution_owner=owner)
        if row is None:
            _fence(await _lease_state(conn, task_id, principal.tenant_id), principal, body.lease_token)
            raise ApiError(409, "stale_lease", "the lease is no longer held by this token", "lease_token")
        if body.safe_point_interval_ms is not None:
            platform = await ctx.platforms.code(conn, row["ai_platform_id"])
            ctx.safe_points.observe(row["ai_platform_id"], platform, float(body.safe_point_interval_ms),
                                    principal.client_id)
    flags = row["control_flags"] or {}
    interrupt = bool(flags.get("interrupt_requested", False))
    generation = int(row["interrupt_generation"])
    if interrupt:
        generation = max(generation, int(flags.get("interrupt_generation") or 0))
    return ExtendResponse(lease_expires_at=row["lease_expires_at"], interrupt_requested=interrupt,
                          interrupt_generation=generation)


# ---- cancel / interrupt-ack ---------------------------------------------------------------------


def current_interrupt(row: dict[str, Any], *, now: datetime) -> TaskControl:
    """The TaskControl a client must act on for an execution (re-sent after a stale callback)."""
    flags = row["control_flags"] or {}
    generation = max(int(row["interrupt_generation"]), int(flags.get("interrupt_generation", 0)))
    request = flags.get("collect_request_id")
    replacement = flags.get("replacement_task_id")
    return TaskControl(kind=row["kind"], task_id=row["id"], target_client_id=row["target_client_id"],
                       control="interrupt_requested", reason=row["interrupt_reason"] or PREEMPT_REASON,
                       interrupt_generation=generation, updated_at=now,
                       collect_request_id=uuid.UUID(str(request)) if request else None,
                       replacement_task_id=uuid.UUID(str(replacement)) if replacement else None)


@dataclass(slots=True)
class _PreemptAck:
    """What acknowledging a preemption leaves for after the transaction."""

    # stale_generation: raised once the transaction has committed the re-sent interrupt.
    stale: ApiError | None = None
    # the yield threw away started work (collect_now_preempt_induced_retry_count)
    induced_retry: bool = False
    # age of the collect-now request that caused the preemption (monitor_preempt_latency_ms)
    request_age_ms: float | None = None


@tracing.traced("hub.cancel")
async def cancel(ctx: HubContext, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest) -> (
    CancelResponse
):
    tracing.set_attributes(tenant_id=principal.tenant_id, client_id=principal.client_id, task_id=task_id,
                           reason=body.reason[:64], interrupt_generation=body.interrupt_generation)
    async with ctx.pool.connection() as conn:
        dispatch = await ctx.settings.get(conn)
        ack = _PreemptAck()
        # One transaction; the lease row (a legacy lease: the business row first) is locked before anything else.
        async with ctx.write_health.timed(), conn.transaction():
            row = _fence(await _lease_state(conn, task_id, principal.tenant_id, for_update=True), principal,
                         body.lease_token)
            tracing.set_attributes(execution_owner=row["execution_owner"])
            if body.reason == PREEMPT_REASON:
                ack = await _acknowledge_preempt(conn, principal, task_id, body, row)
            else:
                await _client_cancel(conn, principal, task_id, body, row,
                                     max_attempts=dispatch.max_dispatch_attempts)
        if ack.stale is not None:
            raise ack.stale
        if body.safe_point_interval_ms is not None:
            platform = await ctx.platforms.code(conn, row["ai_platform_id"])
            ctx.safe_points.observe(row["ai_platform_id"], platform, float(body.safe_point_interval_ms),
                                    principal.client_id)
    _count_cancel(body, ack)
    log.info("task cancelled by client", extra={"task_id": str(task_id), "client_id": str(principal.client_id),
                                                "tenant_id": principal.tenant_id, "reason": body.reason,
                                                "interrupt_generation": body.interrupt_generation})
    return CancelResponse()


async def _acknowledge_preempt(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                               row: dict[str, Any]) -> _PreemptAck:
    """The client yields to an interrupt the server requested (refused when none was): a callback of an older
    generation gets the current interrupt re-sent, the current one aborts the execution."""
    if not preempt_cancel_allowed(row["control_flags"]):
        raise ApiError(409, "no_interrupt_requested", f"reason {PREEMPT_REASON!r} acknowledges an interrupt "
                       "the server requested, and none was requested for this task; cancel with another "
                       "reason", "reason")
    if is_stale_generation(body.interrupt_generation, int(row["interrupt_generation"])):
        return _PreemptAck(stale=await _resend_current_interrupt(conn, principal, task_id, body, row))
    return await _abort_preempted(conn, principal, task_id, body, row)


async def _resend_current_interrupt(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                                    row: dict[str, Any]) -> ApiError:
    """A stale preempt callback: the current interrupt goes to the client again; returns the 409 to answer."""
    client = principal.client_id
    metrics.interrupt_generation_mismatch_count.inc()
    control = current_interrupt(row, now=datetime.now(UTC))
    await send_control(conn, task_id=control.task_id, client_id=client, control=control.control, reason=control.reason,
                       interrupt_generation=control.interrupt_generation, tenant_id=principal.tenant_id,
                       collect_request_id=control.collect_request_id,
                       replacement_task_id=control.replacement_task_id, notify=True)
    log.warning("stale preempt callback; current interrupt re-sent", extra={
        "task_id": str(task_id), "client_id": str(client), "tenant_id": principal.tenant_id,
        "callback_generation": body.interrupt_generation,
        "current_generation": int(row["interrupt_generation"])})
    return ApiError(409, "stale_generation",
                    "interrupt_generation is older than the task's; the current interrupt was re-sent",
                    "interrupt_generation", current_generation=int(row["interrupt_generation"]))


async def _abort_preempted(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                           row: dict[str, Any]) -> _PreemptAck:
    """End the preempted execution (aborted) and yield its business task back to its lane, no attempt counted."""
    ack = _PreemptAck()
    ended = await end_execution(conn, task_id=task_id, outcome="aborted", lease_epoch=int(row["lease_epoch"]),
                                reason=PREEMPT_REASON, phase=body.execution_phase)
    if ended is None:
        return ack
    await yield_business_task(conn, ended.monitor_task_id)
    if preempt_wasted_work(body.execution_phase or row["execution_phase"]):
        ack.induced_retry = True
    request = (row["control_flags"] or {}).get("collect_request_id")
    if request:
        cur = await conn.execute(collect_requests.FIRST_PREEMPT,
                                 {"request_id": request, "tenant_id": principal.tenant_id})
        age = await cur.fetchone()
        ack.request_age_ms = float(age["age_ms"]) if age else None
    await emit_lifecycle(conn, "task.aborted", tenant_id=principal.tenant_id, client_id=principal.client_id,
                         task_id=task_id, monitor_task_id=ended.monitor_task_id, ai_platform_id=ended.ai_platform_id,
                         lane=ended.lane, reason=PREEMPT_REASON, notify=True)
    return ack


async def _client_cancel(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                         row: dict[str, Any], *, max_attempts: int) -> None:
    """The client's own cancel: the execution is aborted and its business task retried (an attempt counted)."""
    ended = await end_execution(conn, task_id=task_id, outcome="aborted", lease_epoch=int(row["lease_epoch"]),
                                reason=ClientCancelReason(body.reason[:64]), phase=body.execution_phase)
    if ended is None:
        return
    await retry_business_task(conn, ended.monitor_task_id, max_attempts=max_attempts,
                              error=f"cancelled by client: {body.reason}")
    await emit_lifecycle(conn, "task.aborted", tenant_id=principal.tenant_id, client_id=principal.client_id,
                         task_id=task_id, monitor_task_id=ended.monitor_task_id, ai_platform_id=ended.ai_platform_id,
                         lane=ended.lane, reason=body.reason[:64], notify=True)


def _count_cancel(body: CancelRequest, ack: _PreemptAck) -> None:
    """The preemption metrics, once the cancel has committed."""
    if ack.induced_retry:
        metrics.collect_now_preempt_induced_retry_count.inc()
    if body.reason == PREEMPT_REASON:
        metrics.monitor_preempt_success_count.inc()
        if ack.request_age_ms is not None:
            metrics.monitor_preempt_latency_ms.observe(ack.request_age_ms)


# ---- result -----------------------------------------------------------------------------------


@tracing.traced("hub.result")
async def result(ctx: HubContext, principal: ClientPrincipal, task_id: uuid.UUID, body: ResultRequest) -> (
    ResultResponse
):
    """Publish the result of a lease to its ingest shard (confirmed), once per lease: the same body posted
    again answers the same 202 and publishes nothing new; a different body on the same lease is a 409."""
    tracing.set_attributes(tenant_id=principal.tenant_id, client_id=principal.client_id, task_id=task_id,
                           status=body.status)
    digest = result_digest(msgspec.json.encode(body))
    async with ctx.pool.connection() as conn:
        row = await _lease_state(conn, task_id, principal.tenant_id)
        tracing.set_attributes(execution_owner=row["execution_owner"] if row is not None else None)
        replayed = _result_replay(row, principal, body.lease_token, digest)
        if replayed is not None:
            return replayed
        row = _fence(row, principal, body.lease_token)
        on_legacy = row["execution_owner"] == "legacy"
        epoch = int(row["lease_epoch"])
        claim_params = {"task_id": task_id, "tenant_id": principal.tenant_id, "epoch": epoch, "digest": digest}
        async with ctx.write_health.timed(), conn.transaction():
            cur = await conn.execute(legacy.CLAIM_RESULT if on_legacy else executions.CLAIM_RESULT, claim_params)
            claim = await cur.fetchone()
        assert claim is not None  # the fence passed: the row is there at this epoch
        post = classify_result_post(claim["previous"], digest, received=claim["result_received_at"] is not None)
        if post is ResultPost.CONFLICT:
            raise _result_conflict()
        if post is ResultPost.REPLAY:
            return ResultResponse(accepted=True, result_id=result_id_for(task_id, epoch))
        cur = await conn.execute(q.RESULT_CONTEXT, {"monitor_task_id": row["monitor_task_id"],
                                                    "tenant_id": principal.tenant_id})
        business_row = await cur.fetchone()
    if business_row is None:
        raise ApiError(404, "not_found", "the business task of this execution no longer exists")
    message = _result_message(ctx, principal, row, business_row, body)
    try:
        await ctx.publisher.publish(message, routing_key=f"shard.{message.shard}")
    except BrokerUnavailable as exc:
        async with ctx.pool.connection() as conn, ctx.write_health.timed():
            release = legacy.RELEASE_RESULT_CLAIM if on_legacy else executions.RELEASE_RESULT_CLAIM
            await conn.execute(release, claim_params)
        raise ApiError(503, "broker_unavailable", f"the result could not be queued; retry later ({exc})",
                       retry_after_s=2) from exc
    received = {"task_id": task_id, "tenant_id": principal.tenant_id, "epoch": epoch}
    async with ctx.pool.connection() as conn, ctx.write_health.timed():
        if on_legacy:
            async with conn.transaction():
                await conn.execute(legacy.MARK_BUSINESS_RECEIVED, received)
                await conn.execute(legacy.MARK_RESULT_RECEIVED, received)
        else:
            await conn.execute(executions.MARK_RESULT_RECEIVED, received)
    log.info("result accepted", extra={"task_id": str(task_id), "client_id": str(principal.client_id),
                                       "tenant_id": principal.tenant_id, "result_id": str(message.result_id),
                                       "shard": message.shard, "status": body.status,
                                       "republished": post is ResultPost.REPUBLISH})
    return ResultResponse(accepted=True, result_id=message.result_id)


def _result_conflict() -> ApiError:
    return ApiError(409, "result_already_posted", "a different result was already posted on this lease; a lease "
                    "takes one result (an identical retry is answered as the first post was)", "lease_token")


def _result_replay(row: dict[str, Any] | None, principal: ClientPrincipal, token: str,
                   digest: str) -> ResultResponse | None:
    """A post on a lease whose result was accepted already (even if ingest has ended the execution since):
    the same 202 for the same body, 409 for another. None: not such a post (fence and claim as usual)."""
    if row is None or row["target_client_id"] != principal.client_id or row["result_received_at"] is None:
        return None
    epoch = lease_token_epoch(token)
    if (epoch != int(row["lease_epoch"]) or row["lease_token_hash"] is None
            or not tokens_match(token, row["lease_token_hash"]) or row["result_digest"] is None):
        return None
    if classify_result_post(row["result_digest"], digest, received=True) is ResultPost.CONFLICT:
        raise _result_conflict()
    return ResultResponse(accepted=True, result_id=result_id_for(row["id"], epoch))


def _result_message(ctx: HubContext, principal: ClientPrincipal, row: dict[str, Any], business_row: dict[str, Any],
                    body: ResultRequest) -> MonitorResult:
    shard = shard_for(int(business_row["tenant_id"]), int(business_row["brand_id"]), business_row["business_date"],
                      ctx.ingest_shards)
    epoch = int(row["lease_epoch"])
    return MonitorResult(
        result_id=result_id_for(row["id"], epoch), task_id=row["id"], monitor_task_id=int(row["monitor_task_id"]),
        lease_epoch=epoch, tenant_id=int(business_row["tenant_id"]),
        workspace_id=int(business_row["workspace_id"]), brand_id=int(business_row["brand_id"]),
        question_id=int(business_row["question_id"]), ai_platform_id=int(business_row["ai_platform_id"]),
        collector_type=business_row["collector_type"], run_mode=business_row["run_mode"],
        business_date=business_row["business_date"], client_id=principal.client_id, status=body.status,
        answer_text=body.answer_text, citations=body.citations, brand_mentioned=body.brand_mentioned,
        error=body.error, started_at=body.started_at, finished_at=body.finished_at, received_at=datetime.now(UTC),
        collect_request_id=row["collect_request_id"], shard=shard)
