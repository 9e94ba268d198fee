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
from typing import assert_never

import msgspec
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
from libs.tasks import execution_paths, lease_context
from libs.tasks.controls import send_control
from libs.tasks.lease_context import ResultContext
from libs.tasks.outcomes import Fenced, NotFound, Stale
from libs.tasks.queued import Queued
from libs.tasks.records import EndedExecution, ExecutionEnd, Extended, InterruptReplay, Leased, Offer, ResultClaim
from libs.tasks.records import LeaseState as LeaseRow
from libs.tasks.statuses import ClientCancelReason
from libs.tasks.transitions import emit_lifecycle, retry_business_task, yield_business_task
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
from services.dispatch_hub.results import (
    BrokerUnavailable,
    ResultPublisher,
    ResultRouter,
    StaticRouter,
    publish_routed,
)

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
    # The routing epoch a result is published by (services/dispatch_hub/results.py); None: epoch 0, ingest_shards.
    router: ResultRouter | None = None
    # This replica's write timings for the coordinator's auto slow-down (libs/db/write_health.py): the lease,
    # extend, cancel and result writes (and the gateway's heartbeat flushes).
    write_health: WriterHealth = field(default_factory=lambda: WriterHealth("hub", "hub"))


def _fence(state: LeaseRow | NotFound, principal: ClientPrincipal, token: str) -> LeaseRow:
    """The lease if `token` holds it; else the call's 404 (no such task for this client) or 409 stale_lease."""
    found = None if isinstance(state, NotFound) else state
    verdict = check_lease(None if found is None else LeaseState(
        target_client_id=found.target_client_id, status=found.status, lease_epoch=found.lease_epoch,
        lease_token_hash=found.lease_token_hash), caller=principal.client_id, token=token)
    if verdict is LeaseCheck.NOT_FOUND or found is None:
        raise ApiError(404, "not_found", "no such task for this client")
    if verdict is LeaseCheck.STALE:
        raise ApiError(409, "stale_lease", "the lease is no longer held by this token (expired, ended or re-leased)",
                       "lease_token")
    return found


# ---- lease ------------------------------------------------------------------------------------


@tracing.traced("hub.lease")
async def lease(ctx: HubContext, principal: ClientPrincipal, body: LeaseRequest) -> LeaseResponse:
    """Two round trips whatever the number of tasks: the client's lease lock + its capacity + the picked work of
    both paths (locked); then every lease, attempt, request mark and lifecycle event with the COMMIT."""
    tracing.set_attributes(tenant_id=principal.tenant_id, client_id=principal.client_id, max_tasks=body.max_tasks)
    picked: list[tuple[Offer, int, str, Queued[Leased | Stale]]] = []  # work, epoch, token, its lease
    async with ctx.pool.connection() as conn:
        dispatch = await ctx.settings.get(conn)
        async with ctx.write_health.timed(), pipelined_transaction(conn) as pipe:
            await conn.execute(q.LOCK_CLIENT_LEASES, {"client_id": principal.client_id})
            pick = await execution_paths.pick_for_client(conn, client_id=principal.client_id,
                                                         tenant_id=principal.tenant_id, max_tasks=body.max_tasks)
            await pipe.sync()
            offers = await pick.result()
            if isinstance(offers, NotFound):
                raise ApiError(404, "not_found", "client not found")
            for offer in offers:
                epoch = offer.lease_epoch + 1
                token = new_lease_token(epoch)
                leasing = await execution_paths.mark_leased(conn, offer, epoch=epoch, token_hash=hash_token(token),
                                                            ttl_s=dispatch.lease_ttl_seconds)
                if offer.collect_request_id is not None:
                    await lease_context.mark_request_running(conn, offer.collect_request_id,
                                                             tenant_id=principal.tenant_id)
                await emit_lifecycle(conn, "task.leased", tenant_id=principal.tenant_id,
                                     client_id=principal.client_id, task_id=offer.id,
                                     monitor_task_id=offer.monitor_task_id, ai_platform_id=offer.ai_platform_id,
                                     lane=offer.lane, collect_request_id=offer.collect_request_id)
                picked.append((offer, epoch, token, leasing))
    tasks: list[LeasedTask] = []
    for offer, epoch, token, leasing in picked:
        match await leasing.result():
            case Leased(lease_expires_at=expires_at):
                pass
            case Stale():  # cannot happen under the pick's row lock; not handed out if it did
                log.error("a picked execution was not leased", extra={"task_id": str(offer.id)})
                continue
            case unhandled:
                assert_never(unhandled)
        flags = offer.control_flags or {}
        tasks.append(LeasedTask(
            task_id=offer.id, monitor_task_id=offer.monitor_task_id, lane=offer.lane,  # type: ignore[arg-type]
            priority=offer.priority, lease_token=token, lease_expires_at=expires_at,
            interrupt_generation=offer.interrupt_generation, business_date=offer.business_date,
            brand=BrandRef(brand_id=offer.brand_id, name=offer.brand_name),
            question=QuestionRef(question_id=offer.question_id, text=offer.question_text),
            platform=PlatformRef(ai_platform_id=offer.ai_platform_id, code=offer.platform_code,
                                 mode=offer.platform_mode),
            lease_epoch=epoch, interrupt_requested=bool(flags.get("interrupt_requested", False)),
            execution_owner=offer.execution_owner))
    tracing.set_attributes(leased=len(tasks), task_id=tasks[0].task_id if len(tasks) == 1 else None,
                           execution_owner=tracing.execution_owners(t.execution_owner for t in tasks))
    for task in tasks:
        log.info("task leased", extra={"task_id": str(task.task_id), "client_id": str(principal.client_id),
                                       "tenant_id": principal.tenant_id, "lane": task.lane,
                                       "lease_epoch": task.lease_epoch, "execution_owner": task.execution_owner})
    return LeaseResponse(tasks=tasks)


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
        extended: Extended | Fenced = Fenced(task_id=task_id)
        if epoch is not None:
            async with ctx.write_health.timed():  # autocommit: one statement, a second for a legacy lease
                extended = await execution_paths.extend(
                    conn, task_id, tenant_id=principal.tenant_id, client_id=principal.client_id, epoch=epoch,
                    token_hash=hash_token(body.lease_token), ttl_s=dispatch.lease_ttl_seconds,
                    phase=body.execution_phase)
        match extended:
            case Extended():
                tracing.set_attributes(execution_owner=extended.execution_owner)
            case Fenced():
                _fence(await execution_paths.lease_state(conn, task_id, tenant_id=principal.tenant_id), principal,
                       body.lease_token)
                raise ApiError(409, "stale_lease", "the lease is no longer held by this token", "lease_token")
            case unhandled:
                assert_never(unhandled)
        if body.safe_point_interval_ms is not None:
            platform = await ctx.platforms.code(conn, extended.ai_platform_id)
            ctx.safe_points.observe(extended.ai_platform_id, platform, float(body.safe_point_interval_ms),
                                    principal.client_id)
    flags = extended.control_flags or {}
    interrupt = bool(flags.get("interrupt_requested", False))
    generation = extended.interrupt_generation
    if interrupt:
        generation = max(generation, int(flags.get("interrupt_generation") or 0))
    return ExtendResponse(lease_expires_at=extended.lease_expires_at, interrupt_requested=interrupt,
                          interrupt_generation=generation)


# ---- cancel / interrupt-ack ---------------------------------------------------------------------


def current_interrupt(row: LeaseRow | InterruptReplay, *, now: datetime) -> TaskControl:
    """The TaskControl a client must act on for an execution (re-sent after a stale callback, or on a replay)."""
    flags = row.control_flags or {}
    generation = max(row.interrupt_generation, int(flags.get("interrupt_generation", 0)))
    request = flags.get("collect_request_id")
    replacement = flags.get("replacement_task_id")
    return TaskControl(kind=row.kind, task_id=row.id, target_client_id=row.target_client_id,  # type: ignore[arg-type]
                       control="interrupt_requested", reason=row.interrupt_reason or PREEMPT_REASON,
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
            row = _fence(await execution_paths.lease_state(conn, task_id, tenant_id=principal.tenant_id,
                                                           for_update=True), principal, body.lease_token)
            tracing.set_attributes(execution_owner=row.execution_owner)
            if body.reason == PREEMPT_REASON:
                ack = await _acknowledge_preempt(conn, principal, task_id, body, row)
            else:
                await _client_cancel(conn, principal, task_id, body, row,
                                     max_attempts=dispatch.max_dispatch_attempts)
        if ack.stale is not None:
            raise ack.stale
        if body.safe_point_interval_ms is not None:
            platform = await ctx.platforms.code(conn, row.ai_platform_id)
            ctx.safe_points.observe(row.ai_platform_id, platform, float(body.safe_point_interval_ms),
                                    principal.client_id)
    _count_cancel(body, ack)
    log.info("task cancelled by client", extra={"task_id": str(task_id), "client_id": str(principal.client_id),
                                                "tenant_id": principal.tenant_id, "reason": body.reason,
                                                "interrupt_generation": body.interrupt_generation})
    return CancelResponse()


async def _acknowledge_preempt(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                               row: LeaseRow) -> _PreemptAck:
    """The client yields to an interrupt the server requested (refused when none was): a callback of an older
    generation gets the current interrupt re-sent, the current one aborts the execution."""
    if not preempt_cancel_allowed(row.control_flags):
        raise ApiError(409, "no_interrupt_requested", f"reason {PREEMPT_REASON!r} acknowledges an interrupt "
                       "the server requested, and none was requested for this task; cancel with another "
                       "reason", "reason")
    if is_stale_generation(body.interrupt_generation, row.interrupt_generation):
        return _PreemptAck(stale=await _resend_current_interrupt(conn, principal, task_id, body, row))
    return await _abort_preempted(conn, principal, task_id, body, row)


async def _resend_current_interrupt(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                                    row: LeaseRow) -> ApiError:
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
        "current_generation": row.interrupt_generation})
    return ApiError(409, "stale_generation",
                    "interrupt_generation is older than the task's; the current interrupt was re-sent",
                    "interrupt_generation", current_generation=row.interrupt_generation)


async def _abort_preempted(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                           row: LeaseRow) -> _PreemptAck:
    """End the preempted execution (aborted) and yield its business task back to its lane, no attempt counted."""
    ack = _PreemptAck()
    match await execution_paths.end(conn, ExecutionEnd(task_id=task_id, outcome="aborted", lease_epoch=row.lease_epoch,
                                                       reason=PREEMPT_REASON, phase=body.execution_phase)):
        case EndedExecution() as ended:
            pass
        case Stale() | NotFound():  # ended by another writer since the fence, under our row lock: cannot happen
            return ack
        case unhandled:
            assert_never(unhandled)
    await yield_business_task(conn, ended.monitor_task_id)
    if preempt_wasted_work(body.execution_phase or row.execution_phase):
        ack.induced_retry = True
    request = (row.control_flags or {}).get("collect_request_id")
    if request:
        ack.request_age_ms = await lease_context.first_preempt(conn, request, tenant_id=principal.tenant_id)
    await emit_lifecycle(conn, "task.aborted", tenant_id=principal.tenant_id, client_id=principal.client_id,
                         task_id=task_id, monitor_task_id=ended.monitor_task_id, ai_platform_id=ended.ai_platform_id,
                         lane=ended.lane, reason=PREEMPT_REASON, notify=True)
    return ack


async def _client_cancel(conn: Conn, principal: ClientPrincipal, task_id: uuid.UUID, body: CancelRequest,
                         row: LeaseRow, *, max_attempts: int) -> None:
    """The client's own cancel: the execution is aborted and its business task retried (an attempt counted)."""
    match await execution_paths.end(conn, ExecutionEnd(task_id=task_id, outcome="aborted", lease_epoch=row.lease_epoch,
                                                       reason=ClientCancelReason(body.reason[:64]),
                                                       phase=body.execution_phase)):
        case EndedExecution() as ended:
            pass
        case Stale() | NotFound():  # ended by another writer since the fence, under our row lock: cannot happen
            return
        case unhandled:
            assert_never(unhandled)
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
        state = await execution_paths.lease_state(conn, task_id, tenant_id=principal.tenant_id)
        tracing.set_attributes(execution_owner=state.execution_owner if isinstance(state, LeaseRow) else None)
        replayed = _result_replay(state, principal, body.lease_token, digest)
        if replayed is not None:
            return replayed
        row = _fence(state, principal, body.lease_token)
        path = execution_paths.executions_for(row.execution_owner)
        epoch = row.lease_epoch
        async with ctx.write_health.timed(), conn.transaction():
            claim = await path.claim_result(conn, task_id, tenant_id=principal.tenant_id, epoch=epoch, digest=digest)
        match claim:
            case ResultClaim():
                pass
            case Stale():  # the fence passed: the row is there at this epoch
                raise AssertionError(f"the result claim of a fenced lease matched nothing: {task_id}")
            case unhandled:
                assert_never(unhandled)
        post = classify_result_post(claim.previous, digest, received=claim.received)
        if post is ResultPost.CONFLICT:
            raise _result_conflict()
        if post is ResultPost.REPLAY:
            return ResultResponse(accepted=True, result_id=result_id_for(task_id, epoch))
        business_row = await lease_context.result_context(conn, row.monitor_task_id, tenant_id=principal.tenant_id)
    if isinstance(business_row, NotFound):
        raise ApiError(404, "not_found", "the business task of this execution no longer exists")
    message = _result_message(ctx, principal, row, business_row, body)
    try:
        message = await publish_routed(ctx.publisher, ctx.router or StaticRouter(ctx.ingest_shards), message)
    except BrokerUnavailable as exc:
        async with ctx.pool.connection() as conn, ctx.write_health.timed():
            # Stale: the lease was ended or resulted meanwhile; nothing to give back then.
            await path.release_result_claim(conn, task_id, tenant_id=principal.tenant_id, epoch=epoch, digest=digest)
        raise ApiError(503, "broker_unavailable", f"the result could not be queued; retry later ({exc})",
                       retry_after_s=2) from exc
    async with ctx.pool.connection() as conn, ctx.write_health.timed():
        # Stale: ingest ended the lease first (it read the result already); the result is in either way.
        await path.mark_result_received(conn, task_id, tenant_id=principal.tenant_id, epoch=epoch)
    log.info("result accepted", extra={"task_id": str(task_id), "client_id": str(principal.client_id),
                                       "tenant_id": principal.tenant_id, "result_id": str(message.result_id),
                                       "shard": message.shard, "status": body.status,
                                       "republished": post is ResultPost.REPUBLISH})
    return ResultResponse(accepted=True, result_id=message.result_id)


def _result_conflict() -> ApiError:
    return ApiError(409, "result_already_posted", "a different result was already posted on this lease; a lease "
                    "takes one result (an identical retry is answered as the first post was)", "lease_token")


def _result_replay(state: LeaseRow | NotFound, principal: ClientPrincipal, token: str,
                   digest: str) -> ResultResponse | None:
    """A post on a lease whose result was accepted already (even if ingest has ended the execution since):
    the same 202 for the same body, 409 for another. None: not such a post (fence and claim as usual)."""
    if (isinstance(state, NotFound) or state.target_client_id != principal.client_id
            or state.result_received_at is None):
        return None
    epoch = lease_token_epoch(token)
    if (epoch != state.lease_epoch or state.lease_token_hash is None
            or not tokens_match(token, state.lease_token_hash) or state.result_digest is None):
        return None
    if classify_result_post(state.result_digest, digest, received=True) is ResultPost.CONFLICT:
        raise _result_conflict()
    return ResultResponse(accepted=True, result_id=result_id_for(state.id, epoch))


def _result_message(ctx: HubContext, principal: ClientPrincipal, row: LeaseRow, business_row: ResultContext,
                    body: ResultRequest) -> MonitorResult:
    shard = shard_for(business_row.tenant_id, business_row.brand_id, business_row.business_date, ctx.ingest_shards)
    epoch = row.lease_epoch
    return MonitorResult(
        result_id=result_id_for(row.id, epoch), task_id=row.id, monitor_task_id=business_row.id,
        lease_epoch=epoch, tenant_id=business_row.tenant_id,
        workspace_id=business_row.workspace_id, brand_id=business_row.brand_id,
        question_id=business_row.question_id, ai_platform_id=business_row.ai_platform_id,
        collector_type=business_row.collector_type, run_mode=business_row.run_mode,
        business_date=business_row.business_date, client_id=principal.client_id, status=body.status,
        answer_text=body.answer_text, citations=body.citations, brand_mentioned=body.brand_mentioned,
        error=body.error, started_at=body.started_at, finished_at=body.finished_at, received_at=datetime.now(UTC),
        collect_request_id=row.collect_request_id, shard=shard)
