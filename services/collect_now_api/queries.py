"""Every SQL statement of collect-now-api, with named parameters. Each one filters by the caller's tenant."""

import uuid
from datetime import date

from libs.tasks import business, executions, legacy
from libs.tasks import requests as collect_requests
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL

ACTIVE_REQUEST_STATUSES = ("accepted", "dispatching", "running")

# Serialises collect-now within one tenant: idempotency, the active-request limit and the supersede
# chain are then decided on committed data, and two clicks can never both create a request.
LOCK_TENANT = "SELECT pg_advisory_xact_lock(hashtextextended('collect_now.tenant:' || %(tenant_id)s::text, 0))"
# How long a click waits for its tenant's lock (and, for the rest of its transaction, for any row lock) before it
# is answered 429: a burst of one tenant's clicks must not hold the connections other tenants' clicks need.
LOCK_WAIT = "SELECT set_config('lock_timeout', %(lock_wait)s, true)"

# collect-now's Idempotency-Key (migration 045). A request carrying a key first takes the key's lock, without
# waiting: a second request with the same key while the first is still in its transaction answers 409 at once (it
# cannot know yet what to replay); after the first committed, the lock is free and the key's row is there.
TRY_LOCK_IDEMPOTENCY_KEY = """
SELECT pg_try_advisory_xact_lock(hashtextextended(
    'collect_now.idempotency:' || %(tenant_id)s::text || ':' || %(user_id)s::text || ':' || %(idempotency_key)s, 0))
    AS locked
"""

# The key's unexpired first answer, of this tenant and user only.
IDEMPOTENCY_KEY = """
SELECT request_fingerprint, response_status, response_body
FROM collect_now_idempotency_keys
WHERE tenant_id = %(tenant_id)s AND user_id = %(user_id)s AND idempotency_key = %(idempotency_key)s
  AND expires_at > now()
"""

# Under the key's lock; an expired row of the same key (not yet purged) is replaced.
STORE_IDEMPOTENCY_KEY = """
INSERT INTO collect_now_idempotency_keys
    (tenant_id, user_id, idempotency_key, request_fingerprint, collect_request_id, response_status, response_body,
     expires_at)
VALUES (%(tenant_id)s, %(user_id)s, %(idempotency_key)s, %(fingerprint)s, %(collect_request_id)s, %(status)s,
        %(body)s, now() + make_interval(hours => %(ttl_hours)s))
ON CONFLICT (tenant_id, user_id, idempotency_key) DO UPDATE
SET request_fingerprint = excluded.request_fingerprint, collect_request_id = excluded.collect_request_id,
    response_status = excluded.response_status, response_body = excluded.response_body,
    created_at = now(), expires_at = excluded.expires_at
WHERE collect_now_idempotency_keys.expires_at <= now()
"""

# `wait_for_first_dispatch`: the answer the first caller got after its wait is what the key replays.
UPDATE_IDEMPOTENT_ANSWER = """
UPDATE collect_now_idempotency_keys SET response_body = %(body)s
WHERE tenant_id = %(tenant_id)s AND user_id = %(user_id)s AND idempotency_key = %(idempotency_key)s
  AND collect_request_id = %(collect_request_id)s
"""

# A batch of expired keys (any tenant: retention, not a tenant's data); replicas purging at once skip each other's.
PURGE_IDEMPOTENCY_KEYS = """
DELETE FROM collect_now_idempotency_keys k
USING (SELECT tenant_id, user_id, idempotency_key FROM collect_now_idempotency_keys
       WHERE expires_at <= now() ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED) old
WHERE k.tenant_id = old.tenant_id AND k.user_id = old.user_id AND k.idempotency_key = old.idempotency_key
"""

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
CLIENT_CANDIDATES = f"""
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

INCREMENT_GENERATION = """
UPDATE desktop_clients SET interrupt_generation = interrupt_generation + 1, updated_at = now()
WHERE id = %(client_id)s AND tenant_id = %(tenant_id)s
RETURNING interrupt_generation
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
    READS, INCREMENT_GENERATION, executions.CANCEL_QUEUED_SCHEDULED, executions.MARK_INTERRUPT_REQUESTED,
    legacy.WITHDRAW_SCHEDULED_OFFERS, legacy.INTERRUPT_SCHEDULED_LEASES, business.CREATE_MISSING_TASKS,
    business.PROMOTE_SCOPE, business.MARK_SUPERSEDED, collect_requests.SUPERSEDE, collect_requests.CREATE)]
