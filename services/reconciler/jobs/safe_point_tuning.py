"""Job 8 — safe-point tuning: each platform's safe-point P95 from the hubs' histograms, and for platforms marked
dynamic the interrupt timeouts derived from it (libs/domain/safe_points.py has the rule and why).

Every run: the P95 of the last `safe_point_window_days` into `platform_settings.safe_point_p95_ms` (with the
sample count and when), and the `safe_point_interval_ms_p95{platform}` gauge (this replica leads the
reconciler, so the gauge is the system's). At most every `interrupt_tuning_interval_seconds` per platform, and
only with `safe_point_min_samples` samples or more: soft and hard timeouts of dynamic platforms, logged with the
old and new values. Histogram rows older than the window (plus a day) are deleted.
"""

from __future__ import annotations

from libs.domain.safe_points import p95_from_histogram, robust_p95, tuned_timeouts
from libs.telemetry import metrics
from services.reconciler.jobs.base import JobContext, JobResult, configured_job, log

NAME = "safe_point_tuning"

# Per platform and client (rows older hubs still write without a client count as one anonymous client).
_HISTOGRAMS = """
SELECT ai_platform_id, client_id, le_ms, sum(n)::bigint AS n
FROM safe_point_client_histogram
WHERE hour >= date_trunc('hour', now()) - make_interval(days => %(days)s)
GROUP BY 1, 2, 3
UNION ALL
SELECT ai_platform_id, '00000000-0000-0000-0000-000000000000'::uuid, le_ms, sum(n)::bigint
FROM safe_point_histogram
WHERE hour >= date_trunc('hour', now()) - make_interval(days => %(days)s)
GROUP BY 1, 3
"""

_PLATFORMS = """
SELECT p.id, p.code, coalesce(s.timeouts_dynamic, true) AS dynamic, s.interrupt_soft_timeout_ms AS soft,
       s.interrupt_hard_timeout_ms AS hard,
       s.timeouts_tuned_at IS NULL OR s.timeouts_tuned_at < now() - make_interval(secs => %(every_s)s) AS due
FROM ai_platforms p LEFT JOIN platform_settings s ON s.ai_platform_id = p.id
"""

_RECORD = """
INSERT INTO platform_settings (ai_platform_id, safe_point_p95_ms, safe_point_samples, safe_point_clients,
                               safe_point_measured_at)
VALUES (%(id)s, %(p95)s, %(samples)s, %(clients)s, now())
ON CONFLICT (ai_platform_id) DO UPDATE
SET safe_point_p95_ms = EXCLUDED.safe_point_p95_ms, safe_point_samples = EXCLUDED.safe_point_samples,
    safe_point_clients = EXCLUDED.safe_point_clients, safe_point_measured_at = EXCLUDED.safe_point_measured_at
"""

_TUNE = """
UPDATE platform_settings
SET interrupt_soft_timeout_ms = %(soft)s, interrupt_hard_timeout_ms = %(hard)s, timeouts_tuned_at = now(),
    updated_at = now()
WHERE ai_platform_id = %(id)s AND timeouts_dynamic
"""

_PRUNE = """
WITH per_client AS (
    DELETE FROM safe_point_client_histogram
    WHERE hour < date_trunc('hour', now()) - make_interval(days => %(days)s + 1)
)
DELETE FROM safe_point_histogram WHERE hour < date_trunc('hour', now()) - make_interval(days => %(days)s + 1)
"""


async def run(ctx: JobContext) -> JobResult:
    result = JobResult()
    settings = ctx.settings
    conn = ctx.conn
    async with conn.transaction():
        cur = await conn.execute(_HISTOGRAMS, {"days": settings.safe_point_window_days})
        histograms: dict[int, dict[object, list[tuple[int, int]]]] = {}
        for r in await cur.fetchall():
            per_client = histograms.setdefault(int(r["ai_platform_id"]), {})
            per_client.setdefault(r["client_id"], []).append((int(r["le_ms"]), int(r["n"])))
        cur = await conn.execute(_PLATFORMS, {"every_s": settings.interrupt_tuning_interval_seconds})
        for platform in await cur.fetchall():
            per_client = histograms.get(int(platform["id"]), {})
            robust = robust_p95(per_client, min_client_samples=settings.safe_point_min_client_samples,
                                min_clients=settings.safe_point_min_clients)
            if robust is None:  # shown (pooled, with the clients that qualify), never tuned from
                pooled = p95_from_histogram([b for buckets in per_client.values() for b in buckets])
                if pooled is None:
                    continue
                p95, samples, clients = pooled, sum(n for bs in per_client.values() for _, n in bs), 0
                result.add("too_few_clients")
            else:
                p95, samples, clients = robust
            await conn.execute(_RECORD, {"id": platform["id"], "p95": round(p95), "samples": samples,
                                         "clients": clients})
            metrics.safe_point_interval_ms_p95.labels(platform=platform["code"]).set(p95)
            result.add("platforms_measured")
            if (robust is not None and platform["dynamic"] and platform["due"]
                    and samples >= settings.safe_point_min_samples):
                soft, hard = tuned_timeouts(p95)
                await conn.execute(_TUNE, {"id": platform["id"], "soft": soft, "hard": hard})
                result.fixed += 1
                result.add("timeouts_tuned")
                log.info("interrupt timeouts tuned from the measured safe-point P95", extra={
                    "platform": platform["code"], "p95_ms": round(p95), "samples": samples, "clients": clients,
                    "soft_timeout_ms": soft, "hard_timeout_ms": hard, "previous_soft_timeout_ms": platform["soft"],
                    "previous_hard_timeout_ms": platform["hard"]})
        cur = await conn.execute(_PRUNE, {"days": settings.safe_point_window_days})
        result.add("histogram_rows_pruned", cur.rowcount)
    return result


JOB = configured_job(
    NAME, "measure each platform's safe-point P95; tune the interrupt timeouts of dynamic platforms", run)
