"""SQL of the projection worker: claim coalesced requests, recompute one key (or, in merge mode, a batch of
keys) from raw facts, release."""

# Both claims: the keys locked in CTE `c` become this worker's for a lease, one more attempt counted.
_CLAIM_KEYS_OF_C = """
UPDATE projection_rebuild_queue q
SET claimed_by = %(me)s, claim_expires_at = now() + make_interval(secs => %(lease_s)s), attempts = q.attempts + 1
FROM c
WHERE (q.tenant_id, q.brand_id, q.business_date) = (c.tenant_id, c.brand_id, c.business_date)
RETURNING q.tenant_id, q.brand_id, q.business_date, q.request_count, q.last_requested_at, q.requested_at
"""

# Claim one key (event path). A row locked by a writer right now is skipped: it is being
# re-requested, and the sweep (or its own event) picks it up.
CLAIM_KEY = f"""
WITH c AS (
    SELECT tenant_id, brand_id, business_date FROM projection_rebuild_queue
    WHERE tenant_id = %(tenant_id)s AND brand_id = %(brand_id)s AND business_date = %(business_date)s
      AND (claimed_by IS NULL OR claim_expires_at < now()) AND attempts < %(max_attempts)s
    FOR UPDATE SKIP LOCKED
){_CLAIM_KEYS_OF_C}"""

# A key of the queue (alias k) a claim may take: not claimed (or its claim abandoned), attempts left, and not one of
# the keys the caller skips (%(skip_tenants)s, %(skip_brands)s, %(skip_dates)s: the event path's keys whose rebuild
# was just refused; empty for the sweep and merge batches).
_CLAIMABLE = """(k.claimed_by IS NULL OR k.claim_expires_at < now()) AND k.attempts < %(max_attempts)s
          AND NOT EXISTS (SELECT 1 FROM unnest(%(skip_tenants)s::bigint[], %(skip_brands)s::bigint[],
                                               %(skip_dates)s::date[]) AS s(tenant_id, brand_id, business_date)
                          WHERE (s.tenant_id, s.brand_id, s.business_date)
                              = (k.tenant_id, k.brand_id, k.business_date))"""

# Claim up to `limit` unclaimed (or abandoned) keys, tenant-fair (the event path's claim rounds, the sweep and
# merge-mode batches: requests whose event was lost, re-requested keys, a backlog). The tenants with claimable keys
# take turns: turn 1 is every tenant's oldest key, turn 2 every tenant's second oldest, and so on; within a turn,
# the tenant whose oldest key waited longest goes first. So one tenant's burst of keys takes one key per turn, not
# the batch, and a tenant with fewer keys than its share leaves the rest of the batch to the others (a full batch
# whenever enough keys are claimable).
#   tenants: every tenant with a queued key, one index probe each (a loose scan of the tenant column).
#   heads:   each one's oldest claimable key; only the `limit` tenants whose heads are oldest can make it in.
#   turns:   each of those tenants' claimable keys in request order, numbered. With n tenants in heads,
#            a tenant's second key comes after the n turn-1 keys, so none needs more than limit - n + 1.
#   c:       the first `limit` keys in turn order, locked; a key claimed or locked meanwhile is skipped and
#            the next one in turn order taken instead, so the lock step reads about as many keys as it takes.
# Reads: one probe per queued tenant, plus each selected tenant's keys up to its bound (never a whole
# tenant's backlog, never the whole queue); index ix_projection_queue_tenant_age. The claimed rows come back
# in turn order (a sweep rebuilds them in that order).
CLAIM_FAIR = f"""
WITH RECURSIVE tenants AS (
    (SELECT tenant_id FROM projection_rebuild_queue ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT (SELECT n.tenant_id FROM projection_rebuild_queue n WHERE n.tenant_id > t.tenant_id
            ORDER BY n.tenant_id LIMIT 1)
    FROM tenants t WHERE t.tenant_id IS NOT NULL
), heads AS (
    SELECT t.tenant_id, h.requested_at AS head,
           count(*) OVER () AS claimable_tenants
    FROM tenants t
    CROSS JOIN LATERAL (
        SELECT k.requested_at FROM projection_rebuild_queue k
        WHERE k.tenant_id = t.tenant_id AND {_CLAIMABLE}
        ORDER BY k.requested_at
        LIMIT 1
    ) h
    ORDER BY h.requested_at, t.tenant_id
    LIMIT %(limit)s
), turns AS (
    SELECT k.tenant_id, k.brand_id, k.business_date, k.turn, h.head
    FROM heads h
    CROSS JOIN LATERAL (
        SELECT k.tenant_id, k.brand_id, k.business_date,
               row_number() OVER (ORDER BY k.requested_at, k.brand_id, k.business_date) AS turn
        FROM projection_rebuild_queue k
        WHERE k.tenant_id = h.tenant_id AND {_CLAIMABLE}
        ORDER BY k.requested_at, k.brand_id, k.business_date
        LIMIT %(limit)s - least(h.claimable_tenants, %(limit)s) + 1
    ) k
), c AS (
    SELECT k.tenant_id, k.brand_id, k.business_date, t.turn, t.head
    FROM (SELECT * FROM turns ORDER BY turn, head, tenant_id) t
    JOIN projection_rebuild_queue k USING (tenant_id, brand_id, business_date)
    WHERE {_CLAIMABLE}
    ORDER BY t.turn, t.head, t.tenant_id
    LIMIT %(limit)s
    FOR UPDATE OF k SKIP LOCKED
), claimed AS ({_CLAIM_KEYS_OF_C})
SELECT claimed.* FROM claimed JOIN c USING (tenant_id, brand_id, business_date)
ORDER BY c.turn, c.head, c.tenant_id
"""

# The event path: which of the keys its events wait on a claim can take now (the others are served, claimed by
# another worker, or out of attempts: their events are done).
KEYS_CLAIMABLE = """
SELECT w.tenant_id, w.brand_id, w.business_date
FROM unnest(%(tenant_ids)s::bigint[], %(brand_ids)s::bigint[], %(dates)s::date[])
     AS w(tenant_id, brand_id, business_date)
JOIN projection_rebuild_queue k USING (tenant_id, brand_id, business_date)
WHERE (k.claimed_by IS NULL OR k.claim_expires_at < now()) AND k.attempts < %(max_attempts)s
"""

# Both rebuilds (one key; a merged batch of keys) overwrite every counter of an aggregate row they upsert.
_OVERWRITE_COUNTS = """
    SET runs = EXCLUDED.runs, succeeded_runs = EXCLUDED.succeeded_runs, failed_runs = EXCLUDED.failed_runs,
        brand_mentioned_runs = EXCLUDED.brand_mentioned_runs, mention_rate = EXCLUDED.mention_rate,
        citations = EXCLUDED.citations, distinct_cited_domains = EXCLUDED.distinct_cited_domains,
        rebuilt_at = EXCLUDED.rebuilt_at
"""


def _mention_rate(alias: str) -> str:
    """Mentioned runs over succeeded runs of the counts row `alias`, 4 decimals, 0 without a success."""
    return (f"CASE WHEN {alias}.succeeded_runs = 0 THEN 0 "
            f"ELSE round({alias}.brand_mentioned_runs::numeric / {alias}.succeeded_runs, 4) END")


# Recompute both projections of one key from the raw facts in one statement (one snapshot) and
# overwrite them in place. Column definitions: libs/ingest/aggregates.py.
REBUILD_KEY = f"""
WITH runs AS (
    SELECT id, ai_platform_id, status, brand_mentioned
    FROM question_monitor_runs
    WHERE tenant_id = %(tenant_id)s AND brand_id = %(brand_id)s AND business_date = %(business_date)s
), cites AS (
    -- found by run_id (a run's facts carry the run's key): the work grows with the key's runs and facts,
    -- not with runs x facts, whatever the statistics say (from the projection key's index it was a join
    -- of every fact of the key against every run: ~45 ms for 500 runs and 1,350 facts)
    SELECT r.ai_platform_id, f.domain
    FROM runs r JOIN monitoring_citation_facts f ON f.run_id = r.id
    WHERE r.status = 'succeeded'
), platform_runs AS (
    SELECT ai_platform_id,
           count(*) AS runs,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded_runs,
           count(*) FILTER (WHERE status = 'failed') AS failed_runs,
           count(*) FILTER (WHERE status = 'succeeded' AND brand_mentioned) AS brand_mentioned_runs
    FROM runs GROUP BY ai_platform_id
), platform_cites AS (
    SELECT ai_platform_id, count(*) AS citations, count(DISTINCT nullif(domain, '')) AS domains
    FROM cites GROUP BY ai_platform_id
), platform AS (
    SELECT p.*, coalesce(c.citations, 0) AS citations, coalesce(c.domains, 0) AS domains
    FROM platform_runs p LEFT JOIN platform_cites c USING (ai_platform_id)
), brand AS (
    SELECT count(*) AS runs,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded_runs,
           count(*) FILTER (WHERE status = 'failed') AS failed_runs,
           count(*) FILTER (WHERE status = 'succeeded' AND brand_mentioned) AS brand_mentioned_runs,
           (SELECT count(*) FROM cites) AS citations,
           (SELECT count(DISTINCT nullif(domain, '')) FROM cites) AS domains
    FROM runs
), drop_platforms AS (
    DELETE FROM monitoring_brand_platform_daily d
    WHERE d.tenant_id = %(tenant_id)s AND d.brand_id = %(brand_id)s AND d.business_date = %(business_date)s
      AND NOT EXISTS (SELECT 1 FROM platform p WHERE p.ai_platform_id = d.ai_platform_id)
), write_platforms AS (
    INSERT INTO monitoring_brand_platform_daily AS d (
        tenant_id, brand_id, business_date, ai_platform_id, runs, succeeded_runs, failed_runs, brand_mentioned_runs,
        mention_rate, citations, distinct_cited_domains, rebuilt_at)
    SELECT %(tenant_id)s, %(brand_id)s, %(business_date)s, p.ai_platform_id, p.runs, p.succeeded_runs, p.failed_runs,
           p.brand_mentioned_runs,
           {_mention_rate("p")},
           p.citations, p.domains, now()
    FROM platform p
    ORDER BY p.ai_platform_id
    ON CONFLICT (tenant_id, brand_id, business_date, ai_platform_id) DO UPDATE
{_OVERWRITE_COUNTS}), drop_brand AS (
    DELETE FROM monitoring_brand_daily d
    WHERE d.tenant_id = %(tenant_id)s AND d.brand_id = %(brand_id)s AND d.business_date = %(business_date)s
      AND (SELECT runs FROM brand) = 0
), write_brand AS (
    INSERT INTO monitoring_brand_daily AS d (
        tenant_id, brand_id, business_date, runs, succeeded_runs, failed_runs, brand_mentioned_runs, mention_rate,
        citations, distinct_cited_domains, rebuilt_at)
    SELECT %(tenant_id)s, %(brand_id)s, %(business_date)s, b.runs, b.succeeded_runs, b.failed_runs,
           b.brand_mentioned_runs,
           {_mention_rate("b")},
           b.citations, b.domains, now()
    FROM brand b WHERE b.runs > 0
    ON CONFLICT (tenant_id, brand_id, business_date) DO UPDATE
{_OVERWRITE_COUNTS})
SELECT (SELECT runs FROM brand) AS runs, (SELECT count(*) FROM platform) AS platforms
"""

# Served: delete the request unless it was requested again since the claim (then keep it for the
# next pass, unclaimed, its age restarting at the snapshot this rebuild covered).
COMPLETE_CLAIM = """
DELETE FROM projection_rebuild_queue
WHERE tenant_id = %(tenant_id)s AND brand_id = %(brand_id)s AND business_date = %(business_date)s
  AND claimed_by = %(me)s AND request_count = %(request_count)s AND last_requested_at = %(last_requested_at)s
RETURNING 1 AS deleted
"""
RELEASE_RE_REQUESTED = """
UPDATE projection_rebuild_queue
SET claimed_by = NULL, claim_expires_at = NULL, attempts = 0,
    requested_at = greatest(requested_at, %(last_requested_at)s)
WHERE tenant_id = %(tenant_id)s AND brand_id = %(brand_id)s AND business_date = %(business_date)s
  AND claimed_by = %(me)s
RETURNING 1 AS released
"""
# A failed rebuild gives the key back at once (attempts keeps counting towards max_attempts).
RELEASE_FAILED = """
UPDATE projection_rebuild_queue SET claimed_by = NULL, claim_expires_at = NULL
WHERE tenant_id = %(tenant_id)s AND brand_id = %(brand_id)s AND business_date = %(business_date)s
  AND claimed_by = %(me)s
"""

QUEUE_STATS = """
SELECT count(*) AS depth,
       coalesce(extract(epoch FROM now() - min(requested_at)) * 1000, 0)::float8 AS lag_ms
FROM projection_rebuild_queue
"""

# ---- merge mode (auto slow-down, §12.4): many keys in one transaction ------------------------

# REBUILD_KEY for an array of keys: every key's projections from one snapshot, in one statement. A key
# without runs loses its rows, exactly as when rebuilt alone.
REBUILD_KEYS = f"""
WITH keys AS (
    SELECT DISTINCT k.tenant_id, k.brand_id, k.business_date
    FROM unnest(%(tenant_ids)s::bigint[], %(brand_ids)s::bigint[], %(dates)s::date[])
         AS k(tenant_id, brand_id, business_date)
), runs AS (
    -- per key, as REBUILD_KEY reads it (an index probe per key whatever the estimates)
    SELECT k.tenant_id, k.brand_id, k.business_date, r.id, r.ai_platform_id, r.status, r.brand_mentioned
    FROM keys k
    CROSS JOIN LATERAL (
        SELECT r.id, r.ai_platform_id, r.status, r.brand_mentioned FROM question_monitor_runs r
        WHERE r.tenant_id = k.tenant_id AND r.brand_id = k.brand_id AND r.business_date = k.business_date
    ) r
), cites AS (
    -- a run's facts carry the run's key (ingest writes both from one result): found by run_id, so
    -- the work grows with the batch's runs and facts, not with runs x facts of a key
    SELECT r.tenant_id, r.brand_id, r.business_date, r.ai_platform_id, f.domain
    FROM runs r JOIN monitoring_citation_facts f ON f.run_id = r.id
    WHERE r.status = 'succeeded'
), platform_runs AS MATERIALIZED (
    SELECT tenant_id, brand_id, business_date, ai_platform_id,
           count(*) AS runs,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded_runs,
           count(*) FILTER (WHERE status = 'failed') AS failed_runs,
           count(*) FILTER (WHERE status = 'succeeded' AND brand_mentioned) AS brand_mentioned_runs
    FROM runs GROUP BY tenant_id, brand_id, business_date, ai_platform_id
), platform_cites AS MATERIALIZED (
    SELECT tenant_id, brand_id, business_date, ai_platform_id,
           count(*) AS citations, count(DISTINCT nullif(domain, '')) AS domains
    FROM cites GROUP BY tenant_id, brand_id, business_date, ai_platform_id
), platform AS (
    SELECT p.*, coalesce(c.citations, 0) AS citations, coalesce(c.domains, 0) AS domains
    FROM platform_runs p LEFT JOIN platform_cites c USING (tenant_id, brand_id, business_date, ai_platform_id)
), brand_runs AS MATERIALIZED (
    SELECT tenant_id, brand_id, business_date,
           count(*) AS runs,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded_runs,
           count(*) FILTER (WHERE status = 'failed') AS failed_runs,
           count(*) FILTER (WHERE status = 'succeeded' AND brand_mentioned) AS brand_mentioned_runs
    FROM runs GROUP BY tenant_id, brand_id, business_date
), brand_cites AS MATERIALIZED (
    SELECT tenant_id, brand_id, business_date, count(*) AS citations, count(DISTINCT nullif(domain, '')) AS domains
    FROM cites GROUP BY tenant_id, brand_id, business_date
), brand AS (
    SELECT k.tenant_id, k.brand_id, k.business_date,
           coalesce(r.runs, 0) AS runs, coalesce(r.succeeded_runs, 0) AS succeeded_runs,
           coalesce(r.failed_runs, 0) AS failed_runs, coalesce(r.brand_mentioned_runs, 0) AS brand_mentioned_runs,
           coalesce(c.citations, 0) AS citations, coalesce(c.domains, 0) AS domains
    FROM keys k
    LEFT JOIN brand_runs r USING (tenant_id, brand_id, business_date)
    LEFT JOIN brand_cites c USING (tenant_id, brand_id, business_date)
), drop_platforms AS (
    DELETE FROM monitoring_brand_platform_daily d
    USING keys k
    WHERE d.tenant_id = k.tenant_id AND d.brand_id = k.brand_id AND d.business_date = k.business_date
      AND NOT EXISTS (SELECT 1 FROM platform p
                      WHERE p.tenant_id = d.tenant_id AND p.brand_id = d.brand_id
                        AND p.business_date = d.business_date AND p.ai_platform_id = d.ai_platform_id)
), write_platforms AS (
    INSERT INTO monitoring_brand_platform_daily AS d (
        tenant_id, brand_id, business_date, ai_platform_id, runs, succeeded_runs, failed_runs, brand_mentioned_runs,
        mention_rate, citations, distinct_cited_domains, rebuilt_at)
    SELECT p.tenant_id, p.brand_id, p.business_date, p.ai_platform_id, p.runs, p.succeeded_runs, p.failed_runs,
           p.brand_mentioned_runs,
           {_mention_rate("p")},
           p.citations, p.domains, now()
    FROM platform p
    ORDER BY p.tenant_id, p.brand_id, p.business_date, p.ai_platform_id
    ON CONFLICT (tenant_id, brand_id, business_date, ai_platform_id) DO UPDATE
{_OVERWRITE_COUNTS}), drop_brand AS (
    DELETE FROM monitoring_brand_daily d
    USING brand b
    WHERE d.tenant_id = b.tenant_id AND d.brand_id = b.brand_id AND d.business_date = b.business_date AND b.runs = 0
), write_brand AS (
    INSERT INTO monitoring_brand_daily AS d (
        tenant_id, brand_id, business_date, runs, succeeded_runs, failed_runs, brand_mentioned_runs, mention_rate,
        citations, distinct_cited_domains, rebuilt_at)
    SELECT b.tenant_id, b.brand_id, b.business_date, b.runs, b.succeeded_runs, b.failed_runs, b.brand_mentioned_runs,
           {_mention_rate("b")},
           b.citations, b.domains, now()
    FROM brand b WHERE b.runs > 0
    ORDER BY b.tenant_id, b.brand_id, b.business_date
    ON CONFLICT (tenant_id, brand_id, business_date) DO UPDATE
{_OVERWRITE_COUNTS})
SELECT (SELECT count(*) FROM keys) AS keys, (SELECT coalesce(sum(runs), 0) FROM brand) AS runs,
       (SELECT count(*) FROM platform) AS platforms
"""

# COMPLETE_CLAIM / RELEASE_RE_REQUESTED per key of a merged batch, with each claim's own snapshot of
# request_count and last_requested_at.
COMPLETE_CLAIMS = """
DELETE FROM projection_rebuild_queue q
USING unnest(%(tenant_ids)s::bigint[], %(brand_ids)s::bigint[], %(dates)s::date[], %(request_counts)s::int[],
             %(last_requested)s::timestamptz[]) AS k(tenant_id, brand_id, business_date, request_count,
                                                    last_requested_at)
WHERE q.tenant_id = k.tenant_id AND q.brand_id = k.brand_id AND q.business_date = k.business_date
  AND q.claimed_by = %(me)s AND q.request_count = k.request_count AND q.last_requested_at = k.last_requested_at
RETURNING q.tenant_id, q.brand_id, q.business_date
"""
RELEASE_RE_REQUESTED_KEYS = """
UPDATE projection_rebuild_queue q
SET claimed_by = NULL, claim_expires_at = NULL, attempts = 0,
    requested_at = greatest(q.requested_at, k.last_requested_at)
FROM unnest(%(tenant_ids)s::bigint[], %(brand_ids)s::bigint[], %(dates)s::date[],
            %(last_requested)s::timestamptz[]) AS k(tenant_id, brand_id, business_date, last_requested_at)
WHERE q.tenant_id = k.tenant_id AND q.brand_id = k.brand_id AND q.business_date = k.business_date
  AND q.claimed_by = %(me)s
RETURNING q.tenant_id, q.brand_id, q.business_date
"""
RELEASE_FAILED_KEYS = """
UPDATE projection_rebuild_queue q SET claimed_by = NULL, claim_expires_at = NULL
FROM unnest(%(tenant_ids)s::bigint[], %(brand_ids)s::bigint[], %(dates)s::date[])
     AS k(tenant_id, brand_id, business_date)
WHERE q.tenant_id = k.tenant_id AND q.brand_id = k.brand_id AND q.business_date = k.business_date
  AND q.claimed_by = %(me)s
"""
