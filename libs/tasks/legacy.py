"""The legacy (Phase 1) execution path: a lease on the business row itself (docs/legacy-path.md).

A business task with `execution_owner = 'legacy'` is never given a `desktop_tasks` execution. The coordinator
*offers* it to a client (`offer`: the business row goes `pending -> leased` with `leased_to_executor` and
`legacy_lease_id` set, and a `legacy_leases` row records the offer), and the same `task_available` event tells the
client as for any other work. The client pulls it with the same lease call (`_MARK_LEASED`: the token's hash,
`leased_at` and `lease_expires_at` on the business row), extends and cancels it with the same calls, and posts its
result (`_MARK_RESULT_RECEIVED`: `leased -> received`). Ingest ends it (`end_leases`): the business row goes back to
`pending` with every lease column cleared, in the same statement, and the shared business transitions of
`libs.tasks.transitions` (complete, retry, yield) apply to it exactly as to desktop_tasks work.

The business row is the authority on who holds the lease (`legacy_lease_id`, `lease_token_hash`); `legacy_leases` is
its history (one row per offer: the client, the lane, how it ended) and what the budget ledger counts (migration 023).
Its columns carry desktop_tasks' names, so a lease state read from either table looks the same to the hub.

`LegacyExecutions` (at the end) is this path's implementation of the `Executions` protocol
(libs/tasks/execution_paths.py): every statement here is run by one of its operations and by nothing else. The SQL is
module constants, private (`_NAME`) unless a module that has not moved behind the store yet still reads it (named at
the constant). Every operation runs in the caller's transaction.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Final

from libs.db.pool import Conn, json_records
from libs.domain.lanes import PREEMPTIBLE_SQL
from libs.tasks import fragments
from libs.tasks.fragments import (
    BLOCKED_PLATFORMS_OF_CLIENTS_SQL,
    CLIENT_GENERATION_SQL,
    HELD_LANES_SQL,
    held_for_broken_login_sql,
    platform_mode_sql,
)
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
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, ACTIVE_LEASE_SQL, CLEAR_LEGACY_LEASE_SQL

# ---- coordinator: the offer -----------------------------------------------------------------------------------

# Offers decided by a dispatch pass, as named rows (the pass's claimed rows, see dispatcher._still_dispatchable):
# the history row, and the business row leased to the client (still without a token: the client pulls it).
_OFFER = """
WITH o AS MATERIALIZED (
    SELECT * FROM json_to_recordset(%(rows)s::json) AS r(
        id uuid, monitor_task_id bigint, tenant_id bigint, workspace_id bigint, target_client_id uuid,
        ai_platform_id bigint, brand_id bigint, question_id bigint, business_date date, lane text, lane_weight int,
        priority int, interrupt_generation bigint, collect_request_id uuid, enqueued_at timestamptz)
), offered AS (
    INSERT INTO legacy_leases (id, monitor_task_id, tenant_id, workspace_id, target_client_id, ai_platform_id,
                               brand_id, question_id, business_date, lane, lane_weight, priority,
                               interrupt_generation, collect_request_id, enqueued_at, created_at, updated_at)
    SELECT o.id, o.monitor_task_id, o.tenant_id, o.workspace_id, o.target_client_id, o.ai_platform_id, o.brand_id,
           o.question_id, o.business_date, o.lane, o.lane_weight, o.priority, o.interrupt_generation,
           o.collect_request_id, o.enqueued_at, %(ts)s, %(ts)s
    FROM o
)
UPDATE monitoring_collect_tasks t
SET status = 'leased', leased_to_executor = o.target_client_id, legacy_lease_id = o.id, lease_token_hash = NULL,
    leased_at = NULL, lease_expires_at = NULL, updated_at = now()
FROM o
WHERE t.id = o.monitor_task_id AND t.status = 'pending' AND t.execution_owner = 'legacy'
"""

_OFFER_KEYS = ("id", "monitor_task_id", "tenant_id", "workspace_id", "target_client_id", "ai_platform_id",
               "brand_id", "question_id", "business_date", "lane", "lane_weight", "priority", "interrupt_generation",
               "collect_request_id", "enqueued_at")


async def offer(conn: Conn, rows: list[dict[str, Any]], *, ts: datetime) -> None:
    """Offer claimed legacy business tasks to the clients a pass chose (queued in the caller's pipeline):
    `LegacyExecutions.create`."""
    await conn.execute(_OFFER, {"rows": json_records(rows, _OFFER_KEYS), "ts": ts})


# ---- hub: lease, extend, result ----------------------------------------------------------------------------------

# The client's offers in dispatch order (the same order as its queued executions), as many as the call asks for (the
# hub merges them with the queued executions and leases what the client's free slots take). Normal work of a platform
# the client reports a broken login on stays where it is (the heartbeat flush withdraws it:
# _RELEASE_OFFERS_OF_PLATFORM).
_PICK_OFFERS = f"""
SELECT l.id, l.monitor_task_id, l.lane, l.lane_weight, l.priority, l.lease_epoch, l.interrupt_generation,
       l.business_date, l.tenant_id, l.ai_platform_id, l.collect_request_id, l.control_flags, l.enqueued_at,
       b.id AS brand_id, b.name AS brand_name, q.id AS question_id, q.text AS question_text,
       p.code AS platform_code, {platform_mode_sql("l.monitor_task_id")} AS platform_mode,
       'legacy' AS execution_owner
FROM legacy_leases l
JOIN brands b ON b.id = l.brand_id
JOIN monitoring_questions q ON q.id = l.question_id
JOIN ai_platforms p ON p.id = l.ai_platform_id
WHERE l.target_client_id = %(client_id)s AND l.tenant_id = %(tenant_id)s AND l.status = 'queued'
  AND NOT {held_for_broken_login_sql("l", "p.code")}
ORDER BY l.lane_weight DESC, l.priority DESC, l.enqueued_at ASC
LIMIT %(max_tasks)s
FOR UPDATE OF l SKIP LOCKED
"""

# The pull: the history row in progress, the business row's lease set (the authority the fence checks).
_MARK_LEASED = """
WITH leased AS (
    UPDATE legacy_leases
    SET status = 'in_progress', lease_epoch = %(epoch)s, lease_token_hash = %(token_hash)s, leased_at = now(),
        execution_phase = 'PREPARING', updated_at = now()
    WHERE id = %(task_id)s AND status = 'queued'
    RETURNING id, monitor_task_id
)
UPDATE monitoring_collect_tasks t
SET lease_token_hash = %(token_hash)s, leased_at = now(),
    lease_expires_at = now() + make_interval(secs => %(ttl_s)s), updated_at = now()
FROM leased
WHERE t.id = leased.monitor_task_id AND t.legacy_lease_id = leased.id AND t.status = 'leased'
RETURNING t.lease_expires_at
"""

# A lease's state with desktop_tasks' column names (services/dispatch_hub/leases.py reads either). A lease the
# business row no longer points at is over, whatever its history row says.
_LEASE_STATE = """
SELECT l.id, l.target_client_id,
       CASE WHEN l.status = 'in_progress' AND t.legacy_lease_id IS DISTINCT FROM l.id THEN 'aborted'
            ELSE l.status END AS status,
       l.lease_epoch, l.lease_token_hash, l.interrupt_generation, l.control_flags, l.monitor_task_id, l.tenant_id,
       l.workspace_id, l.ai_platform_id, l.lane, l.kind, l.collect_request_id, l.brand_id, l.question_id,
       l.business_date, l.interrupt_reason, l.result_digest, l.result_received_at, l.execution_phase,
       'legacy' AS execution_owner
FROM legacy_leases l JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id
WHERE l.id = %(task_id)s AND l.tenant_id = %(tenant_id)s
"""

# Lock order on this path, as on the other: the business row first, then the lease's row (ingest locks the business
# rows of its batch before it ends their leases). A writer that starts from a lease id locks the business row with
# _LOCK_BUSINESS_ROW first; _LEASE_STATE_FOR_UPDATE then locks the lease row.
_LOCK_BUSINESS_ROW = """
SELECT t.id FROM monitoring_collect_tasks t
WHERE t.id = (SELECT l.monitor_task_id FROM legacy_leases l WHERE l.id = %(task_id)s AND l.tenant_id = %(tenant_id)s)
FOR UPDATE OF t
"""
_LEASE_STATE_FOR_UPDATE = f"{_LEASE_STATE} FOR UPDATE OF l"

# Extend: the fence (the business row's holder and token) and the extension in one statement.
_EXTEND = """
WITH ext AS (
    UPDATE monitoring_collect_tasks t
    SET lease_expires_at = now() + make_interval(secs => %(ttl_s)s), updated_at = now()
    FROM legacy_leases l
    WHERE l.id = %(task_id)s AND l.tenant_id = %(tenant_id)s AND l.target_client_id = %(client_id)s
      AND l.status = 'in_progress' AND l.lease_epoch = %(epoch)s
      AND t.id = l.monitor_task_id AND t.legacy_lease_id = l.id AND t.status = 'leased'
      AND t.leased_to_executor = %(client_id)s AND t.lease_token_hash = %(token_hash)s
    RETURNING t.lease_expires_at, l.id
)
UPDATE legacy_leases l
SET execution_phase = coalesce(%(phase)s::text, l.execution_phase), updated_at = now()
FROM ext
WHERE l.id = ext.id
RETURNING ext.lease_expires_at, l.interrupt_generation, l.control_flags, l.ai_platform_id, 'legacy' AS execution_owner
"""

_CLAIM_RESULT = claim_result("legacy_leases")

_RELEASE_RESULT_CLAIM = release_result_claim("legacy_leases")

# The result is on its way to ingest: the business row `received` (first, the lock order above), then the lease's
# row, whose slot is free again. Two statements in one transaction. Ingest may have ended the lease already (it
# read the result first): then the business row is left alone.
_MARK_BUSINESS_RECEIVED = """
UPDATE monitoring_collect_tasks t SET status = 'received', updated_at = now()
WHERE t.id = (SELECT l.monitor_task_id FROM legacy_leases l
              WHERE l.id = %(task_id)s AND l.tenant_id = %(tenant_id)s AND l.lease_epoch = %(epoch)s)
  AND t.legacy_lease_id = %(task_id)s AND t.status = 'leased'
"""
_MARK_RESULT_RECEIVED = """
UPDATE legacy_leases SET result_received_at = now(), execution_phase = 'POSTING', updated_at = now()
WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND lease_epoch = %(epoch)s
"""

# ---- ending a lease (every path: ingest, cancel, reconciler, collect-now, rollback) ------------------------------

# Like executions._END_EXECUTIONS: the live leases among `task_ids` end with their outcome, and their business rows
# go back to `pending` with the lease cleared (the caller then completes, retries or yields them). Rows are locked
# in id order.
_END_LEASES = f"""
WITH wanted AS MATERIALIZED (
    SELECT * FROM unnest(%(task_ids)s::uuid[], %(statuses)s::text[], %(epochs)s::int[], %(reasons)s::text[],
                         %(errors)s::text[]) AS w(task_id, status, lease_epoch, reason, error)
), prev AS MATERIALIZED (
    SELECT l.id, l.previous_status, w.status, w.reason, w.error
    FROM wanted w
    CROSS JOIN LATERAL (
        SELECT l.id, l.status AS previous_status FROM legacy_leases l
        WHERE l.id = w.task_id AND l.status IN {ACTIVE_LEASE_SQL}
          AND (w.lease_epoch IS NULL OR l.lease_epoch = w.lease_epoch)
        OFFSET 0
        FOR UPDATE OF l
    ) l
    ORDER BY l.id
), ended AS (
    UPDATE legacy_leases l
    SET status = prev.status, finished_at = now(), updated_at = now(), error = coalesce(prev.error, l.error),
        interrupt_reason = coalesce(prev.reason, l.interrupt_reason), lease_token_hash = NULL
    FROM prev
    WHERE l.id = prev.id
    RETURNING l.id, l.monitor_task_id, l.tenant_id, l.target_client_id, l.ai_platform_id, l.lane, l.lease_epoch,
              prev.previous_status
), released AS (
    UPDATE monitoring_collect_tasks t
    SET status = 'pending', {CLEAR_LEGACY_LEASE_SQL}, updated_at = now()
    FROM ended
    WHERE t.id = ended.monitor_task_id AND t.legacy_lease_id = ended.id AND t.status IN ('leased', 'received')
)
SELECT * FROM ended
"""

# ---- consistency between the paths (the reconciler's 16.2.4 check, the coordinator's start-up check) -------------

# Live work on the path a task is not owned by: a live legacy lease on a desktop_tasks-owned task, an active execution
# on a legacy-owned one. Neither path creates these (each dispatches only its own owner's pending tasks, and a task
# changes owner only when pending without live work); one found is for a human. PATH_MISMATCHES, IN_FLIGHT_BY_PATH and
# CLEAR_ZOMBIE_LEASES are public only for the coordinator and the migration job, which have not moved behind the
# store yet (services/dispatch_coordinator/{coordinator,queries}.py, services/reconciler/jobs/migration.py).
PATH_MISMATCHES = f"""
SELECT t.id, t.tenant_id, t.status, t.execution_owner, t.dispatch_attempts, t.business_date,
       'live legacy lease on a desktop_tasks-owned task' AS problem
FROM legacy_leases l JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id
WHERE l.status IN {ACTIVE_LEASE_SQL} AND t.execution_owner = 'desktop_tasks'
UNION ALL
SELECT t.id, t.tenant_id, t.status, t.execution_owner, t.dispatch_attempts, t.business_date,
       'active execution on a legacy-owned task'
FROM desktop_tasks d JOIN monitoring_collect_tasks t ON t.id = d.monitor_task_id
WHERE d.kind = 'monitor' AND d.status IN {ACTIVE_EXECUTION_SQL} AND t.execution_owner = 'legacy'
"""

# Work in flight per path: active executions, live legacy leases (offered and pulled).
IN_FLIGHT_BY_PATH = f"""
SELECT (SELECT count(*) FROM desktop_tasks WHERE kind = 'monitor' AND status IN {ACTIVE_EXECUTION_SQL})
           AS desktop_tasks,
       (SELECT count(*) FROM legacy_leases WHERE status IN {ACTIVE_LEASE_SQL}) AS legacy
"""


# Offers withdrawn before they were pulled (a statement's `withdrawn` rows): their business rows are pending again,
# their lease columns cleared and their dispatch attempt given back.
_RELEASE_WITHDRAWN = f"""released AS (
    UPDATE monitoring_collect_tasks t
    SET status = 'pending', {CLEAR_LEGACY_LEASE_SQL},
        dispatch_attempts = greatest(t.dispatch_attempts - 1, 0), updated_at = now()
    FROM withdrawn w
    WHERE t.id = w.monitor_task_id AND t.legacy_lease_id = w.id AND t.status = 'leased'
)"""


# A click's two steps (executions.CANCEL_QUEUED_SCHEDULED, MARK_INTERRUPT_REQUESTED) on the legacy path (Phase 1,
# docs/legacy-path.md). The client's offers of scheduled work it has not pulled yet are withdrawn (the twin of
# CANCEL_QUEUED_SCHEDULED: the offer ends aborted at epoch 0, so its budget is given back; the business row is
# pending again with its dispatch attempt back) ... (WITHDRAW_SCHEDULED_OFFERS and INTERRUPT_SCHEDULED_LEASES are
# public only for collect-now's warm-up list, services/collect_now_api/queries.py.)
WITHDRAW_SCHEDULED_OFFERS = f"""
WITH g AS (SELECT {CLIENT_GENERATION_SQL} AS gen),
withdrawn AS (
    UPDATE legacy_leases
    SET status = 'aborted', finished_at = now(), updated_at = now(), interrupt_reason = 'collect_now_preempt',
        interrupt_generation = g.gen,
        control_flags = control_flags || jsonb_build_object('cancelled', true, 'interrupt_generation', g.gen,
                                                            'collect_request_id', %(request_id)s::text)
    FROM g
    WHERE target_client_id = %(client_id)s AND tenant_id = %(tenant_id)s AND status = 'queued'
      AND lane IN {PREEMPTIBLE_SQL}
    RETURNING id, monitor_task_id, ai_platform_id, lane
), {_RELEASE_WITHDRAWN}
SELECT * FROM withdrawn
"""


# ... and its pulled leases of scheduled work are told to yield, without clearing them here: the client cancels only
# while PREPARING or NAVIGATING, and otherwise finishes the task (the lease then ends as any other).
INTERRUPT_SCHEDULED_LEASES = f"""
WITH g AS (SELECT {CLIENT_GENERATION_SQL} AS gen)
UPDATE legacy_leases
SET control_flags = control_flags || jsonb_build_object('interrupt_requested', true,
                                                        'interrupt_generation', g.gen,
                                                        'collect_request_id', %(request_id)s::text),
    interrupt_generation = g.gen, interrupt_reason = 'collect_now_preempt', updated_at = now()
FROM g
WHERE target_client_id = %(client_id)s AND tenant_id = %(tenant_id)s AND status = 'in_progress'
  AND lane IN {PREEMPTIBLE_SQL} AND result_received_at IS NULL AND interrupt_generation < g.gen
RETURNING id, monitor_task_id, ai_platform_id, lane
"""


# The platform-health pause at the hub, on this path (the twin of executions._RELEASE_QUEUED_OF_PLATFORM): the offers
# of held lanes (normal, boosted, retry) not pulled yet by one of the clients %(client_ids)s, of a platform it now
# reports a broken login on (unless the tenant's override ignores health), are withdrawn: the offer ends aborted with
# reason platform_unhealthy, the business row is pending again with its lease cleared and its dispatch attempt back.
# Offers locked in id order, before their business rows (as the lease call does: _PICK_OFFERS, _MARK_LEASED).
_RELEASE_OFFERS_OF_PLATFORM = f"""
WITH blocked AS MATERIALIZED ({BLOCKED_PLATFORMS_OF_CLIENTS_SQL}),
locked AS (
    SELECT l.id FROM legacy_leases l JOIN blocked b
      ON l.target_client_id = b.client_id AND l.tenant_id = b.tenant_id AND l.ai_platform_id = b.ai_platform_id
    WHERE l.status = 'queued' AND l.lane IN {HELD_LANES_SQL}
    ORDER BY l.id
    FOR UPDATE OF l
), withdrawn AS (
    UPDATE legacy_leases l
    SET status = 'aborted', finished_at = now(), updated_at = now(), interrupt_reason = 'platform_unhealthy'
    FROM locked
    WHERE l.id = locked.id AND l.status = 'queued'
    RETURNING l.id, l.monitor_task_id, l.tenant_id, l.target_client_id, l.ai_platform_id, l.lane,
              l.interrupt_generation, l.collect_request_id
), {_RELEASE_WITHDRAWN}
SELECT * FROM withdrawn ORDER BY target_client_id, id
"""


# The reconciler's consistency check: legacy lease columns no live legacy lease backs (or on a desktop_tasks-owned
# row) are cleared; a leased / received row goes back to pending.
CLEAR_ZOMBIE_LEASES = f"""
UPDATE monitoring_collect_tasks t
SET status = CASE WHEN t.status IN ('leased', 'received') THEN 'pending' ELSE t.status END,
    {CLEAR_LEGACY_LEASE_SQL}, updated_at = now()
WHERE (t.leased_to_executor IS NOT NULL OR t.legacy_lease_id IS NOT NULL OR t.status IN ('leased', 'received'))
  AND (t.execution_owner = 'desktop_tasks'
       OR NOT EXISTS (SELECT 1 FROM legacy_leases l
                      WHERE l.id = t.legacy_lease_id AND l.status IN ('queued', 'in_progress')))
RETURNING t.id, t.tenant_id, t.execution_owner, t.leased_to_executor
"""


# The status of a lease a move matched nothing on (Stale) or none at all (NotFound).
_STATUS = "SELECT status FROM legacy_leases WHERE id = %(task_id)s"

# ---- the reconciler's lease jobs -------------------------------------------------------------------------------

# Pulled leases past their expiry (on the business row) without a result.
_EXPIRED = """
SELECT l.id FROM monitoring_collect_tasks t JOIN legacy_leases l ON l.id = t.legacy_lease_id
WHERE t.status = 'leased' AND t.execution_owner = 'legacy' AND t.lease_expires_at < now()
  AND l.status = 'in_progress' AND l.result_received_at IS NULL
ORDER BY t.lease_expires_at
LIMIT %(limit)s
"""

# Re-checked under the row locks (the business row first: the lock order above): an extend or a result that landed
# meanwhile wins.
_LOCK_EXPIRED_BUSINESS = """
SELECT t.id FROM monitoring_collect_tasks t
WHERE t.id = (SELECT l.monitor_task_id FROM legacy_leases l WHERE l.id = %(id)s) AND t.status = 'leased'
FOR UPDATE OF t SKIP LOCKED
"""
_LOCK_EXPIRED = """
SELECT l.id, l.tenant_id, l.monitor_task_id, l.target_client_id, l.lease_epoch,
       CASE WHEN (l.control_flags ->> 'interrupt_requested') = 'true' THEN l.updated_at END AS interrupted_at,
       l.interrupt_generation, l.collect_request_id, l.lane, l.ai_platform_id, l.execution_phase
FROM legacy_leases l JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id AND t.legacy_lease_id = l.id
WHERE l.id = %(id)s AND l.status = 'in_progress' AND l.result_received_at IS NULL AND t.status = 'leased'
  AND t.lease_expires_at < now()
FOR UPDATE OF l SKIP LOCKED
"""

# Offers (not pulled) to a client without a fresh heartbeat, or disabled.
_OFFLINE_QUEUED = f"""
SELECT l.id FROM legacy_leases l JOIN desktop_clients c ON c.id = l.target_client_id
WHERE l.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
ORDER BY l.created_at
LIMIT %(limit)s
"""

_LOCK_OFFLINE_QUEUED = f"""
SELECT l.id, l.tenant_id, l.monitor_task_id, l.target_client_id, l.lane, l.ai_platform_id, l.collect_request_id
FROM legacy_leases l JOIN desktop_clients c ON c.id = l.target_client_id
WHERE l.id = %(id)s AND l.status = 'queued' AND ({fragments.STALE_CLIENT_SQL} OR c.disabled_at IS NOT NULL)
FOR UPDATE OF l SKIP LOCKED
"""


class LegacyExecutions:
    """The `Executions` protocol on `legacy_leases` and the lease columns of the business row
    (libs/tasks/execution_paths.py). Phase 1 has no `unknown` state and no forced interrupt: those operations answer
    nothing on this path."""

    owner: Final[ExecutionOwner] = "legacy"

    # ---- dispatch (the coordinator)

    async def create(self, conn: Conn, rows: list[dict[str, Any]], *, ts: datetime) -> None:
        """The offers a dispatch pass decided (in the caller's pipeline)."""
        await offer(conn, rows, ts=ts)

    # ---- the lease (the hub)

    async def pick(self, conn: Conn, *, client_id: uuid.UUID, tenant_id: int, max_tasks: int) -> Queued[list[Offer]]:
        cur = await conn.execute(_PICK_OFFERS, {"client_id": client_id, "tenant_id": tenant_id,
                                                "max_tasks": max_tasks})
        return queued_rows([cur], lambda rows: from_rows(rows[0], Offer))

    async def mark_leased(self, conn: Conn, task_id: uuid.UUID, *, epoch: int, token_hash: str,
                          ttl_s: float) -> Queued[Leased | Stale]:
        """The offer pulled (queued -> in_progress, the business row's lease set); Stale: no longer offered."""
        cur = await conn.execute(_MARK_LEASED, {"task_id": task_id, "epoch": epoch, "token_hash": token_hash,
                                                "ttl_s": ttl_s})

        def read(rows: list[list[dict[str, Any]]]) -> Leased | Stale:
            row = rows[0][0] if rows[0] else None
            return Stale(task_id=task_id) if row is None else Leased(lease_expires_at=row["lease_expires_at"])
        return queued_rows([cur], read)

    async def extend(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int, client_id: uuid.UUID, epoch: int,
                     token_hash: str, ttl_s: float, phase: str | None) -> Extended | Fenced:
        """Fenced: the business row's holder and token are not this client's at this epoch."""
        cur = await conn.execute(_EXTEND, {"task_id": task_id, "tenant_id": tenant_id, "client_id": client_id,
                                           "epoch": epoch, "token_hash": token_hash, "ttl_s": ttl_s, "phase": phase})
        row = await cur.fetchone()
        return Fenced(task_id=task_id) if row is None else from_row(row, Extended)

    async def lease_state(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int,
                          for_update: bool = False) -> LeaseState | NotFound:
        params = {"task_id": task_id, "tenant_id": tenant_id}
        if for_update:  # the business row first (the lock order above)
            await conn.execute(_LOCK_BUSINESS_ROW, params)
        cur = await conn.execute(_LEASE_STATE_FOR_UPDATE if for_update else _LEASE_STATE, params)
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
        """The business row `received` (if ingest has not ended the lease already), then the lease's row."""
        params = {"task_id": task_id, "tenant_id": tenant_id, "epoch": epoch}
        async with conn.transaction():
            await conn.execute(_MARK_BUSINESS_RECEIVED, params)
            cur = await conn.execute(_MARK_RESULT_RECEIVED, params)
        return Done(task_id=task_id) if cur.rowcount else Stale(task_id=task_id)

    # ---- ending

    async def end_one(self, conn: Conn, end: ExecutionEnd) -> EndedExecution | None:
        ended = await self.end_many(conn, [end])
        return ended[0] if ended else None

    async def end_many(self, conn: Conn, ends: list[ExecutionEnd]) -> list[EndedExecution]:
        """The live leases among `ends` (sorted by id) ended, their business rows pending again with the lease
        cleared."""
        if not ends:
            return []
        cur = await conn.execute(_END_LEASES, {
            "task_ids": [e.task_id for e in ends], "statuses": [e.outcome for e in ends],
            "epochs": [e.lease_epoch for e in ends], "reasons": [e.reason for e in ends],
            "errors": [e.error for e in ends]})
        return ended_from_rows(await cur.fetchall())

    async def status_of(self, conn: Conn, task_id: uuid.UUID) -> str | None:
        cur = await conn.execute(_STATUS, {"task_id": task_id})
        row = await cur.fetchone()
        return None if row is None else str(row["status"])

    # ---- a click's preemption, a broken login

    async def preempt_scheduled(self, conn: Conn, *, client_id: uuid.UUID, tenant_id: int,
                                request_id: uuid.UUID) -> Queued[Preempted]:
        """The client's offers of scheduled work withdrawn, its pulled ones asked to yield (pipelined)."""
        params = {"client_id": client_id, "tenant_id": tenant_id, "request_id": request_id}
        withdrawn = await conn.execute(WITHDRAW_SCHEDULED_OFFERS, params)
        interrupted = await conn.execute(INTERRUPT_SCHEDULED_LEASES, params)
        return queued_rows([withdrawn, interrupted], lambda rows: Preempted(
            cancelled=from_rows(rows[0], ScheduledWork), interrupted=from_rows(rows[1], ScheduledWork)))

    async def release_unhealthy(self, conn: Conn, client_ids: list[uuid.UUID]) -> list[ReleasedWork]:
        cur = await conn.execute(_RELEASE_OFFERS_OF_PLATFORM, {"client_ids": client_ids})
        return from_rows(await cur.fetchall(), ReleasedWork)

    # ---- the reconciler's lease jobs

    async def expired(self, conn: Conn, *, limit: int) -> list[uuid.UUID]:
        cur = await conn.execute(_EXPIRED, {"limit": limit})
        return [row["id"] for row in await cur.fetchall()]

    async def lock_expired(self, conn: Conn, task_id: uuid.UUID) -> ExpiringLease | Stale:
        cur = await conn.execute(_LOCK_EXPIRED_BUSINESS, {"id": task_id})
        if await cur.fetchone() is None:
            return Stale(task_id=task_id)
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
        return []  # Phase 1: a pulled lease that does not yield finishes its task (docs/legacy-path.md)

    async def lock_overdue_interrupt(self, conn: Conn, task_id: uuid.UUID, *,
                                     default_hard_ms: int) -> OverdueInterrupt | Stale:
        return Stale(task_id=task_id)

    async def queued_high_of_client(self, conn: Conn, client_id: uuid.UUID) -> list[QueuedWork]:
        return []  # a legacy offer is pulled or withdrawn as a whole (offline_queued, preempt_scheduled)

    async def mark_unknown(self, conn: Conn, *, grace_s: float, limit: int) -> list[UnknownMarked]:
        return []  # no `unknown` state: a result never applied is the migration job's (result_not_applied)

    async def unknown(self, conn: Conn, *, limit: int) -> list[uuid.UUID]:
        return []

    async def lock_unknown(self, conn: Conn, task_id: uuid.UUID) -> UnknownExecution | Stale:
        return Stale(task_id=task_id)

    async def requeue_unknown(self, conn: Conn, task_id: uuid.UUID, *, lease_epoch: int) -> Done | Stale:
        return Stale(task_id=task_id)
