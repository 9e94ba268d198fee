"""The collect-now click's own path over the task tables (services/collect_now_api, docs/architecture.md "One
collect-now click, step by step"): what the click reads before it decides, the promotion of its scope's business tasks
to the high lane, and the reads of `GET /collect-requests/{id}`. The request row's own moves are
libs/tasks/requests.py's; the preemption of the client's scheduled work is the executions' (executions.py, legacy.py).

The SQL is module-private `_NAME` constants (docs/architecture.md "The task store: the click's and ingest's
operations"). The click's transaction is pipelined (three round trips, libs/db/tx.py): `read_for_click` and
`promote_for_click` queue their statements on it and return `Queued` answers, read after the caller's sync, so they add
no round trip. The statement texts are the ones the click has always sent (its plans, warmed by CLICK_WARM_UP).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import date, datetime
from typing import Any

import msgspec

from libs.db.pool import Conn
from libs.domain.lanes import HIGH_PRIORITY
from libs.tasks import business, executions, legacy
from libs.tasks.queued import Queued
from libs.tasks.requests import CLICK_STATEMENTS
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL

# ---- what the click reads, in one statement -----------------------------------------------------------------------

_BRAND = """
SELECT b.id, b.workspace_id, t.time_zone, (now() AT TIME ZONE t.time_zone)::date AS business_date
FROM brands b JOIN tenants t ON t.id = b.tenant_id
WHERE b.id = %(brand_id)s AND b.tenant_id = %(tenant_id)s AND b.workspace_id = %(workspace_id)s
"""

# The user's recent requests on this brand with one of the scope hashes (newest first). The hash covers the
# business date, which is read in the same statement (the tenant's local date), so the caller passes the hashes
# of every date it can be and picks the one of the date read.
_RECENT_REQUESTS = """
SELECT id, scope_hash, target_client_id, requested_task_count, aborted_queued_count, interrupt_requested_count,
       interrupt_generation, ttl_expires_at, status,
       coalesce((request_scope ->> 'affected_task_count')::int, requested_task_count) AS affected_task_count
FROM monitoring_collect_requests
WHERE requested_by_user_id = %(user_id)s AND brand_id = %(brand_id)s
  AND tenant_id = %(tenant_id)s AND status <> 'superseded' AND scope_hash = ANY(%(scope_hashes)s::text[])
  AND created_at > now() - make_interval(secs => %(window_s)s)
ORDER BY created_at DESC
"""

# Eligible clients of the caller's tenant and workspace with what §10.6 ranks them by. Preemption
# yields are not held against a client's abort rate: they are not its failures.
_CLIENT_CANDIDATES = f"""
SELECT c.id, c.max_concurrent_monitor, c.platform_health,
       extract(epoch FROM now() - c.last_heartbeat_at)::float8 AS heartbeat_age_s,
       (SELECT count(*) FROM desktop_tasks d
        WHERE d.target_client_id = c.id AND d.kind = 'monitor' AND d.status = 'in_progress') AS in_progress,
       a.attempts, a.aborts
FROM desktop_clients c
CROSS JOIN LATERAL (
    SELECT count(*) AS attempts,
           count(*) FILTER (WHERE x.status IN ('aborted', 'expired')
                              AND x.abort_reason IS DISTINCT FROM 'collect_now_preempt') AS aborts
    FROM desktop_task_attempts x
    WHERE x.client_id = c.id AND x.finished_at > now() - interval '1 minute'
) a
WHERE c.tenant_id = %(tenant_id)s AND c.workspace_id = %(workspace_id)s AND {ELIGIBLE_CLIENT_SQL}"""

# The tenant's active requests (a handful at most: the active-request limit keeps it small). Used for the
# limit (those not past their TTL) and for the supersede chain (those of the chosen client).
_ACTIVE_REQUESTS = """
SELECT id, target_client_id, extract(epoch FROM ttl_expires_at - now())::float8 AS ttl_remaining_s
FROM monitoring_collect_requests
WHERE tenant_id = %(tenant_id)s AND status IN ('accepted', 'dispatching', 'running')
"""

_USER_RATE = """
SELECT count(*) AS user_requests_last_hour,
       extract(epoch FROM now() - min(r.created_at))::float8 AS oldest_user_request_age_s
FROM monitoring_collect_requests r
WHERE r.tenant_id = %(tenant_id)s AND r.requested_by_user_id = %(user_id)s AND r.created_at > now() - interval '1 hour'
"""

# The scope: the brand's enabled questions (or the keyword's) x the tenant's enabled platforms.
_SCOPE = """
SELECT q.id AS question_id, p.id AS ai_platform_id, pl.id AS plan_id
FROM monitoring_questions q
JOIN tenant_platforms tp ON tp.tenant_id = q.tenant_id AND tp.enabled
JOIN ai_platforms p ON p.id = tp.ai_platform_id AND p.enabled
LEFT JOIN monitoring_plans pl
       ON pl.tenant_id = q.tenant_id AND pl.brand_id = q.brand_id AND pl.question_id = q.id
      AND pl.ai_platform_id = p.id AND pl.collector_type = 'desktop' AND pl.run_mode = 'daily'
WHERE q.tenant_id = %(tenant_id)s AND q.brand_id = %(brand_id)s AND q.enabled
  AND (%(keyword_id)s::bigint IS NULL OR q.keyword_id = %(keyword_id)s::bigint)
  AND (%(question_ids)s::bigint[] IS NULL OR q.id = ANY(%(question_ids)s::bigint[]))
  AND (%(platform_ids)s::bigint[] IS NULL OR p.id = ANY(%(platform_ids)s::bigint[]))
ORDER BY q.id, p.id
"""


def _json_array(sql: str) -> str:
    """A statement's rows as one JSON array, in the statement's order."""
    return (f"(SELECT coalesce(json_agg(x ORDER BY x.ord), '[]')::text "
            f"FROM (SELECT s.*, row_number() OVER () AS ord FROM ({sql}) s) x)")


# Everything the decision reads, in ONE statement (read under the tenant's collect-now lock, after it): the brand in
# the caller's tenant and workspace (NULL columns: not found), whether the keyword belongs to it, the user's recent
# requests (newest first), the eligible clients, the tenant's active requests, the user's hourly count and the scope.
# The row sets come back as JSON documents (decoded into typed structs, each when the click first needs it): one
# result for psycopg to convert instead of seven.
_READS = f"""
SELECT b.id AS brand_id, b.workspace_id, b.business_date,
       (%(keyword_id)s::bigint IS NULL OR EXISTS (
            SELECT 1 FROM monitoring_keywords k
            WHERE k.id = %(keyword_id)s::bigint AND k.brand_id = %(brand_id)s AND k.tenant_id = %(tenant_id)s))
           AS keyword_ok,
       {_json_array(_RECENT_REQUESTS)} AS recent,
       {_json_array(_CLIENT_CANDIDATES)} AS candidates,
       {_json_array(_ACTIVE_REQUESTS)} AS active,
       u.user_requests_last_hour, u.oldest_user_request_age_s,
       {_json_array(_SCOPE)} AS scope
FROM ({_USER_RATE}) u LEFT JOIN ({_BRAND}) b ON true
"""

# The recent requests alone (_RECENT_REQUESTS' JSON array): for a business date _READS was not given the hash of.
_RECENT = f"SELECT {_json_array(_RECENT_REQUESTS)} AS recent"


class RecentRequest(msgspec.Struct, frozen=True):
    """A request of the user on this brand and scope within the idempotency window (the click's replay)."""

    id: uuid.UUID
    scope_hash: str
    target_client_id: uuid.UUID | None
    requested_task_count: int
    aborted_queued_count: int
    interrupt_requested_count: int
    interrupt_generation: int
    ttl_expires_at: datetime
    status: str
    affected_task_count: int


class ClientCandidateRow(msgspec.Struct, frozen=True):
    """An eligible client of the tenant and workspace, with what the click ranks it by (§10.6)."""

    id: uuid.UUID
    max_concurrent_monitor: int
    platform_health: dict[str, str] | None
    heartbeat_age_s: float
    in_progress: int
    attempts: int
    aborts: int


class ActiveRequest(msgspec.Struct, frozen=True):
    id: uuid.UUID
    target_client_id: uuid.UUID | None
    ttl_remaining_s: float


class ScopeRow(msgspec.Struct, frozen=True):
    question_id: int
    ai_platform_id: int
    plan_id: int | None


_recent = msgspec.json.Decoder(list[RecentRequest])
_candidates = msgspec.json.Decoder(list[ClientCandidateRow])
_active = msgspec.json.Decoder(list[ActiveRequest])
_scope = msgspec.json.Decoder(list[ScopeRow])


class ClickReads(msgspec.Struct, frozen=True):
    """What `read_for_click` read. `brand_id` None: the brand is not the caller's. The row sets stay JSON until first
    asked for (a replay needs only `recent`)."""

    brand_id: int | None
    workspace_id: int | None
    business_date: date | None
    keyword_ok: bool
    user_requests_last_hour: int
    oldest_user_request_age_s: float | None
    recent_json: str
    candidates_json: str
    active_json: str
    scope_json: str

    def recent(self) -> list[RecentRequest]:
        return _recent.decode(self.recent_json)

    def candidates(self) -> list[ClientCandidateRow]:
        return _candidates.decode(self.candidates_json)

    def active(self) -> list[ActiveRequest]:
        return _active.decode(self.active_json)

    def scope(self) -> list[ScopeRow]:
        return _scope.decode(self.scope_json)


def _recent_params(*, tenant_id: int, brand_id: int, user_id: int, window_s: int,
                   scope_hashes: Sequence[str]) -> dict[str, Any]:
    return {"brand_id": brand_id, "tenant_id": tenant_id, "user_id": user_id, "window_s": window_s,
            "scope_hashes": list(scope_hashes)}


async def read_for_click(conn: Conn, *, tenant_id: int, workspace_id: int, brand_id: int, keyword_id: int | None,
                         user_id: int, window_s: int, scope_hashes: Sequence[str], heartbeat_timeout_s: int,
                         question_ids: list[int] | None, platform_ids: list[int] | None) -> Queued[ClickReads]:
    """Everything the click decides on, in one statement (queued: the caller syncs): the brand and the tenant's
    business date, the keyword, the user's recent requests of `scope_hashes` within `window_s`, the eligible
    clients, the tenant's active requests, the user's hourly count, the scope."""
    cur = await conn.execute(_READS, {
        **_recent_params(tenant_id=tenant_id, brand_id=brand_id, user_id=user_id, window_s=window_s,
                         scope_hashes=scope_hashes),
        "workspace_id": workspace_id, "keyword_id": keyword_id, "heartbeat_timeout_s": heartbeat_timeout_s,
        "question_ids": question_ids, "platform_ids": platform_ids})

    async def read() -> ClickReads:
        row = await cur.fetchone()
        assert row is not None, "one row, the brand's columns NULL when it is not found"
        return ClickReads(brand_id=row["brand_id"], workspace_id=row["workspace_id"],
                          business_date=row["business_date"], keyword_ok=bool(row["keyword_ok"]),
                          user_requests_last_hour=int(row["user_requests_last_hour"]),
                          oldest_user_request_age_s=row["oldest_user_request_age_s"], recent_json=row["recent"],
                          candidates_json=row["candidates"], active_json=row["active"], scope_json=row["scope"])

    return Queued(read)


async def recent_requests(conn: Conn, *, tenant_id: int, brand_id: int, user_id: int, window_s: int,
                          scope_hashes: Sequence[str]) -> Queued[list[RecentRequest]]:
    """The user's recent requests of `scope_hashes` alone (newest first; queued): for a business date
    `read_for_click` was not given the hash of."""
    cur = await conn.execute(_RECENT, _recent_params(tenant_id=tenant_id, brand_id=brand_id, user_id=user_id,
                                                     window_s=window_s, scope_hashes=scope_hashes))

    async def read() -> list[RecentRequest]:
        row = await cur.fetchone()
        assert row is not None
        return _recent.decode(row["recent"])

    return Queued(read)


# ---- the promotion ------------------------------------------------------------------------------------------------

class Promoted(msgspec.Struct, frozen=True):
    """What `promote_for_click` did: business tasks created, the scope's tasks, the ids of those promoted (a legacy
    row a client holds is in the scope but not promoted)."""

    created: int
    scope_tasks: int
    promoted_ids: list[int]


async def promote_for_click(conn: Conn, *, tenant_id: int, workspace_id: int, brand_id: int, business_date: date,
                            client_id: uuid.UUID | None, request_id: uuid.UUID, scope: Sequence[ScopeRow],
                            shard_key: str, superseded_ids: Sequence[uuid.UUID]) -> Queued[Promoted]:
    """The click's scope on the high lane (contract 4): the business tasks the scanner has not created yet are
    created, every scope task not held by a client is promoted to the high lane bound to `client_id` and the request
    (at the client's interrupt generation, as the click's earlier statements in the pipeline left it), and the tasks
    of the requests this one supersedes say so. Queued: the caller syncs."""
    params: dict[str, Any] = {
        "tenant_id": tenant_id, "workspace_id": workspace_id, "brand_id": brand_id, "business_date": business_date,
        "client_id": client_id, "request_id": request_id, "priority": HIGH_PRIORITY,
        "question_ids": [r.question_id for r in scope], "platform_ids": [r.ai_platform_id for r in scope],
        "plan_ids": [r.plan_id for r in scope], "shard_key": shard_key}
    created_cur = await conn.execute(business.CREATE_MISSING_TASKS, params)
    scope_tasks_cur = await conn.execute(business.PROMOTE_SCOPE, params)
    if superseded_ids:
        await conn.execute(business.MARK_SUPERSEDED, {"request_id": request_id, "tenant_id": tenant_id,
                                                      "old_ids": list(superseded_ids)})

    async def read() -> Promoted:
        scope_tasks = await scope_tasks_cur.fetchall()
        return Promoted(created=len(await created_cur.fetchall()), scope_tasks=len(scope_tasks),
                        promoted_ids=[int(r["id"]) for r in scope_tasks if r["promoted"]])

    return Queued(read)


# ---- the request after the click ----------------------------------------------------------------------------------

_REQUEST_PROGRESS = """
SELECT status, first_dispatched_at, dispatched_task_count FROM monitoring_collect_requests
WHERE id = %(request_id)s AND tenant_id = %(tenant_id)s
"""

# GET /collect-requests/{id} (§13.5).
_REQUEST_STATUS = """
SELECT r.*,
       greatest(0, floor(extract(epoch FROM r.ttl_expires_at - now()) * 1000))::bigint AS ttl_remaining_ms,
       (EXISTS (SELECT 1 FROM desktop_tasks d
                WHERE d.tenant_id = r.tenant_id AND d.collect_request_id = r.id AND d.leased_at IS NOT NULL)
        OR EXISTS (SELECT 1 FROM legacy_leases l
                   WHERE l.tenant_id = r.tenant_id AND l.collect_request_id = r.id AND l.leased_at IS NOT NULL))
           AS execution_leased
FROM monitoring_collect_requests r
WHERE r.id = %(request_id)s AND r.tenant_id = %(tenant_id)s AND r.workspace_id = %(workspace_id)s
"""

# Per-task status with its active execution (or, when none is active, this request's latest one). One page, in
# monitor_task_id order: the tasks after `after_task_id` (the cursor; 0 for the first page), at most `limit`.
_REQUEST_TASKS = f"""
SELECT t.id AS monitor_task_id, t.question_id, t.ai_platform_id, t.status, t.dispatch_lane AS lane,
       e.status AS execution_status, e.execution_phase
FROM monitoring_collect_tasks t
LEFT JOIN LATERAL (
    SELECT d.status, d.execution_phase
    FROM (SELECT d.status, d.execution_phase, d.collect_request_id, d.created_at FROM desktop_tasks d
          WHERE d.monitor_task_id = t.id AND d.tenant_id = t.tenant_id
          UNION ALL  -- a legacy lease is this task's execution on the legacy path
          SELECT l.status, l.execution_phase, l.collect_request_id, l.created_at FROM legacy_leases l
          WHERE l.monitor_task_id = t.id AND l.tenant_id = t.tenant_id) d
    WHERE d.status IN {ACTIVE_EXECUTION_SQL} OR d.collect_request_id = %(request_id)s
    ORDER BY (d.status IN {ACTIVE_EXECUTION_SQL}) DESC, d.created_at DESC
    LIMIT 1
) e ON true
WHERE t.tenant_id = %(tenant_id)s AND t.id = ANY(%(task_ids)s::bigint[]) AND t.id > %(after_task_id)s
ORDER BY t.id
LIMIT %(limit)s
"""


class RequestProgress(msgspec.Struct, frozen=True):
    status: str
    first_dispatched_at: datetime | None
    dispatched_task_count: int


class RequestView(msgspec.Struct, frozen=True):
    """A collect-now request as `GET /collect-requests/{id}` shows it: the row, its TTL left, whether any execution of
    it was ever leased (on either path), and the business tasks it promoted (its scope's `monitor_task_ids`)."""

    id: uuid.UUID
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
    first_preempt_at: datetime | None
    first_dispatched_at: datetime | None
    first_result_at: datetime | None
    ttl_expires_at: datetime
    ttl_remaining_ms: int
    superseded_by_request_id: uuid.UUID | None
    created_at: datetime
    updated_at: datetime
    execution_leased: bool
    monitor_task_ids: list[int]


class RequestTask(msgspec.Struct, frozen=True):
    """A business task of a request with its current execution (the active one, else the request's latest)."""

    monitor_task_id: int
    question_id: int
    ai_platform_id: int
    status: str
    lane: str
    execution_status: str | None
    execution_phase: str | None


async def request_progress(conn: Conn, *, request_id: uuid.UUID, tenant_id: int) -> RequestProgress | None:
    """The request's status and first dispatch (`wait_for_first_dispatch` polls it); None: not the tenant's."""
    cur = await conn.execute(_REQUEST_PROGRESS, {"request_id": request_id, "tenant_id": tenant_id})
    row = await cur.fetchone()
    if row is None:
        return None
    return RequestProgress(status=row["status"], first_dispatched_at=row["first_dispatched_at"],
                           dispatched_task_count=int(row["dispatched_task_count"]))


async def request_view(conn: Conn, *, request_id: uuid.UUID, tenant_id: int, workspace_id: int) -> RequestView | None:
    """One request of the tenant and workspace as the API shows it; None: not found there."""
    cur = await conn.execute(_REQUEST_STATUS, {"request_id": request_id, "tenant_id": tenant_id,
                                               "workspace_id": workspace_id})
    row = await cur.fetchone()
    if row is None:
        return None
    task_ids = [int(i) for i in (row["request_scope"] or {}).get("monitor_task_ids", [])]
    return msgspec.convert({**row, "monitor_task_ids": task_ids}, RequestView)


async def request_tasks(conn: Conn, *, request_id: uuid.UUID, tenant_id: int, task_ids: Sequence[int],
                        after_task_id: int, limit: int) -> list[RequestTask]:
    """One page of the request's tasks `task_ids`: those after `after_task_id`, in id order, at most `limit`."""
    cur = await conn.execute(_REQUEST_TASKS, {"request_id": request_id, "tenant_id": tenant_id,
                                              "task_ids": list(task_ids), "after_task_id": after_task_id,
                                              "limit": limit})
    return [RequestTask(**row) for row in await cur.fetchall()]


# ---- warm-up -----------------------------------------------------------------------------------------------------

# What a new pooled connection plans before its first click (libs.db.pool: EXPLAIN, nothing runs): the task-table
# statements of the accept transaction, with parameters that match no row.
_NOTHING = uuid.UUID(int=0)
_WARM_UP_PARAMS: dict[str, object] = {
    "tenant_id": 0, "workspace_id": 0, "brand_id": 0, "keyword_id": None, "user_id": 0, "window_s": 300,
    "heartbeat_timeout_s": 30, "question_ids": [0], "platform_ids": None, "plan_ids": [0], "scope_hashes": [""],
    "client_id": _NOTHING, "request_id": _NOTHING, "id": _NOTHING, "old_ids": [_NOTHING],
    "business_date": date(2000, 1, 1), "priority": 0, "shard_key": "", "scope_hash": "", "scope": "{}",
    "preempt": True, "generation": 0, "requested": 0, "aborted_queued": 0, "interrupt_requested": 0, "ttl_s": 300,
    "traceparent": None,
}
CLICK_WARM_UP: list[tuple[str, dict[str, object]]] = [(statement, _WARM_UP_PARAMS) for statement in (
    _READS, executions.CANCEL_QUEUED_SCHEDULED, executions.MARK_INTERRUPT_REQUESTED,
    legacy.WITHDRAW_SCHEDULED_OFFERS, legacy.INTERRUPT_SCHEDULED_LEASES, business.CREATE_MISSING_TASKS,
    business.PROMOTE_SCOPE, business.MARK_SUPERSEDED, *CLICK_STATEMENTS)]
