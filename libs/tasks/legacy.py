"""The legacy (Phase 1) execution path: a lease on the business row itself (docs/legacy-path.md).

A business task with `execution_owner = 'legacy'` is never given a `desktop_tasks` execution. The coordinator
*offers* it to a client (`offer`: the business row goes `pending -> leased` with `leased_to_executor` and
`legacy_lease_id` set, and a `legacy_leases` row records the offer), and the same `task_available` event tells the
client as for any other work. The client pulls it with the same lease call (`MARK_LEASED`: the token's hash,
`leased_at` and `lease_expires_at` on the business row), extends and cancels it with the same calls, and posts its
result (`MARK_RESULT_RECEIVED`: `leased -> received`). Ingest ends it (`end_leases`): the business row goes back to
`pending` with every lease column cleared, in the same statement, and the shared business transitions of
`libs.tasks.transitions` (complete, retry, yield) apply to it exactly as to desktop_tasks work.

The business row is the authority on who holds the lease (`legacy_lease_id`, `lease_token_hash`); `legacy_leases` is
its history (one row per offer: the client, the lane, how it ended) and what the budget ledger counts (migration 023).
Its columns carry desktop_tasks' names, so a lease state read from either table looks the same to the hub.

Every function runs in the caller's transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from libs.db.pool import Conn, json_records
from libs.tasks.fragments import (
    BLOCKED_PLATFORMS_OF_CLIENTS_SQL,
    CLIENT_GENERATION_SQL,
    HELD_LANES_SQL,
    held_for_broken_login_sql,
    platform_mode_sql,
)
from libs.tasks.result_claims import claim_result, release_result_claim
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, ACTIVE_LEASE_SQL, CLEAR_LEGACY_LEASE_SQL

# ---- coordinator: the offer -----------------------------------------------------------------------------------

# Offers decided by a dispatch pass, as named rows (the pass's claimed rows, see dispatcher._still_dispatchable):
# the history row, and the business row leased to the client (still without a token: the client pulls it).
OFFER = """
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
    """Offer claimed legacy business tasks to the clients a pass chose (queued in the caller's pipeline)."""
    await conn.execute(OFFER, {"rows": json_records(rows, _OFFER_KEYS), "ts": ts})


# ---- hub: lease, extend, result ----------------------------------------------------------------------------------

# A client's legacy leases that take a slot: pulled and without a posted result.
IN_PROGRESS_OF_CLIENT = """(
    SELECT count(*) FROM legacy_leases l
    WHERE l.target_client_id = c.id AND l.status = 'in_progress' AND l.result_received_at IS NULL)"""

# The client's offers in dispatch order (the same order as its queued executions), as many as the call asks for (the
# hub merges them with the queued executions and leases what the client's free slots take). Normal work of a platform
# the client reports a broken login on stays where it is (the heartbeat flush withdraws it: RELEASE_OFFERS_OF_PLATFORM).
PICK_OFFERS = f"""
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
MARK_LEASED = """
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
LEASE_STATE = """
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
# LOCK_BUSINESS_ROW first; LEASE_STATE_FOR_UPDATE then locks the lease row.
LOCK_BUSINESS_ROW = """
SELECT t.id FROM monitoring_collect_tasks t
WHERE t.id = (SELECT l.monitor_task_id FROM legacy_leases l WHERE l.id = %(task_id)s AND l.tenant_id = %(tenant_id)s)
FOR UPDATE OF t
"""
LEASE_STATE_FOR_UPDATE = f"{LEASE_STATE} FOR UPDATE OF l"

# Extend: the fence (the business row's holder and token) and the extension in one statement.
EXTEND = """
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
RETURNING ext.lease_expires_at, l.interrupt_generation, l.control_flags, l.ai_platform_id
"""

CLAIM_RESULT = claim_result("legacy_leases")

RELEASE_RESULT_CLAIM = release_result_claim("legacy_leases")

# The result is on its way to ingest: the business row `received` (first, the lock order above), then the lease's
# row, whose slot is free again. Two statements in one transaction. Ingest may have ended the lease already (it
# read the result first): then the business row is left alone.
MARK_BUSINESS_RECEIVED = """
UPDATE monitoring_collect_tasks t SET status = 'received', updated_at = now()
WHERE t.id = (SELECT l.monitor_task_id FROM legacy_leases l
              WHERE l.id = %(task_id)s AND l.tenant_id = %(tenant_id)s AND l.lease_epoch = %(epoch)s)
  AND t.legacy_lease_id = %(task_id)s AND t.status = 'leased'
"""
MARK_RESULT_RECEIVED = """
UPDATE legacy_leases SET result_received_at = now(), execution_phase = 'POSTING', updated_at = now()
WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND lease_epoch = %(epoch)s
"""

# ---- ending a lease (every path: ingest, cancel, reconciler, collect-now, rollback) ------------------------------

# Like transitions._END_EXECUTIONS: the live leases among `task_ids` end with their outcome, and their business rows
# go back to `pending` with the lease cleared (the caller then completes, retries or yields them). Rows are locked
# in id order.
END_LEASES = f"""
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

# ---- collect-now: Phase-1 preemption -------------------------------------------------------------------------

# A client's offers not pulled yet, of lanes a click withdraws (normal work, when the client is to run high work).
OFFERS_OF_CLIENT = """
SELECT l.id, l.monitor_task_id, l.tenant_id, l.ai_platform_id, l.lane, l.interrupt_generation, l.collect_request_id
FROM legacy_leases l
WHERE l.target_client_id = %(client_id)s AND l.tenant_id = %(tenant_id)s AND l.status = 'queued'
  AND l.lane <> 'high'
ORDER BY l.id
FOR UPDATE OF l
"""

# A client's pulled leases of non-high work: each is told to yield (Phase 1: only if it has not started the AI
# conversation yet); the lease is not cleared here.
RUNNING_OF_CLIENT = """
SELECT l.id, l.monitor_task_id, l.tenant_id, l.ai_platform_id, l.lane, l.interrupt_generation, l.execution_phase
FROM legacy_leases l
WHERE l.target_client_id = %(client_id)s AND l.tenant_id = %(tenant_id)s AND l.status = 'in_progress'
  AND l.lane <> 'high' AND l.result_received_at IS NULL
ORDER BY l.id
FOR UPDATE OF l
"""

REQUEST_INTERRUPT = """
UPDATE legacy_leases
SET control_flags = control_flags || jsonb_build_object('interrupt_requested', true,
                                                        'interrupt_generation', %(generation)s::bigint,
                                                        'collect_request_id', %(request_id)s::text),
    interrupt_generation = greatest(interrupt_generation, %(generation)s::bigint),
    interrupt_reason = %(reason)s, updated_at = now()
WHERE id = ANY(%(ids)s::uuid[]) AND status = 'in_progress'
"""


# ---- consistency between the paths (the reconciler's 16.2.4 check, the coordinator's start-up check) -------------

# Live work on the path a task is not owned by: a live legacy lease on a desktop_tasks-owned task, an active execution
# on a legacy-owned one. Neither path creates these (each dispatches only its own owner's pending tasks, and a task
# changes owner only when pending without live work); one found is for a human.
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
# pending again with its dispatch attempt back) ...
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
      AND lane IN ('normal', 'normal_boosted')
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
  AND lane IN ('normal', 'normal_boosted') AND result_received_at IS NULL AND interrupt_generation < g.gen
RETURNING id, monitor_task_id, ai_platform_id, lane
"""


# The platform-health pause at the hub, on this path (the twin of executions.RELEASE_QUEUED_OF_PLATFORM): the offers
# of held lanes (normal, boosted, retry) not pulled yet by one of the clients %(client_ids)s, of a platform it now
# reports a broken login on (unless the tenant's override ignores health), are withdrawn: the offer ends aborted with
# reason platform_unhealthy, the business row is pending again with its lease cleared and its dispatch attempt back.
# Offers locked in id order, before their business rows (as the lease call does: PICK_OFFERS, MARK_LEASED).
RELEASE_OFFERS_OF_PLATFORM = f"""
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
