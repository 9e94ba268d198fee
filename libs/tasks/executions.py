"""Executions (`desktop_tasks`, `desktop_task_attempts`): every statement that creates one or moves it through its
lease, whoever runs it (docs/architecture.md "State machines", "Write matrix"). The legacy path's twin of each lease
statement is in libs/tasks/legacy.py.

    (coordinator) queued --(hub: lease, attempt opened)--> in_progress --(hub: result posted)--> in_progress, received
    in_progress, received --(reconciler: not applied in time)--> unknown --(no evidence, lease alive)--> queued
    queued --(collect-now: the client's scheduled work)--> aborted;  in_progress --(collect-now)--> interrupt asked

Ending an execution (succeeded / failed / aborted) and what that does to its business task is
libs/tasks/transitions.py.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from libs.db.pool import Conn, json_records
from libs.tasks.fragments import BLOCKED_PLATFORMS_OF_CLIENTS_SQL, CLIENT_GENERATION_SQL, HELD_LANES_SQL
from libs.tasks.result_claims import claim_result, release_result_claim

# ---- creation (the coordinator) ----------------------------------------------------------------------------------

# Execution rows (cross-service contract 2), every value computed by the dispatcher from the claimed rows; one JSON
# parameter of named records (libs.db.pool.json_records: encoded by msgspec in C) instead of seventeen arrays psycopg
# dumps in Python.
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
EXECUTION_KEYS = ("id", "tenant_id", "workspace_id", "target_client_id", "priority", "lane", "lane_weight", "source",
                  "scheduler_group_key", "monitor_task_id", "interrupt_generation", "enqueued_at", "brand_id",
                  "question_id", "ai_platform_id", "business_date", "collect_request_id")



async def create(conn: Conn, rows: list[dict[str, Any]], *, ts: datetime) -> None:
    """The executions a dispatch pass decided, queued for their clients (in the caller's pipeline); the legacy path's
    twin is legacy.offer."""
    await conn.execute(INSERT_EXECUTIONS, {"ts": ts, "rows": json_records(rows, EXECUTION_KEYS)})

# ---- a click's preemption (collect-now) --------------------------------------------------------------------------

# Contract 4: the client's queued scheduled executions are cancelled at once. The set-based twin of
# transitions.end_execution(outcome='aborted') for executions that were never leased (no attempt to
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
# executions' (and legacy leases') control flags for the hub's replay.
NAME_REPLACEMENT = """
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
# of transitions.end_execution(outcome='aborted') for executions never leased (no attempt to close), reason
# platform_unhealthy; then (transitions.yield_business_task) each one's business task gets its dispatch attempt
# back, lane and enqueued_at kept, for the coordinator to plan again (another client of the tenant whose login
# works, or held while none has one). Rows locked in id order. The legacy twin: legacy.RELEASE_OFFERS_OF_PLATFORM.
RELEASE_QUEUED_OF_PLATFORM = f"""
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

# Lease one picked execution and record its attempt (the attempt only if the lease took: under PICK_QUEUED's row
# lock it always does).
MARK_LEASED = """
WITH leased AS (
    UPDATE desktop_tasks
    SET status = 'in_progress', lease_epoch = %(epoch)s, lease_token_hash = %(token_hash)s, leased_at = now(),
        lease_expires_at = now() + make_interval(secs => %(ttl_s)s), execution_phase = 'PREPARING',
        result_received_at = NULL, updated_at = now()
    WHERE id = %(task_id)s AND status = 'queued'
    RETURNING id, monitor_task_id, tenant_id, target_client_id, lease_epoch, interrupt_generation, lease_expires_at
), attempt AS (
    INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, lease_epoch, status,
                                       execution_phase, interrupt_generation)
    SELECT id, monitor_task_id, tenant_id, target_client_id, lease_epoch, 'in_progress', 'PREPARING',
           interrupt_generation
    FROM leased
)
SELECT lease_expires_at FROM leased
"""


# Extend on the hot path: one statement that both checks the fence and extends.
EXTEND_LEASE = """
UPDATE desktop_tasks
SET lease_expires_at = now() + make_interval(secs => %(ttl_s)s),
    execution_phase = coalesce(%(phase)s::text, execution_phase),
    started_at = CASE WHEN started_at IS NULL AND %(phase)s::text NOT IN ('PREPARING', 'NAVIGATING')
                      THEN now() ELSE started_at END,
    updated_at = now()
WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND target_client_id = %(client_id)s
  AND status = 'in_progress' AND lease_epoch = %(epoch)s AND lease_token_hash = %(token_hash)s
RETURNING lease_expires_at, interrupt_generation, control_flags, ai_platform_id
"""


# The first result body posted on a lease claims it; `previous` is the digest an earlier post stored (NULL: this
# post is the first).
CLAIM_RESULT = claim_result("desktop_tasks")


# A publish that failed gives the claim back, so the client's retry can post again.
RELEASE_RESULT_CLAIM = release_result_claim("desktop_tasks")


# The result was accepted and published: the client's slot is free, ingest applies it.
MARK_RESULT_RECEIVED = """
UPDATE desktop_tasks SET result_received_at = now(), execution_phase = 'POSTING', updated_at = now()
WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND lease_epoch = %(epoch)s
"""


# ---- unknown executions (the reconciler) ------------------------------------------------------------------------

# A result the hub accepted that ingest has not applied after the grace period: unknown (still active).
MARK_UNKNOWN = """
UPDATE desktop_tasks
SET status = 'unknown', updated_at = now()
WHERE id IN (SELECT id FROM desktop_tasks
             WHERE kind = 'monitor' AND status = 'in_progress' AND result_received_at IS NOT NULL
               AND result_received_at < now() - make_interval(secs => %(grace_s)s)
             LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING id, tenant_id, monitor_task_id, target_client_id
"""


# No evidence and the lease still held: back to queued on the same row (a new lease gets a new epoch) ...
REQUEUE_UNKNOWN = """
UPDATE desktop_tasks
SET status = 'queued', lease_token_hash = NULL, leased_at = NULL, lease_expires_at = NULL,
    result_received_at = NULL, execution_phase = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'unknown'
"""


# ... and the lease's attempt is closed.
CLOSE_REQUEUED_ATTEMPT = """
UPDATE desktop_task_attempts
SET status = 'aborted', finished_at = now(), abort_reason = 'unknown_requeued'
WHERE task_id = %(id)s AND lease_epoch = %(lease_epoch)s AND status = 'in_progress'
"""
