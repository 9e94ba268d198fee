"""Executions (`desktop_tasks`, `desktop_task_attempts`): every statement that creates one or moves it through its
lease, whoever runs it (docs/architecture.md "State machines", "Write matrix"). The legacy path's twin of each lease
statement is in libs/tasks/legacy.py.

    (coordinator) queued --(hub: lease, attempt opened)--> in_progress --(hub: result posted)--> in_progress, received
    in_progress, received --(reconciler: not applied in time)--> unknown --(no evidence, lease alive)--> queued
    queued --(collect-now: the client's scheduled work)--> aborted;  in_progress --(collect-now)--> interrupt asked

`DesktopTaskExecutions` (at the end) is this path's implementation of the `Executions` protocol
(libs/tasks/execution_paths.py): every statement here is run by one of its operations and by nothing else. The SQL
is module constants, private (`_NAME`) unless a module that has not moved behind the store yet still reads it (named
at the constant). What ending an execution does to its business task is libs/tasks/transitions.py.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Final

from libs.db.pool import Conn, json_records
from libs.domain.lanes import PREEMPTING_SQL
from libs.tasks import fragments
from libs.tasks.fragments import BLOCKED_PLATFORMS_OF_CLIENTS_SQL, CLIENT_GENERATION_SQL, HELD_LANES_SQL
from libs.tasks.outcomes import Fenced, NotFound, Stale, queued_rows
from libs.tasks.queued import Queued
from libs.tasks.records import (
    Done,
    EndedExecution,
    ExecutionEnd,
    ExecutionOwner,
    ExpiringLease,
    Extended,
    Leased,
    LeaseState,
    Offer,
    OverdueInterrupt,
    Preempted,
    QueuedWork,
    ReleasedWork,
    ResultClaim,
    ScheduledWork,
    UnknownExecution,
    UnknownMarked,
    ended_from_rows,
    from_row,
    from_rows,
)
from libs.tasks.result_claims import claim_result, release_result_claim
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL

# ---- creation (the coordinator) ----------------------------------------------------------------------------------

# Execution rows (cross-service contract 2), every value computed by the dispatcher from the claimed rows; one JSON
# parameter of named records (libs.db.pool.json_records: encoded by msgspec in C) instead of seventeen arrays psycopg
# dumps in Python. Public only for the dispatcher's warm-up list (services/dispatch_coordinator/dispatcher.py).
INSERT_EXECUTIONS = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
                           source, scheduler_group_key, monitor_task_id, interrupt_generation, enqueued_at,
                           brand_id, question_id, ai_platform_id, business_date, collect_request_id,
                           created_at, updated_at)
SELECT r.id, 'monitor', r.tenant_id, r.workspace_id, r.target_client_id, 'queued', r.priority, r.lane, r.lane_weight,
       r.source, r.scheduler_group_key, r.monitor_task_id, r.interrupt_generation, r.enqueued_at, r.brand_id,
       r.question_id, r.ai_platform_id, r.business_date, r.collect_request_id, %(ts)s, %(ts)s
FROM json_to_recordset(%(rows)s::json) AS r(
    id uuid, tenant_id bigint, workspace_id bigint, target_client_id uuid, priority int, lane text, lane_weight int,
    source text, scheduler_group_key text, monitor_task_id bigint, interrupt_generation bigint, enqueued_at timestamptz,
    brand_id bigint, question_id bigint, ai_platform_id bigint, business_date date, collect_request_id uuid)
"""


# The keys of each row of INSERT_EXECUTIONS (libs.db.pool.json_records).
_EXECUTION_KEYS = ("id", "tenant_id", "workspace_id", "target_client_id", "priority", "lane", "lane_weight", "source",
                  "scheduler_group_key", "monitor_task_id", "interrupt_generation", "enqueued_at", "brand_id",
                  "question_id", "ai_platform_id", "business_date", "collect_request_id")


# ---- a click's preemption (collect-now) --------------------------------------------------------------------------

# Contract 4: the client's queued scheduled executions are cancelled at once (CANCEL_QUEUED_SCHEDULED and
# MARK_INTERRUPT_REQUESTED are public only for collect-now's warm-up list, services/collect_now_api/queries.py).
# The set-based twin of `end(outcome='aborted')` for executions that were never leased (no attempt to
# close), in one statement to keep the request's transaction short.
# Then (the set-based twin of transitions.yield_business_task) each one's business task gets its
# dispatch attempt back; lane and enqueued_at are kept.
CANCEL_QUEUED_SCHEDULED = f"""
WITH g AS (SELECT {CLIENT_GENERATION_SQL} AS gen),
cancelled AS (
    UPDATE desktop_tasks
    SET status = 'aborted', finished_at = now(), updated_at = now(), lease_token_hash = NULL,
        interrupt_reason = 'collect_now_preempt', interrupted_at = now(), interrupt_generation = g.gen,
        control_flags = control_flags || jsonb_build_object('cancelled', true, 'interrupt_generation', g.gen,
                                                            'collect_request_id', %(request_id)s::text)
    FROM g
    WHERE target_client_id = %(client_id)s AND tenant_id = %(tenant_id)s AND kind = 'monitor'
      AND source = 'daily_schedule' AND status = 'queued'
    RETURNING id, monitor_task_id, ai_platform_id, lane
), yielded AS (
    UPDATE monitoring_collect_tasks
    SET dispatch_attempts = greatest(dispatch_attempts - 1, 0), updated_at = now()
    -- = ANY(ARRAY(...)): primary-key probes whatever the planner thinks of the tenant's backlog.
    WHERE id = ANY(ARRAY(SELECT monitor_task_id FROM cancelled)) AND tenant_id = %(tenant_id)s AND status = 'pending'
)
SELECT * FROM cancelled
"""


# Contract 4: the client's running scheduled executions are asked to yield at their next safe point.
MARK_INTERRUPT_REQUESTED = f"""
WITH g AS (SELECT {CLIENT_GENERATION_SQL} AS gen)
UPDATE desktop_tasks
SET control_flags = control_flags || jsonb_build_object('interrupt_requested', true,
                                                        'interrupt_generation', g.gen,
                                                        'collect_request_id', %(request_id)s::text),
    interrupt_generation = g.gen, interrupted_at = coalesce(interrupted_at, now()),
    interrupt_reason = 'collect_now_preempt', updated_at = now()
FROM g
WHERE target_client_id = %(client_id)s AND tenant_id = %(tenant_id)s AND kind = 'monitor'
  AND source = 'daily_schedule' AND status = 'in_progress' AND interrupt_generation < g.gen
RETURNING id, monitor_task_id, ai_platform_id, lane
"""


# The interrupted executions' replacement (task_control.replacement_task_id): the id the coordinator gives the
# high execution of the first promoted task, decided here so the interrupt can name it; kept in the interrupted
# executions' (and legacy leases') control flags for the hub's replay. Over both paths at once:
# `name_replacement` runs it.
_NAME_REPLACEMENT = """
WITH named AS (
    UPDATE monitoring_collect_tasks SET next_execution_id = %(replacement_id)s
    WHERE id = %(replacement_task)s AND tenant_id = %(tenant_id)s
    RETURNING id
), legacy_named AS (
    UPDATE legacy_leases
    SET control_flags = control_flags || jsonb_build_object('replacement_task_id', %(replacement_id)s::text)
    WHERE id = ANY(%(interrupted_ids)s::uuid[]) AND tenant_id = %(tenant_id)s AND EXISTS (SELECT 1 FROM named)
)
UPDATE desktop_tasks
SET control_flags = control_flags || jsonb_build_object('replacement_task_id', %(replacement_id)s::text)
WHERE id = ANY(%(interrupted_ids)s::uuid[]) AND tenant_id = %(tenant_id)s AND EXISTS (SELECT 1 FROM named)
"""


# ---- a broken login (the hub's heartbeat flush) ------------------------------------------------------------------

# The platform-health pause at the hub (libs/domain/platform_health.py): the queued executions of the lanes the
# planner holds back (normal, boosted, retry; not high) that wait for one of the clients %(client_ids)s on a platform
# it now reports a broken login on (unless the tenant's override ignores health) are released. The set-based twin
# of execution_paths.end(outcome='aborted') for executions never leased (no attempt to close), reason
# platform_unhealthy; then (transitions.yield_business_task) each one's business task gets its dispatch attempt
# back, lane and enqueued_at kept, for the coordinator to plan again (another client of the tenant whose login
# works, or held while none has one). Rows locked in id order. The legacy twin: legacy.RELEASE_OFFERS_OF_PLATFORM.
_RELEASE_QUEUED_OF_PLATFORM = f"""
WITH blocked AS MATERIALIZED ({BLOCKED_PLATFORMS_OF_CLIENTS_SQL}),
locked AS (
    SELECT d.id FROM desktop_tasks d JOIN blocked b
      ON d.target_client_id = b.client_id AND d.tenant_id = b.tenant_id AND d.ai_platform_id = b.ai_platform_id
    WHERE d.kind = 'monitor' AND d.status = 'queued' AND d.lane IN {HELD_LANES_SQL}
    ORDER BY d.id
    FOR UPDATE OF d
), released AS (
    UPDATE desktop_tasks d
    SET status = 'aborted', finished_at = now(), updated_at = now(), lease_token_hash = NULL,
        interrupt_reason = 'platform_unhealthy'
    FROM locked
    WHERE d.id = locked.id AND d.status = 'queued'
    RETURNING d.id, d.monitor_task_id, d.tenant_id, d.target_client_id, d.ai_platform_id, d.lane,
              d.interrupt_generation, d.collect_request_id
), yielded AS (
    UPDATE monitoring_collect_tasks
    SET dispatch_attempts = greatest(dispatch_attempts - 1, 0), updated_at = now()
    WHERE id = ANY(ARRAY(SELECT monitor_task_id FROM released)) AND status = 'pending'
)
SELECT * FROM released ORDER BY target_client_id, id
"""


# ---- the lease (the hub) ----------------------------------------------------------------------------------------

# Contract 5: the best queued executions of this client in dispatch order, as many as it has free slots (the
# capacity is computed in the statement, so that the lease reads and locks in one round trip). Normal work of a
# platform the client reports a broken login on is not leased (the heartbeat flush releases it:
# _RELEASE_QUEUED_OF_PLATFORM; this is the second line, for work queued since).
_PICK_QUEUED = f"""
SELECT d.id, d.monitor_task_id, d.lane, d.lane_weight, d.priority, d.lease_epoch, d.interrupt_generation,
       d.business_date, d.tenant_id, d.ai_platform_id, d.collect_request_id, d.control_flags, d.enqueued_at,
       b.id AS brand_id, b.name AS brand_name, q.id AS question_id, q.text AS question_text,
       p.code AS platform_code, {fragments.platform_mode_sql("d.monitor_task_id")} AS platform_mode,
       'desktop_tasks' AS execution_owner
FROM desktop_tasks d
JOIN brands b ON b.id = d.brand_id
JOIN monitoring_questions q ON q.id = d.question_id
JOIN ai_platforms p ON p.id = d.ai_platform_id
WHERE d.target_client_id = %(client_id)s AND d.tenant_id = %(tenant_id)s
  AND d.status = 'queued' AND d.kind = 'monitor' AND NOT {fragments.held_for_broken_login_sql("d", "p.code")}
ORDER BY d.lane_weight DESC, d.priority DESC, d.enqueued_at ASC
LIMIT coalesce(({fragments.CLIENT_CAPACITY_SQL}), 0)
FOR UPDATE OF d SKIP LOCKED
"""

# Lease one picked execution and record its attempt (the attempt only if the lease took: under _PICK_QUEUED's row
# lock it always does).
def lease_set_sql(epoch: str, token_hash: str) -> str:
    """What taking a lease writes on the execution (a SET list): the hub's lease call, and push-lease at dispatch
    (libs/tasks/push_leases.py). The attempt it opens is OPEN_ATTEMPT_SQL, over a `leased` CTE."""
    return (f"status = 'in_progress', lease_epoch = {epoch}, lease_token_hash = {token_hash}, leased_at = now(),\n"
            "        lease_expires_at = now() + make_interval(secs => %(ttl_s)s), execution_phase = 'PREPARING',\n"
            "        result_received_at = NULL, updated_at = now()")


OPEN_ATTEMPT_SQL = (
    "INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, lease_epoch, status,\n"
    "                                       execution_phase, interrupt_generation)\n"
    """    SELECT id, monitor_task_id, tenant_id, target_client_id, lease_epoch, 'in_progress', 'PREPARING',
           interrupt_generation
    FROM leased""")


_MARK_LEASED = f"""
WITH leased AS (
    UPDATE desktop_tasks
    SET {lease_set_sql("%(epoch)s", "%(token_hash)s")}
    WHERE id = %(task_id)s AND status = 'queued'
    RETURNING id, monitor_task_id, tenant_id, target_client_id, lease_epoch, interrupt_generation, lease_expires_at
), attempt AS (
    {OPEN_ATTEMPT_SQL}
)
SELECT lease_expires_at FROM leased
"""

_LEASE_STATE = """
SELECT d.id, d.target_client_id, d.status, d.lease_epoch, d.lease_token_hash, d.interrupt_generation,
       d.control_flags, d.monitor_task_id, d.tenant_id, d.workspace_id, d.ai_platform_id, d.lane, d.kind,
       d.collect_request_id, d.brand_id, d.question_id, d.business_date, d.interrupt_reason,
       d.result_digest, d.result_received_at, d.execution_phase, 'desktop_tasks' AS execution_owner
FROM desktop_tasks d
WHERE d.id = %(task_id)s AND d.tenant_id = %(tenant_id)s
"""

_LEASE_STATE_FOR_UPDATE = f"{_LEASE_STATE} FOR UPDATE OF d"

# Extend on the hot path: one statement that both checks the fence and extends.
_EXTEND_LEASE = """
UPDATE desktop_tasks
SET lease_expires_at = now() + make_interval(secs => %(ttl_s)s),
    execution_phase = coalesce(%(phase)s::text, execution_phase),
    started_at = CASE WHEN started_at IS NULL AND %(phase)s::text NOT IN ('PREPARING', 'NAVIGATING')
                      THEN now() ELSE started_at END,
    updated_at = now()
WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND target_client_id = %(client_id)s
  AND status = 'in_progress' AND lease_epoch = %(epoch)s AND lease_token_hash = %(token_hash)s
RETURNING lease_expires_at, interrupt_generation, control_flags, ai_platform_id, 'desktop_tasks' AS execution_owner
"""

# The first result body posted on a lease claims it; `previous` is the digest an earlier post stored (NULL: this
# post is the first).
_CLAIM_RESULT = claim_result("desktop_tasks")

# A publish that failed gives the claim back, so the client's retry can post again.
_RELEASE_RESULT_CLAIM = release_result_claim("desktop_tasks")

# The result was accepted and published: the client's slot is free, ingest applies it.
_MARK_RESULT_RECEIVED = """
UPDATE desktop_tasks SET result_received_at = now(), execution_phase = 'POSTING', updated_at = now()
WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND lease_epoch = %(epoch)s
"""

# ---- ending an execution (every service) ---------------------------------------------------------------------

_END_EXECUTION = f"""
UPDATE desktop_tasks d
SET status = %(status)s,
    finished_at = now(),
    updated_at = now(),
    error = coalesce(%(error)s, d.error),
    interrupt_reason = coalesce(%(reason)s, d.interrupt_reason),
    lease_token_hash = NULL
FROM (SELECT id, status AS previous_status FROM desktop_tasks
      WHERE id = %(task_id)s AND status IN {ACTIVE_EXECUTION_SQL}
        AND (%(lease_epoch)s::int IS NULL OR lease_epoch = %(lease_epoch)s::int)
      FOR UPDATE) prev
WHERE d.id = prev.id
RETURNING d.id, d.monitor_task_id, d.tenant_id, d.target_client_id, d.ai_platform_id, d.lane, d.lease_epoch,
          prev.previous_status
"""

_END_ATTEMPT = """
UPDATE desktop_task_attempts
SET status = %(status)s, finished_at = now(), error = %(error)s, abort_reason = %(reason)s,
    execution_phase = coalesce(%(phase)s, execution_phase)
WHERE task_id = %(task_id)s AND lease_epoch = %(lease_epoch)s AND status = 'in_progress'
"""

# Both statements probe each execution (attempt) by its key in a LATERAL .. OFFSET 0 subquery: a plan that
# does not depend on statistics. With a join the planner trusted a stale "few active executions" estimate
# and scanned every active execution (every attempt) per batch: ~6 ms each for 100 of 20,000 in progress.
# The ids come sorted, so the rows are locked in id order.
_END_EXECUTIONS = f"""
WITH wanted AS MATERIALIZED (
    SELECT * FROM unnest(%(task_ids)s::uuid[], %(statuses)s::text[], %(epochs)s::int[], %(reasons)s::text[],
                         %(errors)s::text[]) WITH ORDINALITY AS w(task_id, status, lease_epoch, reason, error, ord)
), prev AS MATERIALIZED (
    SELECT d.id, d.previous_status, w.status, w.reason, w.error
    FROM wanted w
    CROSS JOIN LATERAL (
        SELECT d.id, d.status AS previous_status
        FROM desktop_tasks d
        WHERE d.id = w.task_id AND d.status IN {ACTIVE_EXECUTION_SQL}
          AND (w.lease_epoch IS NULL OR d.lease_epoch = w.lease_epoch)
        OFFSET 0
        FOR UPDATE OF d
    ) d
    ORDER BY w.ord
)
UPDATE desktop_tasks d
SET status = prev.status,
    finished_at = now(),
    updated_at = now(),
    error = coalesce(prev.error, d.error),
    interrupt_reason = coalesce(prev.reason, d.interrupt_reason),
    lease_token_hash = NULL
FROM prev
WHERE d.id = prev.id
RETURNING d.id, d.monitor_task_id, d.tenant_id, d.target_client_id, d.ai_platform_id, d.lane, d.lease_epoch,
          prev.previous_status
"""

_END_ATTEMPTS = """
UPDATE desktop_task_attempts a
SET status = x.outcome, finished_at = now(), error = x.error, abort_reason = x.reason
FROM (
    SELECT p.id, w.outcome, w.error, w.reason
    FROM unnest(%(task_ids)s::uuid[], %(epochs)s::int[], %(outcomes)s::text[], %(errors)s::text[],
                %(reasons)s::text[]) AS w(task_id, lease_epoch, outcome, error, reason)
    CROSS JOIN LATERAL (
        SELECT a.id FROM desktop_task_attempts a
        WHERE a.task_id = w.task_id AND a.lease_epoch = w.lease_epoch AND a.status = 'in_progress'
        OFFSET 0
    ) p
) x
WHERE a.id = x.id
"""

# The status of an execution a move matched nothing on (Stale) or none at all (NotFound).
_STATUS = "SELECT status FROM desktop_tasks WHERE id = %(task_id)s"

# ---- the reconciler's lease jobs -------------------------------------------------------------------------------

_EXPIRED = """
SELECT id FROM desktop_tasks
WHERE kind = 'monitor' AND status = 'in_progress' AND lease_expires_at < now() AND result_received_at IS NULL
ORDER BY lease_expires_at
LIMIT %(limit)s
"""

# Re-checked under the row lock: an extend or a result that landed meanwhile wins.
_LOCK_EXPIRED = """
SELECT id, tenant_id, monitor_task_id, target_client_id, lease_epoch, interrupted_at, interrupt_generation,
       collect_request_id, lane, ai_platform_id, execution_phase
FROM desktop_tasks
WHERE id = %(id)s AND status = 'in_progress' AND lease_expires_at < now() AND result_received_at IS NULL
FOR UPDATE SKIP LOCKED
"""

_OFFLINE_QUEUED = f"""
SELECT d.id FROM desktop_tasks d JOIN desktop_clients c ON c.id = d.target_client_id
WHERE d.kind = 'monitor' AND d.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
ORDER BY d.created_at
LIMIT %(limit)s
"""

_LOCK_OFFLINE_QUEUED = f"""
SELECT d.id, d.tenant_id, d.monitor_task_id, d.target_client_id, d.lane, d.ai_platform_id, d.collect_request_id
FROM desktop_tasks d JOIN desktop_clients c ON c.id = d.target_client_id
WHERE d.id = %(id)s AND d.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
FOR UPDATE OF d SKIP LOCKED
"""

# The execution's hard interrupt timeout: its mode's (§10.5 OpenAI deep reasoning 180 s), else its platform's.
_HARD_TIMEOUT_MS = fragments.interrupt_timeout_ms_sql("hard", "d", "ps", "%(default_hard_ms)s")

_OVERDUE = f"""
d.kind = 'monitor' AND d.status = 'in_progress' AND d.result_received_at IS NULL
  AND coalesce((d.control_flags ->> 'interrupt_requested')::boolean, false)
  AND d.interrupted_at IS NOT NULL
  AND d.interrupted_at < now() - make_interval(secs => {_HARD_TIMEOUT_MS} / 1000.0)
"""

_OVERDUE_INTERRUPTS = f"""
SELECT d.id FROM desktop_tasks d LEFT JOIN platform_settings ps ON ps.ai_platform_id = d.ai_platform_id
WHERE {_OVERDUE}
ORDER BY d.interrupted_at
LIMIT %(limit)s
"""

_LOCK_OVERDUE_INTERRUPT = f"""
SELECT d.id, d.tenant_id, d.workspace_id, d.monitor_task_id, d.target_client_id, d.lease_epoch, d.lane,
       d.ai_platform_id, d.interrupt_generation, d.interrupted_at, d.execution_phase, d.control_flags,
       ({_HARD_TIMEOUT_MS})::float8 AS hard_timeout_ms,
       (extract(epoch FROM now() - d.interrupted_at) * 1000)::float8 AS overdue_ms
FROM desktop_tasks d LEFT JOIN platform_settings ps ON ps.ai_platform_id = d.ai_platform_id
WHERE d.id = %(id)s AND {_OVERDUE}
FOR UPDATE OF d SKIP LOCKED
"""

# High work (the lanes that preempt) of a client stuck on an interrupt that has not started: queued executions are
# taken back.
_QUEUED_HIGH_OF_CLIENT = f"""
SELECT id, tenant_id, monitor_task_id, target_client_id, lane, ai_platform_id, collect_request_id FROM desktop_tasks
WHERE target_client_id = %(client_id)s AND kind = 'monitor' AND status = 'queued' AND lane IN {PREEMPTING_SQL}
FOR UPDATE SKIP LOCKED
"""

# A result the hub accepted that ingest has not applied after the grace period: unknown (still active).
_MARK_UNKNOWN = """
UPDATE desktop_tasks
SET status = 'unknown', updated_at = now()
WHERE id IN (SELECT id FROM desktop_tasks
             WHERE kind = 'monitor' AND status = 'in_progress' AND result_received_at IS NOT NULL
               AND result_received_at < now() - make_interval(secs => %(grace_s)s)
             LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING id, tenant_id, monitor_task_id, target_client_id
"""

_UNKNOWN = """
SELECT id FROM desktop_tasks WHERE kind = 'monitor' AND status = 'unknown' ORDER BY updated_at LIMIT %(limit)s
"""

_LOCK_UNKNOWN = """
SELECT d.id, d.tenant_id, d.monitor_task_id, d.target_client_id, d.lease_epoch, d.lane, d.ai_platform_id,
       d.collect_request_id, d.leased_at, d.execution_phase,
       coalesce(d.lease_expires_at > now(), false) AS lease_alive
FROM desktop_tasks d
WHERE d.id = %(id)s AND d.status = 'unknown'
FOR UPDATE SKIP LOCKED
"""

# No evidence and the lease still held: back to queued on the same row (a new lease gets a new epoch) ...
_REQUEUE_UNKNOWN = """
UPDATE desktop_tasks
SET status = 'queued', lease_token_hash = NULL, leased_at = NULL, lease_expires_at = NULL,
    result_received_at = NULL, execution_phase = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'unknown'
"""

# ... and the lease's attempt is closed.
_CLOSE_REQUEUED_ATTEMPT = """
UPDATE desktop_task_attempts
SET status = 'aborted', finished_at = now(), abort_reason = 'unknown_requeued'
WHERE task_id = %(id)s AND lease_epoch = %(lease_epoch)s AND status = 'in_progress'
"""


def _one(rows: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    return rows[0][0] if rows and rows[0] else None


async def name_replacement(conn: Conn, *, replacement_id: uuid.UUID, replacement_task: int, tenant_id: int,
                           interrupted_ids: list[uuid.UUID]) -> None:
    """The interrupted work's replacement named (_NAME_REPLACEMENT), on both paths in one statement (pipelined)."""
    await conn.execute(_NAME_REPLACEMENT, {"replacement_id": replacement_id, "replacement_task": replacement_task,
                                           "tenant_id": tenant_id, "interrupted_ids": interrupted_ids})


class DesktopTaskExecutions:
    """The `Executions` protocol on `desktop_tasks` + `desktop_task_attempts` (libs/tasks/execution_paths.py)."""

    owner: Final[ExecutionOwner] = "desktop_tasks"

    # ---- dispatch (the coordinator)

    async def create(self, conn: Conn, rows: list[dict[str, Any]], *, ts: datetime) -> None:
        """The executions a dispatch pass decided, queued for their clients (in the caller's pipeline)."""
        await conn.execute(INSERT_EXECUTIONS, {"ts": ts, "rows": json_records(rows, _EXECUTION_KEYS)})

    # ---- the lease (the hub)

    async def pick(self, conn: Conn, *, client_id: uuid.UUID, tenant_id: int, max_tasks: int) -> Queued[list[Offer]]:
        cur = await conn.execute(_PICK_QUEUED, {"client_id": client_id, "tenant_id": tenant_id,
                                                "max_tasks": max_tasks})
        return queued_rows([cur], lambda rows: from_rows(rows[0], Offer))

    async def mark_leased(self, conn: Conn, task_id: uuid.UUID, *, epoch: int, token_hash: str,
                          ttl_s: float) -> Queued[Leased | Stale]:
        """queued -> in_progress with its attempt; Stale: no longer queued."""
        cur = await conn.execute(_MARK_LEASED, {"task_id": task_id, "epoch": epoch, "token_hash": token_hash,
                                                "ttl_s": ttl_s})

        def read(rows: list[list[dict[str, Any]]]) -> Leased | Stale:
            row = _one(rows)
            return Stale(task_id=task_id) if row is None else Leased(lease_expires_at=row["lease_expires_at"])
        return queued_rows([cur], read)

    async def extend(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int, client_id: uuid.UUID, epoch: int,
                     token_hash: str, ttl_s: float, phase: str | None) -> Extended | Fenced:
        """Fenced: no in_progress lease of this client at this epoch with this token."""
        cur = await conn.execute(_EXTEND_LEASE, {"task_id": task_id, "tenant_id": tenant_id, "client_id": client_id,
                                                 "epoch": epoch, "token_hash": token_hash, "ttl_s": ttl_s,
                                                 "phase": phase})
        row = await cur.fetchone()
        return Fenced(task_id=task_id) if row is None else from_row(row, Extended)

    async def lease_state(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int,
                          for_update: bool = False) -> LeaseState | NotFound:
        cur = await conn.execute(_LEASE_STATE_FOR_UPDATE if for_update else _LEASE_STATE,
                                 {"task_id": task_id, "tenant_id": tenant_id})
        row = await cur.fetchone()
        return NotFound(task_id=task_id) if row is None else from_row(row, LeaseState)

    async def claim_result(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int, epoch: int,
                           digest: str) -> ResultClaim | Stale:
        cur = await conn.execute(_CLAIM_RESULT, {"task_id": task_id, "tenant_id": tenant_id, "epoch": epoch,
                                                 "digest": digest})
        row = await cur.fetchone()
        if row is None:
            return Stale(task_id=task_id)
        return ResultClaim(previous=row["previous"], received=row["result_received_at"] is not None)

    async def release_result_claim(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int, epoch: int,
                                   digest: str) -> Done | Stale:
        cur = await conn.execute(_RELEASE_RESULT_CLAIM, {"task_id": task_id, "tenant_id": tenant_id,
                                                         "epoch": epoch, "digest": digest})
        return Done(task_id=task_id) if cur.rowcount else Stale(task_id=task_id)

    async def mark_result_received(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int,
                                   epoch: int) -> Done | Stale:
        cur = await conn.execute(_MARK_RESULT_RECEIVED, {"task_id": task_id, "tenant_id": tenant_id, "epoch": epoch})
        return Done(task_id=task_id) if cur.rowcount else Stale(task_id=task_id)

    # ---- ending

    async def end_one(self, conn: Conn, end: ExecutionEnd) -> EndedExecution | None:
        """An active execution (at `end.lease_epoch`, if given) to its terminal state, its attempt closed; None: none
        such (execution_paths.end tells Stale from NotFound)."""
        status = "aborted" if end.outcome == "expired" else end.outcome
        cur = await conn.execute(_END_EXECUTION, {"status": status, "task_id": end.task_id,
                                                  "lease_epoch": end.lease_epoch, "reason": end.reason,
                                                  "error": end.error})
        ended = ended_from_rows(await cur.fetchall())
        if not ended:
            return None
        await conn.execute(_END_ATTEMPT, {"status": end.outcome, "task_id": end.task_id,
                                          "lease_epoch": ended[0].lease_epoch, "error": end.error,
                                          "reason": end.reason, "phase": end.phase})
        return ended[0]

    async def end_many(self, conn: Conn, ends: list[ExecutionEnd]) -> list[EndedExecution]:
        """`end_one` for many (sorted by id, one per id) in two statements; the active ones come back."""
        if not ends:
            return []
        cur = await conn.execute(_END_EXECUTIONS, {
            "task_ids": [e.task_id for e in ends],
            "statuses": ["aborted" if e.outcome == "expired" else e.outcome for e in ends],
            "epochs": [e.lease_epoch for e in ends], "reasons": [e.reason for e in ends],
            "errors": [e.error for e in ends]})
        ended = ended_from_rows(await cur.fetchall())
        if ended:
            by_id = {e.task_id: e for e in ends}
            await conn.execute(_END_ATTEMPTS, {
                "task_ids": [e.task_id for e in ended], "epochs": [e.lease_epoch for e in ended],
                "outcomes": [by_id[e.task_id].outcome for e in ended],
                "errors": [by_id[e.task_id].error for e in ended],
                "reasons": [by_id[e.task_id].reason for e in ended]})
        return ended

    async def status_of(self, conn: Conn, task_id: uuid.UUID) -> str | None:
        cur = await conn.execute(_STATUS, {"task_id": task_id})
        row = await cur.fetchone()
        return None if row is None else str(row["status"])

    # ---- a click's preemption, a broken login

    async def preempt_scheduled(self, conn: Conn, *, client_id: uuid.UUID, tenant_id: int,
                                request_id: uuid.UUID) -> Queued[Preempted]:
        """The client's queued scheduled executions cancelled, its running ones asked to yield (pipelined)."""
        params = {"client_id": client_id, "tenant_id": tenant_id, "request_id": request_id}
        cancelled = await conn.execute(CANCEL_QUEUED_SCHEDULED, params)
        interrupted = await conn.execute(MARK_INTERRUPT_REQUESTED, params)
        return queued_rows([cancelled, interrupted], lambda rows: Preempted(
            cancelled=from_rows(rows[0], ScheduledWork), interrupted=from_rows(rows[1], ScheduledWork)))

    async def release_unhealthy(self, conn: Conn, client_ids: list[uuid.UUID]) -> list[ReleasedWork]:
        cur = await conn.execute(_RELEASE_QUEUED_OF_PLATFORM, {"client_ids": client_ids})
        return from_rows(await cur.fetchall(), ReleasedWork)

    # ---- the reconciler's lease jobs

    async def expired(self, conn: Conn, *, limit: int) -> list[uuid.UUID]:
        cur = await conn.execute(_EXPIRED, {"limit": limit})
        return [row["id"] for row in await cur.fetchall()]

    async def lock_expired(self, conn: Conn, task_id: uuid.UUID) -> ExpiringLease | Stale:
        """Stale: extended, ended, resulted or locked by another writer meanwhile."""
        cur = await conn.execute(_LOCK_EXPIRED, {"id": task_id})
        row = await cur.fetchone()
        return Stale(task_id=task_id) if row is None else from_row(row, ExpiringLease)

    async def offline_queued(self, conn: Conn, *, timeout_s: float, limit: int) -> list[uuid.UUID]:
        cur = await conn.execute(_OFFLINE_QUEUED, {"timeout_s": timeout_s, "limit": limit})
        return [row["id"] for row in await cur.fetchall()]

    async def lock_offline_queued(self, conn: Conn, task_id: uuid.UUID, *, timeout_s: float) -> QueuedWork | Stale:
        cur = await conn.execute(_LOCK_OFFLINE_QUEUED, {"id": task_id, "timeout_s": timeout_s})
        row = await cur.fetchone()
        return Stale(task_id=task_id) if row is None else from_row(row, QueuedWork)

    async def overdue_interrupts(self, conn: Conn, *, default_hard_ms: int, limit: int) -> list[uuid.UUID]:
        cur = await conn.execute(_OVERDUE_INTERRUPTS, {"default_hard_ms": default_hard_ms, "limit": limit})
        return [row["id"] for row in await cur.fetchall()]

    async def lock_overdue_interrupt(self, conn: Conn, task_id: uuid.UUID, *,
                                     default_hard_ms: int) -> OverdueInterrupt | Stale:
        cur = await conn.execute(_LOCK_OVERDUE_INTERRUPT, {"id": task_id, "default_hard_ms": default_hard_ms})
        row = await cur.fetchone()
        return Stale(task_id=task_id) if row is None else from_row(row, OverdueInterrupt)

    async def queued_high_of_client(self, conn: Conn, client_id: uuid.UUID) -> list[QueuedWork]:
        cur = await conn.execute(_QUEUED_HIGH_OF_CLIENT, {"client_id": client_id})
        return from_rows(await cur.fetchall(), QueuedWork)

    async def mark_unknown(self, conn: Conn, *, grace_s: float, limit: int) -> list[UnknownMarked]:
        cur = await conn.execute(_MARK_UNKNOWN, {"grace_s": grace_s, "limit": limit})
        return from_rows(await cur.fetchall(), UnknownMarked)

    async def unknown(self, conn: Conn, *, limit: int) -> list[uuid.UUID]:
        cur = await conn.execute(_UNKNOWN, {"limit": limit})
        return [row["id"] for row in await cur.fetchall()]

    async def lock_unknown(self, conn: Conn, task_id: uuid.UUID) -> UnknownExecution | Stale:
        cur = await conn.execute(_LOCK_UNKNOWN, {"id": task_id})
        row = await cur.fetchone()
        return Stale(task_id=task_id) if row is None else from_row(row, UnknownExecution)

    async def requeue_unknown(self, conn: Conn, task_id: uuid.UUID, *, lease_epoch: int) -> Done | Stale:
        """unknown -> queued on the same row, the lease's attempt closed; Stale: not unknown."""
        cur = await conn.execute(_REQUEUE_UNKNOWN, {"id": task_id})
        if not cur.rowcount:
            return Stale(task_id=task_id)
        await conn.execute(_CLOSE_REQUEUED_ATTEMPT, {"id": task_id, "lease_epoch": lease_epoch})
        return Done(task_id=task_id)
