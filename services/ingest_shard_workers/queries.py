"""SQL of result ingest. A batch's rows go in as ONE JSON array of named records (msgspec Structs in apply.py, encoded
by name in C) unpacked with json_to_recordset, rather than one Postgres array per column, which psycopg
dumps element by element in Python (a quarter of a worker's CPU at full rate). Rows are locked in key
order. The batch's reads of the task tables are the task store's (libs/tasks/ingest_ops.py)."""

# Applied-result ledger: a result_id that is already there was applied before and changes nothing.
# rows: named records (libs.db.pool.json_records), `ord` their delivery order.
RECORD_APPLIED = """
INSERT INTO ingest_applied_results (result_id, tenant_id, shard, task_id, monitor_task_id, status, applied_by,
                                    routing_epoch)
SELECT r.result_id, r.tenant_id, r.shard, r.task_id, r.monitor_task_id, r.status, %(applied_by)s, r.routing_epoch
FROM json_to_recordset(%(rows)s::json) AS r(
    ord int, result_id uuid, tenant_id bigint, shard int, task_id uuid, monitor_task_id bigint, status text,
    routing_epoch int)
ORDER BY r.ord
ON CONFLICT (result_id) DO NOTHING
RETURNING result_id
"""

# Success-priority upsert (docs/architecture.md §12.3): new succeeded overwrites; new failed overwrites only failed.
UPSERT_RUNS = """
INSERT INTO question_monitor_runs AS q (
    tenant_id, workspace_id, brand_id, question_id, ai_platform_id, collector_type, run_mode, business_date,
    status, answer_text, brand_mentioned, citation_count, error, desktop_task_id, client_id, result_id,
    started_at, finished_at)
SELECT r.tenant_id, r.workspace_id, r.brand_id, r.question_id, r.ai_platform_id, r.collector_type, r.run_mode,
       r.business_date, r.status, r.answer_text, r.brand_mentioned, r.citation_count, r.error, r.desktop_task_id,
       r.client_id, r.result_id, r.started_at, r.finished_at
FROM json_to_recordset(%(rows)s::json) AS r(
    tenant_id bigint, workspace_id bigint, brand_id bigint, question_id bigint, ai_platform_id bigint,
    collector_type text, run_mode text, business_date date, status text, answer_text text, brand_mentioned boolean,
    citation_count int, error text, desktop_task_id uuid, client_id uuid, result_id uuid, started_at timestamptz,
    finished_at timestamptz)
ORDER BY 1, 3, 8, 4, 5
ON CONFLICT ON CONSTRAINT uk_monitor_run_idempotent DO UPDATE
SET workspace_id = EXCLUDED.workspace_id,
    status = EXCLUDED.status,
    answer_text = EXCLUDED.answer_text,
    brand_mentioned = EXCLUDED.brand_mentioned,
    citation_count = EXCLUDED.citation_count,
    error = EXCLUDED.error,
    desktop_task_id = EXCLUDED.desktop_task_id,
    client_id = EXCLUDED.client_id,
    result_id = EXCLUDED.result_id,
    started_at = EXCLUDED.started_at,
    finished_at = EXCLUDED.finished_at,
    updated_at = now()
WHERE q.status = 'failed' OR EXCLUDED.status = 'succeeded'
RETURNING id, result_id
"""

# Citations of the runs just (over)written, as named records (CITE_KEYS). First drop the ones the effective result
# no longer has ...
_CITES = """
WITH n AS MATERIALIZED (
    SELECT r.run_id, r.fingerprint AS fp FROM json_to_recordset(%(cites)s::json) AS r(run_id bigint, fingerprint text)
)"""
DELETE_STALE_PARSE_RESULTS = f"""{_CITES}
DELETE FROM question_monitor_parse_results p
WHERE p.run_id = ANY(%(run_ids)s::bigint[])
  AND NOT EXISTS (SELECT 1 FROM n WHERE n.run_id = p.run_id AND n.fp = p.citation_fingerprint)
"""
DELETE_STALE_CITATION_FACTS = f"""{_CITES}
DELETE FROM monitoring_citation_facts f
WHERE f.run_id = ANY(%(run_ids)s::bigint[])
  AND NOT EXISTS (SELECT 1 FROM n WHERE n.run_id = f.run_id AND n.fp = f.citation_fingerprint)
"""
# ... and upsert the current ones, idempotent on (run_id, citation_fingerprint).
UPSERT_PARSE_RESULTS = """
INSERT INTO question_monitor_parse_results (run_id, tenant_id, citation_fingerprint, url, title, position, domain)
SELECT r.run_id, r.tenant_id, r.fingerprint, r.url, r.title, r.position, r.domain
FROM json_to_recordset(%(cites)s::json) AS r(
    run_id bigint, tenant_id bigint, fingerprint text, url text, title text, position int, domain text)
ORDER BY 1, 3
ON CONFLICT (run_id, citation_fingerprint) DO UPDATE
SET url = EXCLUDED.url, title = EXCLUDED.title, position = EXCLUDED.position, domain = EXCLUDED.domain
WHERE (question_monitor_parse_results.url, question_monitor_parse_results.title,
       question_monitor_parse_results.position, question_monitor_parse_results.domain)
      IS DISTINCT FROM (EXCLUDED.url, EXCLUDED.title, EXCLUDED.position, EXCLUDED.domain)
"""
UPSERT_CITATION_FACTS = """
INSERT INTO monitoring_citation_facts (run_id, tenant_id, brand_id, question_id, ai_platform_id, business_date,
                                       citation_fingerprint, url, domain, position)
SELECT r.run_id, r.tenant_id, r.brand_id, r.question_id, r.ai_platform_id, r.business_date, r.fingerprint, r.url,
       r.domain, r.position
FROM json_to_recordset(%(cites)s::json) AS r(
    run_id bigint, tenant_id bigint, brand_id bigint, question_id bigint, ai_platform_id bigint, business_date date,
    fingerprint text, url text, domain text, position int)
ORDER BY 1, 7
ON CONFLICT (run_id, citation_fingerprint) DO UPDATE
SET url = EXCLUDED.url, domain = EXCLUDED.domain, position = EXCLUDED.position
WHERE (monitoring_citation_facts.url, monitoring_citation_facts.domain, monitoring_citation_facts.position)
      IS DISTINCT FROM (EXCLUDED.url, EXCLUDED.domain, EXCLUDED.position)
"""

# Coalesced projection rebuild request per (tenant_id, brand_id, business_date); `inserted` tells
# whether this transaction created the row (only then is a ProjectionRebuild event needed).
REQUEST_PROJECTION = """
INSERT INTO projection_rebuild_queue AS q (tenant_id, brand_id, business_date, requested_at, last_requested_at)
SELECT k.tenant_id, k.brand_id, k.business_date, clock_timestamp(), clock_timestamp()
FROM unnest(%(tenant_ids)s::bigint[], %(brand_ids)s::bigint[], %(dates)s::date[])
     AS k(tenant_id, brand_id, business_date)
ORDER BY 1, 2, 3
ON CONFLICT (tenant_id, brand_id, business_date) DO UPDATE
SET last_requested_at = clock_timestamp(), request_count = q.request_count + 1
RETURNING tenant_id, brand_id, business_date, (xmax = 0) AS inserted
"""

# Membership of live replicas (shard spreading).
HEARTBEAT_MEMBER = """
INSERT INTO ingest_shard_members (instance_id) VALUES (%(instance_id)s)
ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = now()
"""
LIVE_MEMBERS = """
SELECT instance_id FROM ingest_shard_members
WHERE heartbeat_at > now() - make_interval(secs => %(timeout_s)s)
ORDER BY instance_id
"""
FORGET_STALE_MEMBERS = """
DELETE FROM ingest_shard_members WHERE heartbeat_at < now() - make_interval(secs => %(timeout_s)s * 10)
"""
LEAVE_MEMBERS = "DELETE FROM ingest_shard_members WHERE instance_id = %(instance_id)s"

PURGE_APPLIED = """
DELETE FROM ingest_applied_results
WHERE result_id IN (SELECT result_id FROM ingest_applied_results
                    WHERE applied_at < now() - make_interval(hours => %(hours)s)
                    LIMIT %(limit)s)
"""
