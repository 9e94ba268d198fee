"""Collect-now in one short transaction (contract 4, §17.1): no broker call, effects via the outbox."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import msgspec
import psycopg
from psycopg import AsyncPipeline
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from libs.auth import TenantPrincipal
from libs.clock import SYSTEM_CLOCK, Clock
from libs.config import Settings
from libs.contracts.http import CollectNowRequest, CollectNowResponse, CollectRequestStatus, CollectRequestTask
from libs.contracts.wire import ControlKind
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.dispatch_settings import DispatchSettings
from libs.domain.lanes import CLICK_LANE
from libs.domain.shard import ingest_shard_key
from libs.http import ApiError
from libs.outbox import NOTIFY_CHANNEL, enqueue_many
from libs.outbox.writer import PRIORITY_WAKE
from libs.tasks import clicks, execution_paths
from libs.tasks import requests as collect_requests
from libs.tasks.clicks import ClickReads, RecentRequest, ScopeRow
from libs.tasks.controls import control_event
from libs.tasks.queued import Queued
from libs.tasks.statuses import EndReason
from libs.tasks.transitions import DISPATCH_WAKE_CHANNEL, emit_lifecycle
from libs.telemetry import metrics, tracing
from services.collect_now_api import queries as q
from services.collect_now_api.logic import (
    ClientCandidate,
    ClientChoice,
    accept_message,
    check_rate_limits,
    choose_target_client,
    scope_hash,
)

log = logging.getLogger("collect_now")

PREEMPT_REASON: EndReason = "collect_now_preempt"
DEADLOCK_RETRIES = 3


class TenantGate:
    """At most `limit` requests of a tenant at once in this process; a request waits `wait_s` for a turn (holding
    no connection), then 429 `tenant_busy`, so a burst from one tenant cannot take the pool from the others,
    while a double-click still gets its idempotent replay. In its transaction a request waits `lock_wait_ms`
    for the tenant's collect-now lock (another replica's click), then 429 `tenant_busy` too."""

    def __init__(self, limit: int, wait_s: float, lock_wait_ms: int = 1000) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.lock_wait = f"{lock_wait_ms}ms"  # the click transaction's lock_timeout
        self._slots: dict[int, tuple[asyncio.Semaphore, list[int]]] = {}  # tenant -> (slots, [users])

    @classmethod
    def from_settings(cls, settings: Settings) -> TenantGate:
        """COLLECT_NOW_TENANT_MAX_IN_FLIGHT, COLLECT_NOW_TENANT_WAIT_MS, COLLECT_NOW_LOCK_WAIT_MS (read once, at
        start-up)."""
        return cls(settings.collect_now_tenant_max_in_flight, settings.collect_now_tenant_wait_ms / 1000,
                   settings.collect_now_lock_wait_ms)

    @contextlib.asynccontextmanager
    async def slot(self, tenant_id: int) -> AsyncIterator[None]:
        slots, users = self._slots.setdefault(tenant_id, (asyncio.Semaphore(self.limit), [0]))
        users[0] += 1
        try:
            try:
                await asyncio.wait_for(slots.acquire(), self.wait_s)
            except TimeoutError:
                metrics.edge_rejected_total.inc(service="collect-now-api", reason="tenant_busy")
                raise ApiError(429, "tenant_busy", "other collect-now requests of this tenant are still being "
                               "processed; retry in a moment", retry_after_s=1) from None
            try:
                yield
            finally:
                slots.release()
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._slots[tenant_id]


TENANT_GATE = TenantGate.from_settings(Settings())  # the defaults, for a caller that passes no gate


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """An `Idempotency-Key`'s first answer, as it was sent."""

    status: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Accepted:
    response: CollectNowResponse
    replay: bool
    # Set when this is an `Idempotency-Key` replay: the first answer, sent again byte for byte.
    stored: StoredAnswer | None = None

    def answer(self) -> StoredAnswer:
        """(status, body) as the handler sends them: the stored first answer, else 200 for an implicit replay and
        202 for a new request."""
        if self.stored is not None:
            return self.stored
        return StoredAnswer(200 if self.replay else 202, msgspec.json.encode(self.response))


@dataclass(frozen=True, slots=True)
class IdempotencyKey:
    """A request's `Idempotency-Key` (docs/api.md, Idempotency): the key, what the request was (its fingerprint:
    the brand and the body as decoded, so the same JSON spelled differently is the same request) and how long
    its first answer is kept."""

    key: str
    fingerprint: str
    ttl_hours: int

    @classmethod
    def of(cls, key: str, brand_id: int, body: CollectNowRequest, *, ttl_hours: int) -> IdempotencyKey:
        digest = hashlib.sha256(f"{brand_id}\n".encode() + msgspec.json.encode(body)).hexdigest()
        return cls(key, digest, ttl_hours)


@dataclass(frozen=True, slots=True)
class _Execution:
    task_id: uuid.UUID
    monitor_task_id: int
    ai_platform_id: int | None
    lane: str


@tracing.traced("collect_now")
async def collect_now(pool: AsyncConnectionPool[Conn], principal: TenantPrincipal, brand_id: int,
                      body: CollectNowRequest, settings: DispatchSettings, *,
                      first_dispatch_wait_s: float = 5.0, gate: TenantGate | None = None,
                      clock: Clock = SYSTEM_CLOCK, idempotency: IdempotencyKey | None = None) -> Accepted:
    """Accept (or replay) a collect-now request; optionally wait for its first dispatch. Traced: the span's
    context goes into the request row and the outbox events, and with them to the coordinator and the hub.
    `clock`: its date (in UTC) decides which business dates the replay lookup expects (`_scope_hashes`).
    `idempotency`: the request's Idempotency-Key; its first answer is stored in the same transaction and replayed
    to the same key (422 for the same key with another request, 409 while the first is still in flight)."""
    tracing.set_attributes(tenant_id=principal.tenant_id, brand_id=brand_id)
    gate = gate or TENANT_GATE
    async with gate.slot(principal.tenant_id):
        accepted = await _accept_with_retries(pool, principal, brand_id, body, settings, clock.now().date(), gate,
                                              idempotency)
    if body.wait_for_first_dispatch and not accepted.replay and accepted.response.status == "accepted":
        waited = await _wait_for_first_dispatch(pool, principal, accepted, first_dispatch_wait_s)
        if idempotency is not None and waited.response.status != accepted.response.status:
            async with pool.connection() as conn:  # the key replays what this caller is about to get
                await conn.execute(q.UPDATE_IDEMPOTENT_ANSWER, {
                    "tenant_id": principal.tenant_id, "user_id": principal.user_id, "idempotency_key": idempotency.key,
                    "collect_request_id": waited.response.request_id, "body": waited.answer().body})
        accepted = waited
    return accepted


async def _accept_with_retries(pool: AsyncConnectionPool[Conn], principal: TenantPrincipal, brand_id: int,
                               body: CollectNowRequest, settings: DispatchSettings, today: date,
                               gate: TenantGate, idempotency: IdempotencyKey | None = None) -> Accepted:
    """The accept transaction, again after a deadlock or serialization failure (up to DEADLOCK_RETRIES times) and
    once after a lost connection: a pooled connection that died (a database restart or failover, a terminated
    backend) takes the pool's other idle connections with it, so they are checked and replaced first. A click whose
    COMMIT did reach the database before its connection died is found by the retry's replay lookup, never written
    twice. A tenant whose lock is held answers 429."""
    conflicts = 0
    reconnected = False
    while True:
        try:
            async with pool.connection() as conn:
                try:
                    return await _collect_now_tx(conn, principal, brand_id, body, settings, today, gate.lock_wait,
                                                 idempotency)
                except psycopg.OperationalError:
                    if not conn.broken or reconnected:
                        raise
        except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure):
            conflicts += 1
            if conflicts == DEADLOCK_RETRIES:
                raise
            log.warning("collect-now transaction conflicted; retrying",
                        extra={"tenant_id": principal.tenant_id, "brand_id": brand_id, "attempt": conflicts})
            continue
        except pg_errors.LockNotAvailable:
            metrics.edge_rejected_total.inc(service="collect-now-api", reason="tenant_busy")
            raise ApiError(429, "tenant_busy", "another collect-now of this tenant holds its lock; retry in a "
                           "moment", retry_after_s=1) from None
        reconnected = True
        log.warning("collect-now connection was lost; retrying on a fresh one",
                    extra={"tenant_id": principal.tenant_id, "brand_id": brand_id})
        await pool.check()


@dataclass(slots=True)
class _Click:
    """One click's decision as it is taken, step by step, inside its transaction."""

    principal: TenantPrincipal
    brand_id: int
    body: CollectNowRequest
    settings: DispatchSettings
    today: date  # the UTC date by the API's clock
    lock_wait: str  # how long the tenant's lock is waited for (lock_timeout)
    reads: ClickReads | None = None
    business_date: date = date.min  # the tenant's, as the reads found it
    scope_hash: str = ""
    choice: ClientChoice | None = None
    scope: list[ScopeRow] = field(default_factory=list)
    superseded_ids: list[uuid.UUID] = field(default_factory=list)  # the client's active requests this one replaces
    request_id: uuid.UUID = field(default_factory=uuid.uuid4)

    @property
    def tenant_id(self) -> int:
        return self.principal.tenant_id

    @property
    def client_id(self) -> uuid.UUID | None:
        return self.choice.client_id if self.choice else None


@dataclass(slots=True)
class _Promotion:
    """What the click changed: the client's new generation, the work it withdrew or interrupted, the tasks."""

    generation: int
    cancelled: list[_Execution]
    interrupted: list[_Execution]
    created: int
    scope_tasks: int
    promoted_ids: list[int]


async def _collect_now_tx(conn: Conn, principal: TenantPrincipal, brand_id: int, body: CollectNowRequest,
                          settings: DispatchSettings, today: date, lock_wait: str,
                          idempotency: IdempotencyKey | None = None) -> Accepted:
    """The steps of docs/architecture.md §17.1 in one short transaction, pipelined: three round trips (the tenant's
    lock and every read; preemption and promotion; the request row, events and COMMIT) instead of ~20 statements
    one by one, which keeps click -> commit at a few ms. A request with an Idempotency-Key takes two more: the
    key's lock and first answer before, the answer stored (once it is known) before the COMMIT."""
    click = _Click(principal, brand_id, body, settings, today, lock_wait)
    async with pipelined_transaction(conn) as pipe:
        if idempotency is not None:
            stored = await _claim_idempotency_key(conn, pipe, principal, idempotency)
            if stored is not None:
                return stored
        replay = await _lock_and_read(conn, pipe, click)
        if replay is not None:
            if idempotency is not None:
                await _store_answer(conn, principal, idempotency, replay)
            return replay
        _choose_client_and_check_limits(click)
        promotion = await _preempt_and_promote(conn, pipe, click)
        created, superseded = await _record_request(conn, click, promotion)
        if idempotency is not None:
            # The answer (its TTL and what it superseded come back from the statements) is stored before COMMIT.
            await pipe.sync()
            accepted = await _read_accepted(click, promotion, created, superseded)
            await _store_answer(conn, principal, idempotency, accepted)
            return accepted
        # No sync here: the COMMIT is queued behind these statements when the transaction block ends, and
        # the pipeline sends them all at once (the results are read after the commit).
    return await _read_accepted(click, promotion, created, superseded)


async def _read_accepted(click: _Click, promotion: _Promotion, created: Queued[collect_requests.CreatedRequest],
                         superseded: Queued[list[uuid.UUID]]) -> Accepted:
    request = await created.result()
    return Accepted(_accepted(click, promotion, request.ttl_expires_at, await superseded.result()), replay=False)


async def _claim_idempotency_key(conn: Conn, pipe: AsyncPipeline, principal: TenantPrincipal,
                                 idempotency: IdempotencyKey) -> Accepted | None:
    """The key's lock (409 when another request with it is in flight) and its first answer: the replay when this
    is the same request, 422 when it is another. None: the key is new (or expired), and this request's."""
    params = {"tenant_id": principal.tenant_id, "user_id": principal.user_id, "idempotency_key": idempotency.key}
    lock_cur = await conn.execute(q.TRY_LOCK_IDEMPOTENCY_KEY, params)
    stored_cur = await conn.execute(q.IDEMPOTENCY_KEY, params)
    await pipe.sync()
    lock = await lock_cur.fetchone()
    row = await stored_cur.fetchone()
    assert lock is not None
    if not lock["locked"]:
        raise ApiError(409, "idempotency_key_in_use", "a request with this Idempotency-Key is still being processed; "
                       "retry in a moment to get its answer", "Idempotency-Key", retry_after_s=1)
    if row is None:
        return None
    if row["request_fingerprint"] != idempotency.fingerprint:
        raise ApiError(422, "idempotency_key_reused", "this Idempotency-Key was used for a different request (another "
                       "brand or body); send a new key with a new request", "Idempotency-Key")
    stored = StoredAnswer(int(row["response_status"]), bytes(row["response_body"]))
    response = msgspec.json.decode(stored.body, type=CollectNowResponse)
    tracing.set_attributes(collect_request_id=response.request_id, replay=True)
    return Accepted(response, replay=True, stored=stored)


async def _store_answer(conn: Conn, principal: TenantPrincipal, idempotency: IdempotencyKey,
                        accepted: Accepted) -> None:
    """The key's first answer, in the click's transaction (queued: sent with the COMMIT)."""
    answer = accepted.answer()
    await conn.execute(q.STORE_IDEMPOTENCY_KEY, {
        "tenant_id": principal.tenant_id, "user_id": principal.user_id, "idempotency_key": idempotency.key,
        "fingerprint": idempotency.fingerprint, "collect_request_id": accepted.response.request_id,
        "status": answer.status, "body": answer.body, "ttl_hours": idempotency.ttl_hours})


async def purge_idempotency_keys(pool: AsyncConnectionPool[Conn], *, batch: int = 1000) -> int:
    """Delete expired Idempotency-Key rows, a batch at a time, until none is left; the number deleted."""
    deleted = 0
    while True:
        async with pool.connection() as conn:
            cur = await conn.execute(q.PURGE_IDEMPOTENCY_KEYS, {"limit": batch})
        deleted += cur.rowcount
        if cur.rowcount < batch:
            return deleted


async def _lock_and_read(conn: Conn, pipe: AsyncPipeline, click: _Click) -> Accepted | None:
    """Round trip 1: the tenant's collect-now lock, then (under it, so on committed data) everything the decision
    reads, in one statement: the brand and keyword in the caller's tenant, the user's recent requests, clients,
    limits, scope. The idempotent replay of a request made moments ago, if this is one."""
    body, tenant_id = click.body, click.tenant_id
    await conn.execute(q.LOCK_WAIT, {"lock_wait": click.lock_wait})
    await conn.execute(q.LOCK_TENANT, {"tenant_id": tenant_id})
    hashes = _scope_hashes(click.brand_id, body, click.today)
    user_id, window_s = click.principal.user_id, click.settings.idempotency_window_seconds
    queued = await clicks.read_for_click(
        conn, tenant_id=tenant_id, workspace_id=click.principal.workspace_id, brand_id=click.brand_id,
        keyword_id=body.keyword_id, user_id=user_id, window_s=window_s, scope_hashes=list(hashes.values()),
        heartbeat_timeout_s=click.settings.heartbeat_timeout_seconds, question_ids=body.question_ids,
        platform_ids=body.ai_platform_ids)
    await pipe.sync()
    reads = await queued.result()
    if reads.brand_id is None or reads.business_date is None:
        raise ApiError(404, "not_found", "brand not found", "brand_id")
    if not reads.keyword_ok:
        # Well-formed, naming nothing of this brand: not found (404), not malformed (400).
        raise ApiError(404, "not_found", f"keyword {body.keyword_id} not found in brand {click.brand_id}",
                       "keyword_id")
    click.reads = reads
    click.business_date = business_date = reads.business_date
    hashed = hashes.get(business_date)
    if hashed is None:  # the database's clock is a day away from ours: read again with the right hash
        hashed = _scope_hash(click.brand_id, body, business_date)
        queued_recent = await clicks.recent_requests(conn, tenant_id=tenant_id, brand_id=click.brand_id,
                                                     user_id=user_id, window_s=window_s, scope_hashes=[hashed])
        await pipe.sync()
        recent = await queued_recent.result()
    else:
        recent = reads.recent()
    click.scope_hash = hashed
    existing = next((r for r in recent if r.scope_hash == hashed), None)
    if existing is None:
        return None
    tracing.set_attributes(collect_request_id=existing.id, replay=True)
    return Accepted(_replay_response(existing), replay=True)


def _choose_client_and_check_limits(click: _Click) -> None:
    """The client the work goes to, the tenant's and user's rate limits, and the scope's bounds (4xx if not)."""
    reads, settings = click.reads, click.settings
    assert reads is not None
    candidates = [_candidate(row) for row in reads.candidates()]
    click.choice = choose_target_client(candidates, requested=click.body.target_client_id,
                                        heartbeat_timeout_s=settings.heartbeat_timeout_seconds)
    client_id = click.client_id
    active = reads.active()
    # A request this one supersedes (same client) is not an extra active one.
    counted = [r for r in active if r.ttl_remaining_s > 0 and (client_id is None or r.target_client_id != client_id)]
    limited = check_rate_limits(
        active_requests=len(counted), max_active_requests=settings.max_active_requests_per_tenant,
        earliest_active_ttl_s=min((r.ttl_remaining_s for r in counted), default=None),
        user_requests_last_hour=reads.user_requests_last_hour,
        max_user_requests_per_hour=settings.max_requests_per_user_per_hour,
        oldest_user_request_age_s=reads.oldest_user_request_age_s)
    if limited is not None:
        raise ApiError(429, limited.code, limited.message, retry_after_s=limited.retry_after_s)
    click.scope = reads.scope()
    _check_scope(click.scope, click.body, max_tasks=settings.collect_now_max_scope_tasks)
    click.superseded_ids = [] if client_id is None else [r.id for r in active if r.target_client_id == client_id]


async def _preempt_and_promote(conn: Conn, pipe: AsyncPipeline, click: _Click) -> _Promotion:
    """Round trip 2: the client's new interrupt generation; its scheduled work withdrawn (not started) or asked to
    yield (running), on both execution paths; the scope's missing tasks created and every one promoted to the
    high lane; the tasks of the requests this one supersedes marked."""
    client_id, tenant_id = click.client_id, click.tenant_id
    business_date, reads = click.business_date, click.reads
    assert reads is not None and reads.workspace_id is not None
    tracing.set_attributes(collect_request_id=click.request_id, client_id=client_id)
    params: dict[str, Any] = {"tenant_id": tenant_id, "client_id": client_id, "request_id": click.request_id}
    generation_cur = None
    preemption = None  # the scheduled work withdrawn and interrupted, on both execution paths
    if client_id is not None:
        generation_cur = await conn.execute(q.INCREMENT_GENERATION, params)
        if click.body.preempt:
            preemption = await execution_paths.preempt_scheduled(conn, client_id=client_id, tenant_id=tenant_id,
                                                                 request_id=click.request_id)
    queued_promotion = await clicks.promote_for_click(
        conn, tenant_id=tenant_id, workspace_id=reads.workspace_id, brand_id=click.brand_id,
        business_date=business_date, client_id=client_id, request_id=click.request_id, scope=click.scope,
        shard_key=ingest_shard_key(tenant_id, click.brand_id, business_date), superseded_ids=click.superseded_ids)
    await pipe.sync()
    generation = 0
    if generation_cur is not None:
        row = await generation_cur.fetchone()
        assert row is not None, "the chosen client belongs to the tenant"
        generation = int(row["interrupt_generation"])
    cancelled: list[_Execution] = []
    interrupted: list[_Execution] = []
    if preemption is not None:
        preempted = await preemption.result()
        cancelled += [_execution(msgspec.structs.asdict(w)) for w in preempted.cancelled]
        interrupted += [_execution(msgspec.structs.asdict(w)) for w in preempted.interrupted]
    promoted = await queued_promotion.result()
    return _Promotion(generation=generation, cancelled=cancelled, interrupted=interrupted,
                      created=promoted.created, scope_tasks=promoted.scope_tasks, promoted_ids=promoted.promoted_ids)


async def _record_request(conn: Conn, click: _Click, promotion: _Promotion) -> (
    tuple[Queued[collect_requests.CreatedRequest], Queued[list[uuid.UUID]]]
):
    """Round trip 3 (with the commit): the request row, the superseded ones, the interrupted work's replacement,
    outbox events, wake-ups. Queued only: the caller reads the cursors after the commit."""
    tenant_id, client_id, body = click.tenant_id, click.client_id, click.body
    assert click.choice is not None
    request_scope = {
        "brand_id": click.brand_id, "keyword_id": body.keyword_id, "question_ids": body.question_ids,
        "ai_platform_ids": body.ai_platform_ids, "business_date": click.business_date.isoformat(),
        "affected_task_count": promotion.scope_tasks, "created_task_count": promotion.created,
        "monitor_task_ids": promotion.promoted_ids, "client_choice": click.choice.reason,
    }
    created = await collect_requests.create(
        conn, request_id=click.request_id, tenant_id=tenant_id, workspace_id=click.principal.workspace_id,
        brand_id=click.brand_id, keyword_id=body.keyword_id, user_id=click.principal.user_id, client_id=client_id,
        scope_hash=click.scope_hash, scope=request_scope, preempt=body.preempt, generation=promotion.generation,
        requested=len(promotion.promoted_ids), aborted_queued=len(promotion.cancelled),
        interrupt_requested=len(promotion.interrupted), ttl_s=click.settings.request_ttl_seconds,
        traceparent=tracing.current_traceparent())
    superseded = await collect_requests.supersede(conn, request_id=click.request_id, tenant_id=tenant_id,
                                                  old_ids=click.superseded_ids)
    replacement = uuid.uuid4() if promotion.interrupted and promotion.promoted_ids else None
    if replacement is not None:
        await execution_paths.name_replacement(
            conn, replacement_id=replacement, replacement_task=min(promotion.promoted_ids), tenant_id=tenant_id,
            interrupted_ids=[e.task_id for e in promotion.interrupted])
    await _write_events(conn, tenant_id=tenant_id, client_id=client_id, request_id=click.request_id,
                        generation=promotion.generation, cancelled=promotion.cancelled,
                        interrupted=promotion.interrupted, replacement=replacement)
    await conn.execute(q.NOTIFY, {"dispatch_channel": DISPATCH_WAKE_CHANNEL, "outbox_channel": NOTIFY_CHANNEL,
                                  "outbox_payload": PRIORITY_WAKE,
                                  "controls": bool(promotion.cancelled or promotion.interrupted)})
    return created, superseded


def _accepted(click: _Click, promotion: _Promotion, ttl_expires_at: datetime,
              superseded: list[uuid.UUID]) -> CollectNowResponse:
    """The committed click's metrics, log line and response (what this request did)."""
    assert click.choice is not None
    client_id = click.client_id
    metrics.collect_now_accept_count.inc()
    if promotion.interrupted:
        metrics.monitor_preempt_request_count.inc(len(promotion.interrupted))
    log.info("collect_now.accepted", extra={
        "tenant_id": click.tenant_id, "user_id": click.principal.user_id, "brand_id": click.brand_id,
        "request_id": str(click.request_id), "client_id": str(client_id) if client_id else None,
        "interrupt_generation": promotion.generation, "affected_tasks": promotion.scope_tasks,
        "promoted_tasks": len(promotion.promoted_ids), "created_tasks": promotion.created,
        "aborted_queued": len(promotion.cancelled), "interrupt_requested": len(promotion.interrupted),
        "superseded_requests": [str(s) for s in superseded]})
    return CollectNowResponse(
        request_id=click.request_id, target_client_id=client_id, affected_task_count=promotion.scope_tasks,
        promoted_task_count=len(promotion.promoted_ids), aborted_queued_count=len(promotion.cancelled),
        interrupt_requested_count=len(promotion.interrupted), interrupt_generation=promotion.generation,
        ttl_expires_at=ttl_expires_at, status="accepted", superseded_request_id=superseded[0] if superseded else None,
        message=accept_message(client_id=client_id, reason=click.choice.reason,
                               promoted=len(promotion.promoted_ids), aborted_queued=len(promotion.cancelled),
                               interrupt_requested=len(promotion.interrupted)))


async def _write_events(conn: Conn, *, tenant_id: int, client_id: uuid.UUID | None, request_id: uuid.UUID,
                        generation: int, cancelled: list[_Execution], interrupted: list[_Execution],
                        replacement: uuid.UUID | None = None) -> None:
    """TaskControl per cancelled / interrupted execution and the lifecycle event (in the caller's pipeline)."""
    if client_id is not None:
        now = datetime.now(UTC)
        batches: tuple[tuple[list[_Execution], ControlKind], ...] = (
            (cancelled, "cancelled"), (interrupted, "interrupt_requested"))
        await enqueue_many(conn, [
            control_event(task_id=execution.task_id, client_id=client_id, control=control, reason=PREEMPT_REASON,
                          interrupt_generation=generation, tenant_id=tenant_id, collect_request_id=request_id,
                          replacement_task_id=replacement if control == "interrupt_requested" else None,
                          urgent=True, now=now)  # claimed before older normal outbox events
            for ended, control in batches for execution in ended])
    await emit_lifecycle(conn, "collect_now.accepted", tenant_id=tenant_id, client_id=client_id, lane=CLICK_LANE.name,
                         collect_request_id=request_id,
                         reason=PREEMPT_REASON if cancelled or interrupted else None)


def _scope_hash(brand_id: int, body: CollectNowRequest, business_date: date) -> str:
    return scope_hash(brand_id=brand_id, keyword_id=body.keyword_id, question_ids=body.question_ids,
                      ai_platform_ids=body.ai_platform_ids, business_date=business_date)


def _scope_hashes(brand_id: int, body: CollectNowRequest, today: date) -> dict[date, str]:
    """The request's scope hash for every business date a tenant can be on when it is `today` in UTC: time zones
    span UTC-12 to UTC+14, one more day each way for clock skew near midnight. The click's read
    (clicks.read_for_click) then returns only the user's recent requests of this scope (not every request of the
    idempotency window, decoded and compared here)."""
    return {day: _scope_hash(brand_id, body, day) for day in (today + timedelta(days=n) for n in range(-2, 3))}


def _check_scope(scope: list[ScopeRow], body: CollectNowRequest, *, max_tasks: int) -> None:
    if body.question_ids:
        missing = sorted(set(body.question_ids) - {r.question_id for r in scope})
        if missing:
            raise ApiError(404, "not_found", f"question(s) {missing} not found among the enabled questions of this "
                           "brand (for this keyword and the tenant's enabled platforms)", "question_ids")
    if body.ai_platform_ids:
        missing = sorted(set(body.ai_platform_ids) - {r.ai_platform_id for r in scope})
        if missing:
            raise ApiError(404, "not_found", f"platform(s) {missing} not found among the platforms enabled for "
                           "this tenant", "ai_platform_ids")
    if not scope:
        raise ApiError(422, "empty_scope", "nothing to collect: the brand (or keyword) has no enabled questions "
                       "or the tenant has no enabled platforms")
    if len(scope) > max_tasks:
        # One click must not promote (and lock, and preempt for) an unbounded number of tasks.
        raise ApiError(422, "scope_too_large", f"the collect-now would affect {len(scope)} tasks (questions x "
                       f"platforms); the limit is {max_tasks}: narrow it with keyword_id, question_ids or "
                       "ai_platform_ids", scope_task_count=len(scope), max_scope_tasks=max_tasks)


def _candidate(row: clicks.ClientCandidateRow) -> ClientCandidate:
    return ClientCandidate(client_id=row.id, max_concurrent_monitor=row.max_concurrent_monitor,
                           in_progress=row.in_progress, attempts_last_minute=row.attempts,
                           aborts_last_minute=row.aborts, heartbeat_age_s=row.heartbeat_age_s,
                           platform_health=row.platform_health or {})


def _execution(row: dict[str, Any]) -> _Execution:
    return _Execution(task_id=row["id"], monitor_task_id=row["monitor_task_id"],
                      ai_platform_id=row["ai_platform_id"], lane=row["lane"])


def _replay_response(row: RecentRequest) -> CollectNowResponse:
    return CollectNowResponse(
        request_id=row.id, target_client_id=row.target_client_id, affected_task_count=row.affected_task_count,
        promoted_task_count=row.requested_task_count, aborted_queued_count=row.aborted_queued_count,
        interrupt_requested_count=row.interrupt_requested_count, interrupt_generation=row.interrupt_generation,
        ttl_expires_at=row.ttl_expires_at, status=row.status, idempotent_replay=True,
        message="the same collection was requested moments ago; this is that request")


async def _wait_for_first_dispatch(pool: AsyncConnectionPool[Conn], principal: TenantPrincipal, accepted: Accepted,
                                   timeout_s: float) -> Accepted:
    """`wait_for_first_dispatch`: poll the request until the coordinator dispatched its first task."""
    response = accepted.response
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with pool.connection() as conn:
            progress = await clicks.request_progress(conn, request_id=response.request_id,
                                                     tenant_id=principal.tenant_id)
        if progress is not None and progress.first_dispatched_at is not None:
            return Accepted(msgspec.structs.replace(response, status=progress.status), replay=False)
        await asyncio.sleep(0.02)
    return accepted


async def request_status(conn: Conn, principal: TenantPrincipal, request_id: uuid.UUID, *, limit: int = 100,
                         after_task_id: int = 0) -> CollectRequestStatus:
    """§13.5: progress of one request of the caller's tenant and workspace (any other request is not found), with
    one page of its tasks: at most `limit`, those after monitor task `after_task_id`."""
    row = await clicks.request_view(conn, request_id=request_id, tenant_id=principal.tenant_id,
                                    workspace_id=principal.workspace_id)
    if row is None:
        raise ApiError(404, "not_found", "collect request not found", "request_id")
    tasks = await clicks.request_tasks(conn, request_id=request_id, tenant_id=principal.tenant_id,
                                       task_ids=row.monitor_task_ids, after_task_id=after_task_id, limit=limit + 1)
    more = len(tasks) > limit
    tasks = tasks[:limit]
    started_statuses = {"running", "partial", "succeeded", "failed"}
    return CollectRequestStatus(
        request_id=row.id, status=row.status, brand_id=row.brand_id, keyword_id=row.keyword_id,
        target_client_id=row.target_client_id, interrupt_generation=row.interrupt_generation,
        requested_task_count=row.requested_task_count, dispatched_task_count=row.dispatched_task_count,
        completed_task_count=row.completed_task_count, failed_task_count=row.failed_task_count,
        aborted_queued_count=row.aborted_queued_count, interrupt_requested_count=row.interrupt_requested_count,
        # The hub stamps first_preempt_at when a preempted execution acknowledges the interrupt.
        preempted=bool(row.aborted_queued_count > 0 or row.first_preempt_at is not None),
        started=bool(row.status in started_statuses or row.execution_leased),
        first_dispatched_at=row.first_dispatched_at, first_result_at=row.first_result_at,
        ttl_expires_at=row.ttl_expires_at, ttl_remaining_ms=row.ttl_remaining_ms,
        superseded_by_request_id=row.superseded_by_request_id, created_at=row.created_at,
        updated_at=row.updated_at,
        tasks=[CollectRequestTask(**msgspec.structs.asdict(t)) for t in tasks],
        next_cursor=str(tasks[-1].monitor_task_id) if more else None)
