"""Every SQL statement of collect-now-api, with named parameters. Each one filters by the caller's tenant."""

import uuid
from datetime import date

from libs.tasks import requests as collect_requests
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, CLEAR_LEGACY_LEASE_SQL
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL

ACTIVE_REQUEST_STATUSES = ("accepted", "dispatching", "running")

# Serialises collect-now within one tenant: idempotency, the active-request limit and the supersede
# chain are then decided on committed data, and two clicks can never both create a request.
LOCK_TENANT = "SELECT pg_advisory_xact_lock(hashtextextended('collect_now.tenant:' || %(tenant_id)s::text, 0))"
# How long a click waits for its tenant's lock (and, for the rest of its transaction, for any row lock) before it
# is answered 429: a burst of one tenant's clicks must not hold the connections other tenants' clicks need.
LOCK_WAIT = "SELECT set_config('lock_timeout', %(lock_wait)s, true)"

BRAND = """
SELECT b.id, b.workspace_id, t.time_zone, (now() AT TIME ZONE t.time_zone)::date AS business_date
FROM brands b JOIN tenants t ON t.id = b.tenant_id
WHERE b.id = %(brand_id)s AND b.tenant_id = %(tenant_id)s AND b.workspace_id = %(workspace_id)s
"""

# The user's recent requests on this brand with one of the scope hashes (newest first). The hash covers the
# business date, which is read in the same statement (the tenant's local date), so the caller passes the hashes
# of every date it can be and picks the one of the date read.
RECENT_REQUESTS = """
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
CLIENT_CANDIDATES = """
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
WHERE c.tenant_id = %(tenant_id)s AND c.workspace_id = %(workspace_id)s AND """ + ELIGIBLE_CLIENT_SQL

# The tenant's active requests (a handful at most: the active-request limit keeps it small). Used for the
# limit (those not past their TTL) and for the supersede chain (those of the chosen client).
ACTIVE_REQUESTS = """
SELECT id, target_client_id, extract(epoch FROM ttl_expires_at - now())::float8 AS ttl_remaining_s
FROM monitoring_collect_requests
WHERE tenant_id = %(tenant_id)s AND status IN ('accepted', 'dispatching', 'running')
"""

USER_RATE = """
SELECT count(*) AS user_requests_last_hour,
       extract(epoch FROM now() - min(r.created_at))::float8 AS oldest_user_request_age_s
FROM monitoring_collect_requests r
WHERE r.tenant_id = %(tenant_id)s AND r.requested_by_user_id = %(user_id)s AND r.created_at > now() - interval '1 hour'
"""

# The scope: the brand's enabled questions (or the keyword's) x the tenant's enabled platforms.
SCOPE = """
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

# Everything the decision reads, in ONE statement (read under LOCK_TENANT, after it): the brand in the caller's
# tenant and workspace (NULL columns: not found), whether the keyword belongs to it, the user's recent requests
# (newest first), the eligible clients, the tenant's active requests, the user's hourly count and the scope. The
# row sets come back as JSON documents (decoded into typed structs by the caller): one result for psycopg to
# convert instead of seven.
def _json_array(sql: str) -> str:
    """A statement's rows as one JSON array, in the statement's order."""
    return (f"(SELECT coalesce(json_agg(x ORDER BY x.ord), '[]')::text "
            f"FROM (SELECT s.*, row_number() OVER () AS ord FROM ({sql}) s) x)")


READS = f"""
SELECT b.id AS brand_id, b.workspace_id, b.business_date,
       (%(keyword_id)s::bigint IS NULL OR EXISTS (
            SELECT 1 FROM monitoring_keywords k
            WHERE k.id = %(keyword_id)s::bigint AND k.brand_id = %(brand_id)s AND k.tenant_id = %(tenant_id)s))
           AS keyword_ok,
       {_json_array(RECENT_REQUESTS)} AS recent,
       {_json_array(CLIENT_CANDIDATES)} AS candidates,
       {_json_array(ACTIVE_REQUESTS)} AS active,
       u.user_requests_last_hour, u.oldest_user_request_age_s,
       {_json_array(SCOPE)} AS scope
FROM ({USER_RATE}) u LEFT JOIN ({BRAND}) b ON true
"""

# The recent requests alone (RECENT_REQUESTS' JSON array): for a business date READS was not given the hash of.
RECENT = f"SELECT {_json_array(RECENT_REQUESTS)} AS recent"

# The write phase is pipelined: statements after the increment read the new generation with this
# subquery (0 when the request is unbound). No other writer changes a client's generation.
_GENERATION = (
    "coalesce((SELECT interrupt_generation FROM desktop_clients "
    "WHERE id = %(client_id)s::uuid AND tenant_id = %(tenant_id)s), 0)"
)

# The execution path of a task this click creates or re-collects (docs/legacy-path.md, rollout): the rollout as
# stored now, not as cached (a rollback applies to the next click). libs.domain.schedule.execution_owner_for in SQL.
_ROLLOUT_OWNER = (
    "CASE WHEN %(tenant_id)s::bigint %% 100 < coalesce((SELECT (v.value #>> '{}')::int FROM dispatch_settings v "
    "WHERE v.key = 'rollout_percentage'), 100) THEN 'desktop_tasks' ELSE 'legacy' END"
)

INCREMENT_GENERATION = """
UPDATE desktop_clients SET interrupt_generation = interrupt_generation + 1, updated_at = now()
WHERE id = %(client_id)s AND tenant_id = %(tenant_id)s
RETURNING interrupt_generation
"""

# Contract 4: the client's queued scheduled executions are cancelled at once. The set-based twin of
# transitions.end_execution(outcome='aborted') for executions that were never leased (no attempt to
# close), in one statement to keep the request's transaction short.
# Then (the set-based twin of transitions.yield_business_task) each one's business task gets its
# dispatch attempt back; lane and enqueued_at are kept.
CANCEL_QUEUED_SCHEDULED = """
WITH g AS (SELECT """ + _GENERATION + """ AS gen),
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
MARK_INTERRUPT_REQUESTED = """
WITH g AS (SELECT """ + _GENERATION + """ AS gen)
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

# The same two steps on the legacy path (Phase 1, docs/legacy-path.md). The client's offers of scheduled work it
# has not pulled yet are withdrawn (the twin of CANCEL_QUEUED_SCHEDULED: the offer ends aborted at epoch 0, so its
# budget is given back; the business row is pending again with its dispatch attempt back) ...
WITHDRAW_LEGACY_OFFERS = """
WITH g AS (SELECT """ + _GENERATION + """ AS gen),
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
), released AS (
    UPDATE monitoring_collect_tasks t
    SET status = 'pending', """ + CLEAR_LEGACY_LEASE_SQL + """,
        dispatch_attempts = greatest(t.dispatch_attempts - 1, 0), updated_at = now()
    FROM withdrawn w
    WHERE t.id = w.monitor_task_id AND t.legacy_lease_id = w.id AND t.status = 'leased'
)
SELECT * FROM withdrawn
"""

# ... and its pulled leases of scheduled work are told to yield, without clearing them here: the client cancels only
# while PREPARING or NAVIGATING, and otherwise finishes the task (the lease then ends as any other).
INTERRUPT_LEGACY_LEASES = """
WITH g AS (SELECT """ + _GENERATION + """ AS gen)
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

# The interrupted executions' replacement (task_control.replacement_task_id): the id the coordinator gives the
# high execution of the first promoted task, decided here so the interrupt can name it; kept in the interrupted
# executions' control flags for the hub's replay.
NAME_REPLACEMENT = """
WITH named AS (
    UPDATE monitoring_collect_tasks SET next_execution_id = %(replacement_id)s
    WHERE id = %(replacement_task)s AND tenant_id = %(tenant_id)s
    RETURNING id
)
UPDATE desktop_tasks
SET control_flags = control_flags || jsonb_build_object('replacement_task_id', %(replacement_id)s::text)
WHERE id = ANY(%(interrupted_ids)s::uuid[]) AND tenant_id = %(tenant_id)s AND EXISTS (SELECT 1 FROM named)
"""

# Tasks the scanner has not created yet: one row per business key, never a second one.
CREATE_MISSING_TASKS = """
INSERT INTO monitoring_collect_tasks
    (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date, plan_id, trigger_source,
     dispatch_priority, dispatch_lane, target_client_id, dispatch_after, interrupt_generation,
     collect_request_id, ingest_shard_key, execution_owner)
SELECT %(tenant_id)s, %(workspace_id)s, %(brand_id)s, s.question_id, s.ai_platform_id, %(business_date)s,
       s.plan_id, 'manual', %(priority)s, 'high', %(client_id)s, now(), """ + _GENERATION + """, %(request_id)s,
       %(shard_key)s, """ + _ROLLOUT_OWNER + """
FROM unnest(%(question_ids)s::bigint[], %(platform_ids)s::bigint[], %(plan_ids)s::bigint[])
     AS s(question_id, ai_platform_id, plan_id)
ON CONFLICT (tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode, business_date)
DO NOTHING
RETURNING id
"""

# Promotion (contract 4): pending tasks, and finished ones reset for a fresh collection, move to the
# high lane bound to the client and the request, in place: a pending task keeps its execution path (a task never
# changes owner mid-flight); a finished one starts a new run on the path the rollout gives it now. Legacy rows a
# client holds (leased / received) are in the scope but left alone: that lease finishes or yields (Phase 1).
# Returns every scope task with whether it was promoted.
PROMOTE_SCOPE = """
WITH scope AS (
    SELECT * FROM unnest(%(question_ids)s::bigint[], %(platform_ids)s::bigint[]) AS s(question_id, ai_platform_id)
), scope_tasks AS (
    SELECT t.id, t.status
    FROM monitoring_collect_tasks t JOIN scope s
      ON t.question_id = s.question_id AND t.ai_platform_id = s.ai_platform_id
    WHERE t.tenant_id = %(tenant_id)s AND t.brand_id = %(brand_id)s AND t.business_date = %(business_date)s
      AND t.collector_type = 'desktop' AND t.run_mode = 'daily'
    FOR UPDATE OF t
), promoted AS (
    UPDATE monitoring_collect_tasks t
    SET status = 'pending', dispatch_lane = 'high', dispatch_priority = %(priority)s,
        target_client_id = %(client_id)s, interrupt_generation = """ + _GENERATION + """,
        collect_request_id = %(request_id)s, superseded_by_request_id = NULL, dispatch_after = now(),
        execution_owner = CASE WHEN t.status = 'pending' THEN t.execution_owner ELSE """ + _ROLLOUT_OWNER + """ END,
        dispatch_attempts = CASE WHEN t.status = 'pending' THEN t.dispatch_attempts ELSE 0 END,
        completed_at = CASE WHEN t.status = 'pending' THEN t.completed_at END,
        last_error = CASE WHEN t.status = 'pending' THEN t.last_error END,
        updated_at = now()
    FROM scope_tasks s
    WHERE t.id = s.id AND s.status IN ('pending', 'completed', 'failed', 'expired', 'skipped')
    RETURNING t.id
)
SELECT id, true AS promoted FROM promoted
UNION ALL
SELECT id, false FROM scope_tasks WHERE status NOT IN ('pending', 'completed', 'failed', 'expired', 'skipped')
"""

MARK_TASKS_SUPERSEDED = """
UPDATE monitoring_collect_tasks SET superseded_by_request_id = %(request_id)s, updated_at = now()
WHERE tenant_id = %(tenant_id)s AND collect_request_id = ANY(%(old_ids)s::uuid[])
"""

INSERT_REQUEST = """
INSERT INTO monitoring_collect_requests
    (id, tenant_id, workspace_id, brand_id, keyword_id, requested_by_user_id, target_client_id, scope_hash,
     request_scope, status, preempt, interrupt_generation, requested_task_count, aborted_queued_count,
     interrupt_requested_count, ttl_expires_at, traceparent)
VALUES (%(id)s, %(tenant_id)s, %(workspace_id)s, %(brand_id)s, %(keyword_id)s, %(user_id)s, %(client_id)s,
        %(scope_hash)s, %(scope)s, 'accepted', %(preempt)s, %(generation)s, %(requested)s, %(aborted_queued)s,
        %(interrupt_requested)s, now() + make_interval(secs => %(ttl_s)s), %(traceparent)s)
RETURNING *
"""

# Wakes the coordinator (dispatch the high work now) at commit, and the outbox pumps when control events (cancel,
# interrupt) were written: they are prioritised, so the payload wakes the pump's priority loop. The request's
# lifecycle event alone wakes no pump: it is the coordinator's fallback wake-up for a lost NOTIFY, and a pump
# woken for it would publish it, and the coordinator consume it, while the click's high pass is running.
NOTIFY = """
SELECT pg_notify(%(dispatch_channel)s, ''),
       CASE WHEN %(controls)s THEN pg_notify(%(outbox_channel)s, %(outbox_payload)s) END
"""

REQUEST_PROGRESS = """
SELECT status, first_dispatched_at, dispatched_task_count FROM monitoring_collect_requests
WHERE id = %(request_id)s AND tenant_id = %(tenant_id)s
"""

# ---- GET /collect-requests/{id} (§13.5) --------------------------------------------------------

REQUEST_STATUS = """
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
REQUEST_TASKS = f"""
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

# What a new pooled connection plans before its first click (libs.db.pool: EXPLAIN, nothing runs): the statements
# of the accept transaction, with parameters that match no row.
_NOTHING = uuid.UUID(int=0)
WARM_UP_PARAMS: dict[str, object] = {
    "tenant_id": 0, "workspace_id": 0, "brand_id": 0, "keyword_id": None, "user_id": 0, "window_s": 300,
    "heartbeat_timeout_s": 30, "question_ids": [0], "platform_ids": None, "plan_ids": [0], "scope_hashes": [""],
    "client_id": _NOTHING, "request_id": _NOTHING, "id": _NOTHING, "old_ids": [_NOTHING],
    "business_date": date(2000, 1, 1), "priority": 0, "shard_key": "", "scope_hash": "", "scope": "{}",
    "preempt": True, "generation": 0, "requested": 0, "aborted_queued": 0, "interrupt_requested": 0, "ttl_s": 300,
    "traceparent": None,
}
WARM_UP = [(statement, WARM_UP_PARAMS) for statement in (
    READS, INCREMENT_GENERATION, CANCEL_QUEUED_SCHEDULED, MARK_INTERRUPT_REQUESTED, WITHDRAW_LEGACY_OFFERS,
    INTERRUPT_LEGACY_LEASES, CREATE_MISSING_TASKS,
    PROMOTE_SCOPE, MARK_TASKS_SUPERSEDED, collect_requests.SUPERSEDE, INSERT_REQUEST)]
