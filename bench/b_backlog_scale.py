"""Cost as the backlog grows: the coordinator's own work in-process and click -> socket end to end, at 1,000 /
10,000 / 100,000 / 1,000,000 ready tasks over 10-1,000 tenants.

    .venv/bin/python -m bench backlog_scale          (--quick: 1,000 and 10,000 ready tasks, fewer rounds)
    BACKLOG_SIZES=1000000 BACKLOG_PARTS=explain BACKLOG_EXPLAIN_OUT=plans.txt .venv/bin/python -m bench backlog_scale
    BACKLOG_SIZES=10000,1000000 BACKLOG_PARTS=aging BACKLOG_AGING_PLANS=a.txt .venv/bin/python -m bench backlog_scale

Settings (environment, since `python -m bench` takes no per-benchmark options): BACKLOG_SIZES (comma-separated ready
task counts), BACKLOG_PARTS (any of `inproc,clicks,explain,retention,aging`; default `inproc,clicks`), BACKLOG_CLICKS
(clicks per size, default 100), BACKLOG_WINDOW_RATE (executions per minute already in the budget windows, default
5,000), BACKLOG_TENANTS (a fixed number of tenants, at least 10: with BACKLOG_TENANTS=10 BACKLOG_WINDOW_RATE=0 the
clicks part is `bench collect_now`'s loaded scenario with a larger backlog), BACKLOG_EXPLAIN_OUT (a file for the full
plans of `explain`; printed either way: a line per statement, or per run of the same statement, with its slowest plan's
top node, buffers and scans), BACKLOG_HISTORY_DAYS (a history of that many business days before the backlog's, every
business key finished on each, with its succeeded execution and attempt: 365 is the year-of-history variant; the tables'
rows and sizes are printed after the load; BACKLOG_HISTORY_RESULTS=1 adds their results: a run per execution with one
desktop simulator answer and its citations, and the daily aggregates), BACKLOG_AGING_PLANS (a file for the full plans of
`aging`'s explained rounds), BACKLOG_ENQUEUE_ORDER (`random`, the default: the ready tasks enqueued at random within the
last hour; `insert`: in the order they are inserted, as the scanner writes them). 10,000 tenants:
BACKLOG_TENANTS=10000. BACKLOG_TENANT_TURNS (tenant counts, e.g.
`10,10000`): instead of the parts, per size one database per count, their in-process rounds taking turns (no tick, no
aging), a column per count and each full pass's p50 against the first count's.

Per size one fresh database, bulk-loaded with INSERT .. SELECT generate_series: tenants = size / 1,000 (at least
10, at most 1,000), each with a brand, 10 questions, 3 platforms and one desktop client; the ready normal backlog
spread evenly over the tenants and their past business days (enqueued within the last hour); the budget windows of
the last and next 10 minutes filled with BACKLOG_WINDOW_RATE finished executions a minute (the same at every size:
what the budget read counts grows with the dispatch rate, not with the backlog); the probe tenant of
`bench collect_now` and its 10 fleet tenants (5 clients each) are among the tenants. Then VACUUM ANALYZE, as
autovacuum would have done in a running system (and so that it does not run during the measurement).

- inproc: the coordinator's own calls against that database, one at a time, every client online, 20 rounds (3 with
  --quick) after one on cold connections that is not counted: a full pass
  (`Dispatcher.run_pass`, budgets out of the way; its executions are finished before the next round; with the client
  rows it read and the CPU this process spent meanwhile), a high pass
  (one promoted task of the probe client), the backlog gauges (`maintenance.observe_backlog`, with the CPU this
  process spent meanwhile; after the pending pairs' re-read the pass may have started), the budget read, the
  scanner (300 due plans) and, last, 10 aging rounds (2; `maintenance.run_aging`, with the clicks' budgets).
- clicks: `bench collect_now`'s loaded scenario against the same database (real processes, the 50-client
  `desktop-sim` fleet, 100 clicks 50 ms apart): click -> task_available on the socket, and click -> the
  coordinator's high pass starts.
- explain: every statement of a click's path in the coordinator's database (collect-now's transaction, in-process,
  then the high pass that dispatches its task), one full pass, one maintenance tick, one aging round and one
  scanner batch with EXPLAIN (ANALYZE, BUFFERS) and its real parameters (auto_explain, loaded in the benchmark's own
  sessions only: no server configuration changes).
- retention: the reconciler's `history_retention` job with its defaults (ReconcilerConfig()), run in-process until a
  run deletes nothing: each run's time and what it deleted per table, and every task table's rows before and after.
  With BACKLOG_HISTORY_DAYS above the retentions (430: past BUSINESS_TASK_RETENTION_DAYS' 400) it shows the
  steady state a year leaves and what a run costs on it.
- aging: aging rounds at the dispatch pace (`maintenance.aging_pace`, fed what the full pass before each round
  dispatched below high, as the coordinator does) against rounds at the budget's limit (`aging_round_limit`, every round
  before the pace), with the clicks' budgets (20,000 a round); before every round every boost undone and the tasks
  vacuumed (without the undo the backlog's oldest tasks reach the cap within five rounds, and at 10,000 the share is the
  same oldest 1,000 every round; without the vacuum the undo's dead versions pile up in the aging index), then a full
  pass (budgets out of the way, its executions finished after it); the two variants taking turns, 10 rounds each (3 with
  --quick) after one each that is not counted, then one more each with EXPLAIN (ANALYZE, BUFFERS) on every statement
  (auto_explain in the benchmark's own sessions): per variant the tasks boosted, statements and buffers a round and its
  time, and a line per statement of the explained rounds.

At the end one table, a column per size: p50 / p95 of every in-process timing (p50 / p99 of the clicks) and the
load average (1 min) as each size started and ended: other work shares the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from bench.b_collect_now import (
    _DISPATCH_ROW,
    JWT_SECRET,
    Click,
    _analyze,
    _breakdown,
    _measure,
    _start_fleet,
    _stop_fleet,
)
from bench.common import bench_environment, percentile
from libs.auth import TenantPrincipal
from libs.config import Settings
from libs.contracts.http import CollectNowRequest
from libs.db.pool import PREPARE_ON_FIRST_USE, Conn, connect, make_pool
from libs.demo import seed_demo
from libs.dispatch_settings import DispatchSettings, load_settings, set_setting
from libs.domain.lanes import HIGH_PRIORITY, lane_weight
from libs.tasks import dispatch_reads
from services.collect_now_api.service import collect_now
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_coordinator.maintenance import (
    AgingRound,
    aging_pace,
    aging_round_limit,
    measure_signals,
    observe_backlog,
    publish_state,
    run_aging,
)
from services.dispatch_coordinator.scanner import scan_once
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.runner import run_job
from tests.support.explain import Plan, explaining_pool
from tests.support.stack import running_stack
from tools.desktop_sim.answers import compose_answer

QUESTIONS = 10
PLATFORMS = ("openai", "gemini", "perplexity")
FLEET_TENANTS = 10
SCAN_PLANS = 300

_BULK_TENANTS = "INSERT INTO tenants (name) SELECT 'bulk-' || g FROM generate_series(1, %(n)s) g RETURNING id"
_BULK_BRANDS = """
INSERT INTO brands (tenant_id, workspace_id, name) SELECT t, t, 'brand ' || t FROM unnest(%(tenants)s::bigint[]) t
"""
_BULK_QUESTIONS = """
INSERT INTO monitoring_questions (tenant_id, brand_id, text)
SELECT b.tenant_id, b.id, 'question ' || g FROM brands b CROSS JOIN generate_series(1, %(q)s) g
WHERE b.tenant_id = ANY(%(tenants)s::bigint[])
"""
_BULK_TENANT_PLATFORMS = """
INSERT INTO tenant_platforms (tenant_id, ai_platform_id)
SELECT t, p FROM unnest(%(tenants)s::bigint[]) t CROSS JOIN unnest(%(platforms)s::bigint[]) p
"""
_BULK_CLIENTS = """
INSERT INTO desktop_clients (id, tenant_id, workspace_id, user_id, name, token_hash)
SELECT gen_random_uuid(), t, t, t, 'bulk-desktop-' || t, md5('bulk-' || t || random()::text)
FROM unnest(%(tenants)s::bigint[]) t
"""
# Every backlog tenant with its brand, its first client and its questions in id order.
_TENANTS = """
SELECT t.id AS tenant_id, b.id AS brand_id, b.workspace_id, c.client_id, q.questions
FROM tenants t JOIN brands b ON b.tenant_id = t.id
JOIN (SELECT DISTINCT ON (c.tenant_id) c.tenant_id, c.id AS client_id FROM desktop_clients c
      ORDER BY c.tenant_id, c.created_at, c.id) c ON c.tenant_id = t.id
JOIN (SELECT q.brand_id, array_agg(q.id ORDER BY q.id) AS questions FROM monitoring_questions q GROUP BY 1) q
     ON q.brand_id = b.id
WHERE t.id = ANY(%(tenants)s::bigint[])
ORDER BY t.id
"""
# Task i of n: tenant i % T, then platform, then question, then business day (yesterday and back): every business
# key once. `status` and the first day decide between the ready backlog and the finished tasks of the windows.
# Enqueued within the last hour, at random, or (`in_order`, BACKLOG_ENQUEUE_ORDER=insert) in the order of the rows,
# as the scanner writes them: the oldest tasks then share heap pages.
_TASKS = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner, enqueued_at, completed_at)
SELECT t.tenant_id, t.workspace_id, t.brand_id, (%(questions)s::bigint[])[g.ti * %(q)s::bigint + g.qi + 1],
       (%(platforms)s::bigint[])[g.pi + 1], g.day, %(status)s::text, 100, 'normal',
       t.tenant_id || ':' || t.brand_id || ':' || to_char(g.day, 'YYYY-MM-DD'), 'desktop_tasks',
       now() - CASE WHEN %(in_order)s THEN 1 - g.i::float8 / %(n)s ELSE random() END * interval '1 hour',
       CASE WHEN %(status)s::text = 'completed' THEN now() END
FROM (SELECT i, i %% %(t)s::bigint AS ti, (i / %(t)s::bigint) %% %(p)s::bigint AS pi,
             (i / (%(t)s::bigint * %(p)s::bigint)) %% %(q)s::bigint AS qi,
             current_date - %(first_day)s - (i / (%(t)s::bigint * %(p)s::bigint * %(q)s::bigint))::int AS day
      FROM generate_series(0, %(n)s - 1) i) g
JOIN unnest(%(tenants)s::bigint[], %(workspaces)s::bigint[], %(brands)s::bigint[]) WITH ORDINALITY
     AS t(tenant_id, workspace_id, brand_id, k) ON t.k = g.ti + 1
"""
# One finished execution per finished task, created evenly over the last and next 10 minutes, in creation order
# (as the coordinator writes them: a window's executions share few heap pages).
_WINDOW_EXECUTIONS = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
                           source, monitor_task_id, enqueued_at, brand_id, question_id, ai_platform_id, business_date,
                           lease_epoch, created_at, updated_at, finished_at)
SELECT gen_random_uuid(), 'monitor', m.tenant_id, m.workspace_id, c.client_id, 'succeeded', 100, 'normal',
       %(weight)s, 'daily_schedule', m.id, m.enqueued_at, m.brand_id, m.question_id, m.ai_platform_id,
       m.business_date, 1, m.created, m.created, m.created
FROM (SELECT m.*, now() + (random() * 20 - 10) * interval '1 minute' AS created FROM monitoring_collect_tasks m
      WHERE m.status = 'completed') m
JOIN unnest(%(tenants)s::bigint[], %(clients)s::uuid[]) AS c(tenant_id, client_id) ON c.tenant_id = m.tenant_id
ORDER BY m.created
"""
# A year of history (BACKLOG_HISTORY_DAYS): every finished task older than the windows' gets a succeeded execution
# created on its business day, and an attempt.
_HISTORY_EXECUTIONS = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
                           source, monitor_task_id, enqueued_at, brand_id, question_id, ai_platform_id, business_date,
                           lease_epoch, created_at, updated_at, started_at, finished_at)
SELECT gen_random_uuid(), 'monitor', m.tenant_id, m.workspace_id, c.client_id, 'succeeded', 100, 'normal',
       %(weight)s, 'daily_schedule', m.id, m.business_date + time '03:00', m.brand_id, m.question_id,
       m.ai_platform_id, m.business_date, 1, m.business_date + time '03:00', m.business_date + time '03:05',
       m.business_date + time '03:01', m.business_date + time '03:05'
FROM monitoring_collect_tasks m
JOIN unnest(%(tenants)s::bigint[], %(clients)s::uuid[]) AS c(tenant_id, client_id) ON c.tenant_id = m.tenant_id
WHERE m.status = 'completed' AND m.business_date <= current_date - %(before)s
ORDER BY m.business_date
"""
_HISTORY_ATTEMPTS = """
INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, lease_epoch, status, started_at,
                                   finished_at)
SELECT d.id, d.monitor_task_id, d.tenant_id, d.target_client_id, 1, 'succeeded', d.started_at, d.finished_at
FROM desktop_tasks d WHERE d.created_at < now() - interval '1 day' AND d.status = 'succeeded'
"""
# With BACKLOG_HISTORY_RESULTS=1 the history's results too, as ingest writes them: a succeeded run per history
# execution with one answer of the desktop simulator (tools/desktop_sim/answers.py) and its citations, as parse
# results and citation facts, and the daily aggregates of those days.
_HISTORY_RUNS = """
INSERT INTO question_monitor_runs (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, collector_type,
    run_mode, business_date, status, answer_text, brand_mentioned, citation_count, desktop_task_id, client_id,
    result_id, started_at, finished_at)
SELECT d.tenant_id, d.workspace_id, d.brand_id, d.question_id, d.ai_platform_id, 'desktop', 'daily', d.business_date,
       'succeeded', %(answer)s, true, cardinality(%(urls)s::text[]), d.id, d.target_client_id, gen_random_uuid(),
       d.started_at, d.finished_at
FROM desktop_tasks d WHERE d.created_at < now() - interval '1 day' AND d.status = 'succeeded'
ORDER BY d.business_date
"""
_HISTORY_PARSE_RESULTS = """
INSERT INTO question_monitor_parse_results (run_id, tenant_id, citation_fingerprint, url, title, position, domain)
SELECT r.id, r.tenant_id, md5(c.url), c.url, c.title, c.position, split_part(c.url, '/', 3)
FROM question_monitor_runs r
CROSS JOIN unnest(%(urls)s::text[], %(titles)s::text[]) WITH ORDINALITY AS c(url, title, position)
"""
_HISTORY_CITATION_FACTS = """
INSERT INTO monitoring_citation_facts (run_id, tenant_id, brand_id, question_id, ai_platform_id, business_date,
                                       citation_fingerprint, url, domain, position)
SELECT r.id, r.tenant_id, r.brand_id, r.question_id, r.ai_platform_id, r.business_date, md5(c.url), c.url,
       split_part(c.url, '/', 3), c.position
FROM question_monitor_runs r
CROSS JOIN unnest(%(urls)s::text[]) WITH ORDINALITY AS c(url, position)
"""
_HISTORY_DAILY = """
WITH platforms AS (
    INSERT INTO monitoring_brand_platform_daily (tenant_id, brand_id, business_date, ai_platform_id, runs,
        succeeded_runs, brand_mentioned_runs, mention_rate, citations, distinct_cited_domains)
    SELECT tenant_id, brand_id, business_date, ai_platform_id, count(*), count(*), count(*), 1, sum(citation_count),
           cardinality(%(urls)s::text[])
    FROM question_monitor_runs GROUP BY 1, 2, 3, 4
)
INSERT INTO monitoring_brand_daily (tenant_id, brand_id, business_date, runs, succeeded_runs, brand_mentioned_runs,
    mention_rate, citations, distinct_cited_domains)
SELECT tenant_id, brand_id, business_date, count(*), count(*), count(*), 1, sum(citation_count),
       cardinality(%(urls)s::text[])
FROM question_monitor_runs GROUP BY 1, 2, 3
"""
_TABLE_SIZES = """
SELECT c.relname AS name, greatest(c.reltuples, 0)::bigint AS n, pg_total_relation_size(c.oid) AS bytes
FROM pg_class c
WHERE c.relname IN ('monitoring_collect_tasks', 'desktop_tasks', 'desktop_task_attempts', 'legacy_leases',
                    'monitoring_collect_requests', 'question_monitor_runs', 'question_monitor_parse_results',
                    'monitoring_citation_facts', 'monitoring_brand_daily', 'monitoring_brand_platform_daily')
ORDER BY 1
"""
_CLIENTS_ONLINE = """
UPDATE desktop_clients SET online = %(online)s, last_heartbeat_at = now(), connected_hub = 'bench'
WHERE tenant_id = ANY(%(tenants)s::bigint[])
"""
_FINISH_EXECUTIONS = """
UPDATE desktop_tasks SET status = 'succeeded', lease_epoch = 1, finished_at = now(), updated_at = now()
WHERE kind = 'monitor' AND status IN ('queued', 'in_progress', 'unknown')
"""
# The in-process parts leave their passes' events in the outbox, unpublished (no pump runs then): thousands of
# task_available events for executions finished since. The clicks' stack would publish them while the clicks run,
# and the probe would take a stale high event for its click's.
_DROP_OUTBOX = "DELETE FROM outbox WHERE status <> 'published'"
_FINISH_HIGH = """
UPDATE monitoring_collect_tasks SET status = 'completed', completed_at = now()
WHERE tenant_id = %(tenant)s AND status = 'pending' AND dispatch_lane = 'high'
"""
# Every boost undone between `aging`'s rounds, so that each round finds the backlog as loaded.
_UNBOOST = """
UPDATE monitoring_collect_tasks SET dispatch_lane = 'normal', dispatch_priority = 100, aging_boost = 0
WHERE status = 'pending' AND aging_boost > 0
"""
# What a collect-now leaves for the high pass: the probe's task of the day, promoted and bound to its client.
_PROMOTED = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, trigger_source, dispatch_priority, dispatch_lane, target_client_id, ingest_shard_key, execution_owner,
    dispatch_after)
VALUES (%(tenant)s, %(workspace)s, %(brand)s, %(question)s, %(platform)s, current_date - %(day)s, 'pending', 'manual',
        %(priority)s, 'high', %(client)s, %(tenant)s || ':' || %(brand)s || ':' || to_char(current_date - %(day)s,
        'YYYY-MM-DD'), 'desktop_tasks', now())
"""
_DUE_PLANS = """
INSERT INTO monitoring_plans (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, run_mode, next_run_at)
SELECT b.tenant_id, b.workspace_id, b.id, q.id, p, %(run_mode)s, now() - interval '1 second'
FROM brands b JOIN monitoring_questions q ON q.brand_id = b.id CROSS JOIN unnest(%(platforms)s::bigint[]) p
WHERE b.tenant_id = ANY(%(tenants)s::bigint[])
LIMIT %(n)s
"""

# The coordinator's own calls: budgets, limits and queue depths out of the way, so every pass does all its reads.
_INPROC_SETTINGS: dict[str, object] = {
    "cluster_dispatch_per_minute": 10_000_000, "tenant_dispatch_per_minute": 10_000_000,
    "cluster_dispatch_per_minute_ceiling": 10_000_000, "tenant_dispatch_per_minute_ceiling": 10_000_000,
}
# `bench collect_now`'s loaded scenario, with a tenant budget above what the windows' executions already use (its
# 300 a minute is far above what its fleet dispatches; the windows' 5,000 executions a minute would spend it at 10
# tenants). Aging rounds run with these budgets too: a round ages at most twice what they let dispatch before the next.
_CLICK_SETTINGS: dict[str, object] = {
    "max_active_requests_per_tenant": 10_000, "max_requests_per_user_per_hour": 10_000,
    "cluster_dispatch_per_minute": 20_000, "tenant_dispatch_per_minute": 100_000,
}


def tenants_for(size: int, tenants: int | None = None) -> int:
    fixed = tenants or (int(os.environ["BACKLOG_TENANTS"]) if os.environ.get("BACKLOG_TENANTS") else None)
    return max(FLEET_TENANTS, fixed) if fixed else min(1_000, max(FLEET_TENANTS, size // 1_000))


async def _prepare(settings: Settings, *, size: int, clicks: int, window_rate: int,
                   tenants: int | None = None) -> dict[str, Any]:
    """The probe tenant, the fleet's tenants and the bulk tenants; the ready backlog; the windows' executions."""
    conn = await connect(settings.database_url, with_session_timeouts=False)  # bulk loads take minutes at 1,000,000
    started = time.perf_counter()
    try:
        # A question per click, and one more of its own for the in-process high passes and `explain`'s click.
        probe = await seed_demo(conn, tenants=1, brands=1, questions=clicks + 1, clients=1, platforms=("openai",),
                                due=False)
        fleet = await seed_demo(conn, tenants=FLEET_TENANTS, brands=1, questions=QUESTIONS, clients=5, due=False,
                                platforms=PLATFORMS)
        platforms = [p["ai_platform_id"] for p in fleet["platforms"]]
        fleet_ids = [t["tenant_id"] for t in fleet["tenants"]]
        cur = await conn.execute(_BULK_TENANTS, {"n": tenants_for(size, tenants) - FLEET_TENANTS})
        bulk_ids = [r["id"] for r in await cur.fetchall()]
        if bulk_ids:
            for statement in (_BULK_BRANDS, _BULK_QUESTIONS, _BULK_TENANT_PLATFORMS, _BULK_CLIENTS):
                await conn.execute(statement, {"tenants": bulk_ids, "q": QUESTIONS, "platforms": platforms})
        cur = await conn.execute(_TENANTS, {"tenants": fleet_ids + bulk_ids})
        rows = await cur.fetchall()
        tenant_ids: list[int] = [r["tenant_id"] for r in rows]
        shape: dict[str, Any] = {"tenants": tenant_ids, "workspaces": [r["workspace_id"] for r in rows],
                 "brands": [r["brand_id"] for r in rows],
                 "questions": [q for r in rows for q in r["questions"][:QUESTIONS]],
                 "platforms": platforms, "t": len(rows), "p": len(platforms), "q": QUESTIONS}
        per_day = len(rows) * len(platforms) * QUESTIONS
        shape["in_order"] = os.environ.get("BACKLOG_ENQUEUE_ORDER", "random") == "insert"
        await conn.execute(_TASKS, {**shape, "n": size, "status": "pending", "first_day": 1})
        finished = window_rate * 20
        await conn.execute(_TASKS, {**shape, "n": finished, "status": "completed",
                                    "first_day": 2 + size // per_day})
        await conn.execute(_WINDOW_EXECUTIONS, {"tenants": tenant_ids, "weight": lane_weight("monitor", "normal"),
                                                "clients": [r["client_id"] for r in rows]})
        history_days = int(os.environ.get("BACKLOG_HISTORY_DAYS", "0"))
        if history_days:
            first = 2 + size // per_day + finished // per_day + 1
            await conn.execute(_TASKS, {**shape, "n": per_day * history_days, "status": "completed",
                                        "first_day": first})
            await conn.execute(_HISTORY_EXECUTIONS, {"tenants": tenant_ids, "clients": [r["client_id"] for r in rows],
                                                     "weight": lane_weight("monitor", "normal"),
                                                     "before": first})
            await conn.execute(_HISTORY_ATTEMPTS)
            if os.environ.get("BACKLOG_HISTORY_RESULTS", "0") == "1":
                answer = compose_answer(question="Which CRM tools are best for small teams?", brand="Acme",
                                        platform="openai", rng=random.Random(3), mention_rate=1.0)
                cites = {"answer": answer.text, "urls": [str(c["url"]) for c in answer.citations],
                         "titles": [str(c["title"]) for c in answer.citations]}
                for statement in (_HISTORY_RUNS, _HISTORY_PARSE_RESULTS, _HISTORY_CITATION_FACTS, _HISTORY_DAILY):
                    await conn.execute(statement, cites)
                print(f"  {size:,}: history results: a {len(answer.text)}-character answer with "
                      f"{len(answer.citations)} citations each", flush=True)
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1000, max_queue_depth = 1000 "
                           "WHERE tenant_id = %s", (probe["tenants"][0]["tenant_id"],))
        await conn.execute("UPDATE platform_settings SET max_concurrent = 1000")
        await conn.execute("VACUUM ANALYZE")
        cur = await conn.execute("SELECT count(*) AS n FROM monitoring_collect_tasks WHERE status = 'pending'")
        ready = (await cur.fetchone() or {"n": 0})["n"]
        cur = await conn.execute(_TABLE_SIZES)
        sizes = await cur.fetchall()
    finally:
        await conn.close()
    print(f"  {size:,}: {ready:,} ready tasks over {len(rows)} tenants, {finished:,} executions in the windows "
          f"around now; loaded in {time.perf_counter() - started:.0f} s", flush=True)
    for r in sizes:  # what a year of history weighs: rows, bytes with indexes, bytes a row
        print(f"  {size:,}: table {r['name']}: {r['n']:,} rows, {r['bytes'] / 2**20:,.1f} MiB with its indexes, "
              f"{r['bytes'] / max(1, r['n']):,.0f} bytes a row", flush=True)
    return {"probe": probe["tenants"][0], "probe_platform": probe["platforms"][0]["ai_platform_id"],
            "background": fleet, "platforms": platforms,
            "tenants": [*tenant_ids, probe["tenants"][0]["tenant_id"]], "backlog_tenants": tenant_ids}


async def _apply(settings: Settings, values: dict[str, object]) -> None:
    conn = await connect(settings.database_url)
    try:
        for key, value in values.items():
            await set_setting(conn, key, value)
    finally:
        await conn.close()


# What a full pass's snapshot read of every eligible client returned (before it read only its window's clients).
_ELIGIBLE_CLIENTS = """
SELECT count(*) AS n FROM desktop_clients c
WHERE c.online AND c.disabled_at IS NULL
  AND c.last_heartbeat_at > now() - make_interval(secs => %(heartbeat_timeout_s)s)
"""


async def _timed(timings: dict[str, list[float]], name: str, call: Callable[[], Awaitable[Any]]) -> Any:
    started = time.perf_counter()
    result = await call()
    timings[name].append((time.perf_counter() - started) * 1000)
    return result


async def _budget_read(conn: Conn, settings: DispatchSettings) -> None:
    """Every tenant's use of the budget window: what a full pass's snapshot read until it read the window's totals and
    its tenants' use with their clients (the "tenant budget rows" of the table); a pass that reads no non-high
    candidate still reads it."""
    window = max(1, settings.budget_window_seconds)
    await dispatch_reads.budget_use(conn, window_start=int(time.time() // window * window), window_seconds=window)


async def _promote(conn: Conn, world: dict[str, Any], day: int) -> None:
    """The probe's own question (not one the clicks use) on a past business day (`explain`'s click takes today)."""
    probe = world["probe"]
    await conn.execute(_PROMOTED, {
        "tenant": probe["tenant_id"], "workspace": probe["workspace_id"], "brand": probe["brands"][0]["brand_id"],
        "question": probe["brands"][0]["question_ids"][-1], "platform": world["probe_platform"],
        "client": probe["clients"][0]["client_id"], "priority": HIGH_PRIORITY, "day": day})


async def _one_round(pool: AsyncConnectionPool[Conn], dispatcher: Dispatcher, world: dict[str, Any],
                     settings: DispatchSettings, timings: dict[str, list[float]], n: int, *, tick: bool = True) -> None:
    async with pool.connection() as conn:
        await conn.execute(_CLIENTS_ONLINE, {"online": True, "tenants": world["tenants"]})
    cpu = time.process_time()
    outcome = await _timed(timings, "full pass", lambda: dispatcher.run_pass(settings))
    timings["full pass CPU"].append((time.process_time() - cpu) * 1000)
    timings["full pass dispatched"].append(outcome.dispatched)
    client_reads = getattr(dispatcher, "client_reads", None)
    if client_reads is not None:
        timings["full pass client rows"].append(client_reads.rows)
        if hasattr(client_reads, "budget_rows"):  # not before (A/B runs): its snapshot read every tenant's
            timings["full pass budget rows"].append(client_reads.budget_rows)
    else:  # a dispatcher from before its client reads (A/B runs): its snapshot read every eligible client
        async with pool.connection() as conn:
            cur = await conn.execute(_ELIGIBLE_CLIENTS, {"heartbeat_timeout_s": settings.heartbeat_timeout_seconds})
            row = await cur.fetchone()
            assert row is not None
            timings["full pass client rows"].append(row["n"])
    reads = getattr(dispatcher, "candidate_reads", None)  # None: a dispatcher from before the count (A/B runs)
    if reads is not None:
        timings["full pass candidate statements"].append(reads.statements)
        timings["full pass candidate rows"].append(reads.rows)
    async with pool.connection() as conn:
        await conn.execute(_FINISH_EXECUTIONS)
        await _promote(conn, world, n + 1)
    high = await _timed(timings, "high pass", lambda: dispatcher.run_high_pass(settings))
    timings["high pass dispatched"].append(high.dispatched)
    async with pool.connection() as conn:
        await conn.execute(_FINISH_EXECUTIONS)
        await conn.execute(_FINISH_HIGH, {"tenant": world["probe"]["tenant_id"]})
        # The pending pairs' re-read the pass may have started in the background (on this event loop: its rows are
        # decoded between the tick's statements) is the dispatcher's work, not the tick's: finished first.
        if (refreshing := getattr(getattr(dispatcher, "pending", None), "refreshing", None)) is not None:
            await refreshing
        if tick:
            cpu = time.process_time()
            await _timed(timings, "backlog gauges", lambda: observe_backlog(conn))
            timings["backlog gauges CPU"].append((time.process_time() - cpu) * 1000)
        await _timed(timings, "budget read", lambda: _budget_read(conn, settings))
        await conn.execute(_DUE_PLANS, {"run_mode": f"bench-{n}", "platforms": world["platforms"],
                                        "tenants": world["backlog_tenants"], "n": SCAN_PLANS})
    scanned = await _timed(timings, "scanner", lambda: scan_once(pool, batch_size=2_000, rollout_percentage=100))
    timings["scanner created"].append(scanned.created)


async def _inproc_pool(settings: Settings) -> tuple[AsyncConnectionPool[Conn], DispatchSettings]:
    """The in-process part's settings applied, its open pool (the caller closes it) and the dispatch settings."""
    await _apply(settings, _INPROC_SETTINGS)
    pool = make_pool(settings, name="bench-backlog", min_size=2, max_size=4, prepare_threshold=PREPARE_ON_FIRST_USE)
    await pool.open(wait=True)
    async with pool.connection() as conn:
        return pool, await load_settings(conn)


async def _inproc(settings: Settings, world: dict[str, Any], *, rounds: int,
                  aging_rounds: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = defaultdict(list)
    pool, dispatch_settings = await _inproc_pool(settings)
    try:
        dispatcher = Dispatcher(pool)
        for n in range(rounds + 1):
            await _one_round(pool, dispatcher, world, dispatch_settings, timings, n)
            if n == 0:  # the first round plans every statement on cold connections: not counted
                timings.clear()
        await _apply(settings, _CLICK_SETTINGS)
        async with pool.connection() as conn:
            dispatch_settings = await load_settings(conn)
        for _ in range(aging_rounds):
            aged: AgingRound = await _timed(timings, "aging round", lambda: run_aging(pool, dispatch_settings))
            timings["aging round boosted"].append(aged.boosted)
    finally:
        await pool.close()
    return timings


async def _inproc_turns(size: int, tenant_counts: list[int], *, clicks: int, window_rate: int,
                        rounds: int) -> list[tuple[int, int, str, dict[str, list[float]]]]:
    """`inproc`'s rounds (no aging, no tick) on one database per tenant count at this size, taking turns round by
    round: the machine's drift (other work, the host) falls on every count alike, so their ratio is the code's. The
    tick is left out: the gauges are this process's, and databases taking turns would rewrite every label each tick."""
    async with contextlib.AsyncExitStack() as stack:
        runs: list[tuple[dict[str, Any], AsyncConnectionPool[Conn], Dispatcher, DispatchSettings,
                         dict[str, list[float]]]] = []
        for tenants in tenant_counts:
            base = await stack.enter_async_context(bench_environment(shards=16))
            settings = replace(base, gateway_jwt_secret=JWT_SECRET)
            world = await _prepare(settings, size=size, clicks=clicks, window_rate=window_rate, tenants=tenants)
            pool, dispatch_settings = await _inproc_pool(settings)
            stack.push_async_callback(pool.close)
            runs.append((world, pool, Dispatcher(pool), dispatch_settings, defaultdict(list)))
        load_at_start = os.getloadavg()[0]
        for n in range(rounds + 1):
            for world, pool, dispatcher, dispatch_settings, timings in runs:
                await _one_round(pool, dispatcher, world, dispatch_settings, timings, n, tick=False)
                if n == 0:  # cold connections: not counted
                    timings.clear()
        load = f"{load_at_start:.1f} -> {os.getloadavg()[0]:.1f}"
        first = percentile(runs[0][4]["full pass"], 50)
        for (_, _, _, _, timings), tenants in zip(runs, tenant_counts, strict=True):
            full = percentile(timings["full pass"], 50)
            print(f"  {size:,} / {tenants:,} tenants, in turns: full pass p50 {full:.1f} ms ({full / first:.2f}x the "
                  f"first), CPU p50 {percentile(timings['full pass CPU'], 50):.1f} ms", flush=True)
        return [(size, len(world["backlog_tenants"]), load, timings) for world, _, _, _, timings in runs]


async def _aging(settings: Settings, world: dict[str, Any], *, size: int, rounds: int,
                 plans_out: str | None) -> dict[str, list[float]]:
    """Aging rounds at the dispatch pace and at the budget's limit, taking turns, a full pass before each."""
    await _apply(settings, _INPROC_SETTINGS)
    timings: dict[str, list[float]] = defaultdict(list)
    pool = make_pool(settings, name="bench-aging", min_size=2, max_size=4, prepare_threshold=PREPARE_ON_FIRST_USE)
    plans: list[Plan] = []
    explained = explaining_pool(settings.database_url, plans)
    await pool.open(wait=True)
    await explained.open(wait=True)
    text: list[str] = []
    try:
        async with pool.connection() as conn:
            pass_settings = await load_settings(conn)
            await _apply(settings, _CLICK_SETTINGS)
            aging_settings = await load_settings(conn)
            await observe_backlog(conn)  # a running leader's census: its first sweep complete
        ceiling = aging_round_limit(aging_settings)
        dispatcher, pace = Dispatcher(pool), aging_pace()

        async def dispatch() -> int:
            async with pool.connection() as conn:
                # Before the pass, so that the pages the undo dirtied (20,000 rows after a round at the budget's
                # limit) are not all written out by the next round's reads; and vacuumed, as autovacuum would keep
                # up in a running system: rounds that rewrite the same oldest tasks twice each (the boost, its undo)
                # leave the front of ix_collect_tasks_aging full of dead entries (33,000 heap fetches for a batch of
                # 500 at 10,000 ready tasks after 20 rounds without).
                await conn.execute(_UNBOOST)
                await conn.execute("VACUUM monitoring_collect_tasks")
                await conn.execute(_CLIENTS_ONLINE, {"online": True, "tenants": world["tenants"]})
            outcome = await dispatcher.run_pass(pass_settings)
            async with pool.connection() as conn:
                await conn.execute(_FINISH_EXECUTIONS)
            timings["aging: full pass dispatched"].append(outcome.dispatched)
            return outcome.dispatched - outcome.high_dispatched

        async def one(variant: str, on: AsyncConnectionPool[Conn]) -> AgingRound:
            dispatched = await dispatch()
            limit = pace.limit(dispatched, ceiling) if variant == "paced" else None
            started = time.perf_counter()
            aged = await run_aging(on, aging_settings, limit=limit)
            if on is pool:
                timings[f"aging {variant}"].append((time.perf_counter() - started) * 1000)
                timings[f"aging {variant} boosted"].append(aged.boosted)
                timings[f"aging {variant} statements"].append(aged.statements)
            return aged

        for n in range(rounds + 1):
            for variant in ("paced", "budget"):
                await one(variant, pool)
            if n == 0:  # the first rounds plan every statement on cold connections: not counted
                timings.clear()
        for variant in ("paced", "budget"):
            plans.clear()
            aged = await one(variant, explained)
            mine = [p for p in plans if not p.query.startswith("SELECT 1 FROM ONLY")]  # not a trigger's key check
            timings[f"aging {variant} buffers"].append(sum(p.buffers for p in mine))
            print(f"  aging {variant} (explained): {aged.boosted:,} boosted, limit {aged.limit:,}, "
                  f"{aged.statements} statements, {sum(p.buffers for p in mine):,} buffers", flush=True)
            for plan in mine:
                if (line := _plan_summary(plan.text)) is not None:
                    print(f"  aging {variant}: {line[1]}", flush=True)
            text.append(f"==== {size:,} ready tasks: aging round, {variant}: {len(mine)} statements")
            text.extend(p.text for p in mine)
    finally:
        await explained.close()
        await pool.close()
    if plans_out:  # every size's after the last's (`run` empties the file first)
        await asyncio.to_thread(_append, Path(plans_out), "\n".join(text) + "\n")
        print(f"  aging plans written to {plans_out}", flush=True)
    return timings


def _append(path: Path, text: str) -> None:
    with path.open("a") as out:
        out.write(text)


def _explaining_pool(settings: Settings, plans: list[str]) -> AsyncConnectionPool[Conn]:
    """Connections whose every statement (and every statement of a trigger) sends its EXPLAIN (ANALYZE, BUFFERS)
    back as a notice: auto_explain loaded in these sessions only."""
    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        if diag.message_primary and "plan:" in diag.message_primary:
            plans.append(diag.message_primary)

    async def configure(conn: Conn) -> None:
        await conn.set_autocommit(True)
        conn.add_notice_handler(on_notice)
        for statement in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                          "SET auto_explain.log_analyze = on", "SET auto_explain.log_buffers = on",
                          "SET auto_explain.log_nested_statements = on", "SET auto_explain.log_triggers = on",
                          "SET auto_explain.log_level = notice", "SET client_min_messages = notice"):
            await conn.execute(statement)

    return AsyncConnectionPool(settings.database_url, min_size=1, max_size=2, open=False, configure=configure,
                               kwargs={"row_factory": dict_row, "application_name": "bench-backlog-explain"})


_SCAN_NODE = re.compile(r"((?:Parallel )?(?:Index Only Scan|Index Scan|Bitmap Index Scan|Seq Scan|Bitmap Heap Scan|"
                        r"Tid Scan)(?: Backward)?(?: using| on) \S+)")
_ACTUAL_ROWS = re.compile(r"actual time=\S+ rows=(\d+) loops=(\d+)")


def _duration_ms(plan: str) -> float:
    head = plan.split("plan:", 1)[0]
    return float(head.split("duration:", 1)[1].split("ms", 1)[0]) if "duration:" in head else 0.0


def _plan_summary(plan: str) -> tuple[str, str] | None:
    """One line for a statement's plan: duration, the statement's start, the top node's rows, its buffers and every
    scan (index or table) with the rows it returned, after the statement's text (its first 80 characters); None for
    a foreign-key check of a trigger."""
    lines = plan.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Query Text:")), 0)
    top = next((i for i in range(start + 1, len(lines)) if "(cost=" in lines[i]), len(lines))
    query = " ".join(" ".join(lines[start:top])[len("Query Text:"):].split())
    if query.startswith("SELECT 1 FROM ONLY"):
        return None
    node = lines[top].strip() if top < len(lines) else ""
    rows = _ACTUAL_ROWS.search(node)
    buffers = next((line.strip() for line in lines[top:] if line.strip().startswith("Buffers:")), "")
    scans: list[str] = []
    for line in lines[top:]:
        found, counted = _SCAN_NODE.search(line), _ACTUAL_ROWS.search(line)
        if found and counted:
            scans.append(f"{found.group(1)} rows={counted.group(1)}x{counted.group(2)}")
    return query[:80], (f"{_duration_ms(plan):.3f} ms | {query[:80]} | {node.split('  (')[0]} "
                        f"rows={rows.group(1) if rows else '?'} | {buffers or 'Buffers: -'} | "
                        f"{'; '.join(scans) or 'no scans'}")



_TABLE_ROWS = """
SELECT (SELECT count(*) FROM monitoring_collect_tasks) AS business_tasks, (SELECT count(*) FROM desktop_tasks) AS
       executions, (SELECT count(*) FROM desktop_task_attempts) AS attempts, (SELECT count(*) FROM legacy_leases) AS
       legacy_leases, (SELECT count(*) FROM monitoring_collect_requests) AS collect_requests
"""


async def _retention(settings: Settings) -> None:
    """The history retention job with its defaults until a run deletes nothing: each run's time and deletions, and the
    task tables' rows before and after."""
    conn = await connect(settings.database_url, with_session_timeouts=False)
    try:
        before = await (await conn.execute(_TABLE_ROWS)).fetchone() or {}
        # The first batch with EXPLAIN (ANALYZE, BUFFERS): a line per statement (the foreign-key checks its deletes
        # make, summed).
        plans: list[str] = []
        pool = _explaining_pool(settings, plans)
        await pool.open(wait=True)
        try:
            async with pool.connection() as explained:
                await run_job(JOBS["history_retention"], explained, ReconcilerConfig(retention_batches_per_run=1))
        finally:
            await pool.close()
        checks = [_duration_ms(plan) for plan in plans if _plan_summary(plan) is None]
        for plan in plans:
            if (summary := _plan_summary(plan)) is not None:
                print(f"  retention batch 1: {summary[1]}", flush=True)
        print(f"  retention batch 1: {len(checks)} foreign-key checks (RI triggers), {sum(checks):.2f} ms in all",
              flush=True)
        config = ReconcilerConfig()
        runs = 0
        while True:
            started, cpu = time.perf_counter(), time.process_time()
            result = await run_job(JOBS["history_retention"], conn, config)
            runs += 1
            print(f"  retention run {runs}: {(time.perf_counter() - started) * 1000:,.0f} ms "
                  f"({(time.process_time() - cpu) * 1000:,.0f} ms of it this process's CPU), deleted "
                  + (", ".join(f"{k} {v:,}" for k, v in sorted(result.details.items())) or "nothing"), flush=True)
            if not result.fixed:
                break
        after = await (await conn.execute(_TABLE_ROWS)).fetchone() or {}
        for name in before:
            print(f"  retention: {name} {before[name]:,} rows -> {after[name]:,}", flush=True)
    finally:
        await conn.close()


async def _explain(settings: Settings, world: dict[str, Any], out: str | None) -> None:
    await _apply(settings, _INPROC_SETTINGS)
    plans: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    pool = _explaining_pool(settings, plans)
    await pool.open(wait=True)
    try:
        async with pool.connection() as conn:
            dispatch_settings = await load_settings(conn)
            await conn.execute(_CLIENTS_ONLINE, {"online": True, "tenants": world["tenants"]})
        plans.clear()
        dispatcher = Dispatcher(pool)

        async def tick() -> None:
            async with pool.connection() as conn:
                await observe_backlog(conn)
                await measure_signals(conn, dispatcher.write_stats)
                await publish_state(conn, "leader", {"instance_id": "bench"})

        async def aging() -> None:  # with the clicks' budgets, as `inproc` measures it
            await _apply(settings, _CLICK_SETTINGS)
            async with pool.connection() as conn:
                aging_settings = await load_settings(conn)
            plans.clear()
            await run_aging(pool, aging_settings)

        async def scan() -> None:
            async with pool.connection() as conn:
                await conn.execute(_DUE_PLANS, {"run_mode": f"explain-{uuid.uuid4().hex[:8]}", "n": SCAN_PLANS,
                                                "platforms": world["platforms"], "tenants": world["backlog_tenants"]})
            plans.clear()
            await scan_once(pool, batch_size=2_000, rollout_percentage=100)

        # Steady state, as a running leader sees it: a full pass has started the budget ledger and the backlog
        # census has completed its first sweep (both once per leader: their plans are not shown).
        await dispatcher.run_pass(dispatch_settings)
        await tick()
        probe = world["probe"]
        principal = TenantPrincipal(tenant_id=probe["tenant_id"], workspace_id=probe["workspace_id"],
                                    user_id=probe["user_id"])
        click = CollectNowRequest(target_client_id=uuid.UUID(probe["clients"][0]["client_id"]),
                                  question_ids=[probe["brands"][0]["question_ids"][-1]])
        plans.clear()
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("collect-now request", lambda: collect_now(pool, principal, probe["brands"][0]["brand_id"], click,
                                                        dispatch_settings)),
            ("high pass (the click's task)", lambda: dispatcher.run_high_pass(dispatch_settings)),
            ("full pass", lambda: dispatcher.run_pass(dispatch_settings)),
            ("maintenance tick", tick),
            ("aging round", aging),
            ("scanner batch", scan)]
        for name, step in steps:
            await step()
            sections.append((name, list(plans)))
            plans.clear()
    finally:
        await pool.close()
    text: list[str] = []
    for name, statements in sections:
        text.append(f"==== {name}: {len(statements)} statements")
        checks: list[float] = []
        runs: list[tuple[str, list[float], str]] = []  # consecutive runs of one statement: (text, durations, slowest)
        for plan in statements:
            text.append(plan)
            summary = _plan_summary(plan)
            if summary is None:
                checks.append(_duration_ms(plan))
                continue
            query, line = summary
            duration = _duration_ms(plan)
            if runs and runs[-1][0] == query:
                durations = runs[-1][1]
                runs[-1] = (query, durations, line if duration > max(durations) else runs[-1][2])
                durations.append(duration)
            else:
                runs.append((query, [duration], line))
        for _, durations, line in runs:  # the full pass's candidate chunks, say: one line, its slowest plan
            more = (f"{len(durations)} statements like it, {sum(durations):.2f} ms in all; the slowest: "
                    if len(durations) > 1 else "")
            print(f"  {name}: {more}{line}", flush=True)
        if checks:  # a trigger's statement per inserted row and key: one line for them all
            print(f"  {name}: {len(checks)} foreign-key checks (RI triggers), {sum(checks):.2f} ms in all, "
                  f"the slowest {max(checks):.3f} ms", flush=True)
    if out:
        await asyncio.to_thread(Path(out).write_text, "\n".join(text) + "\n")
        print(f"  full plans written to {out}", flush=True)


async def _stages(settings: Settings, marks: list[Click]) -> list[float]:
    """Click -> the start of the coordinator's high pass (its outbox row's created_at), per click."""
    starts: list[float] = []
    conn = await connect(settings.database_url)
    try:
        for mark in marks:
            cur = await conn.execute(_DISPATCH_ROW, {"task": f"%{mark.task_id}%".encode()})
            row = await cur.fetchone()
            if row is not None:
                starts.append((row["dispatched"] - mark.clicked) * 1000)
    finally:
        await conn.close()
    return starts


async def _clicks(settings: Settings, world: dict[str, Any], clicks: int) -> dict[str, list[float]]:
    """`bench collect_now`'s loaded scenario on this database: the real processes, the fleet, the clicks."""
    await _apply(settings, _CLICK_SETTINGS)
    conn = await connect(settings.database_url)
    try:  # the bulk clients have no desktop behind them; the fleet's and the probe's come online on their sockets
        await conn.execute(_CLIENTS_ONLINE, {"online": False, "tenants": world["tenants"]})
        await conn.execute(_FINISH_EXECUTIONS)
        cur = await conn.execute(_DROP_OUTBOX)
        if cur.rowcount:
            print(f"  {cur.rowcount:,} unpublished outbox events of the in-process parts dropped", flush=True)
    finally:
        await conn.close()
    with tempfile.TemporaryDirectory() as logs:
        async with running_stack(settings, Path(logs), DB_POOL_MAX=6) as stack:
            fleet = await _start_fleet(stack, world)
            try:
                await asyncio.sleep(5)  # dispatch reaches its steady state with the fleet working
                await _analyze(settings)
                latencies, marks = await _measure(settings, stack, world, clicks)
                to_socket = latencies.to_socket
            finally:
                totals = await _stop_fleet(fleet)
    print(f"  the fleet executed {totals.get('executed', '?')} normal tasks meanwhile", flush=True)
    await _breakdown(settings, "clicks", marks)  # `bench collect_now`'s stages and slowest clicks
    return {"click -> socket": to_socket, "click -> high pass starts": await _stages(settings, marks)}


def _fmt(values: list[float], pct: float) -> str:
    return f"{percentile(values, pct):,.1f}" if values else "-"


def _pair(values: list[float] | None, high: float) -> str:
    return f"{_fmt(values, 50)} / {_fmt(values, high)}" if values else "-"


# (row label, timing, the upper percentile): the table's rows, in the order of a click's and a tick's work.
_ROWS = (
    ("click -> task_available on the socket, p50 / p99", "click -> socket", 99),
    ("click -> coordinator's high pass starts, p50 / p99", "click -> high pass starts", 99),
    ("high pass (one promoted task), p50 / p95", "high pass", 95),
    ("full pass, p50 / p95", "full pass", 95),
    ("  tasks dispatched by a full pass, p50 / p95", "full pass dispatched", 95),
    ("  candidate statements of a full pass, p50 / p95", "full pass candidate statements", 95),
    ("  candidate rows read by a full pass, p50 / p95", "full pass candidate rows", 95),
    ("  client rows read by a full pass, p50 / p95", "full pass client rows", 95),
    ("  tenant budget rows read by a full pass (with its clients), p50 / p95", "full pass budget rows", 95),
    ("  CPU of a full pass (this process), p50 / p95", "full pass CPU", 95),
    ("budget read, p50 / p95", "budget read", 95),
    ("backlog gauges (one maintenance tick), p50 / p95", "backlog gauges", 95),
    ("  CPU of a tick (this process), p50 / p95", "backlog gauges CPU", 95),
    ("scanner (300 due plans), p50 / p95", "scanner", 95),
    ("aging round, p50 / p95", "aging round", 95),
    ("  tasks boosted by a round, p50 / p95", "aging round boosted", 95),
    ("aging round at the dispatch pace, p50 / p95", "aging paced", 95),
    ("  tasks boosted, p50 / p95", "aging paced boosted", 95),
    ("  statements, p50 / p95", "aging paced statements", 95),
    ("  buffers (the explained round)", "aging paced buffers", 95),
    ("aging round at the budget's limit, p50 / p95", "aging budget", 95),
    ("  tasks boosted, p50 / p95", "aging budget boosted", 95),
    ("  statements, p50 / p95", "aging budget statements", 95),
    ("  buffers (the explained round)", "aging budget buffers", 95),
    ("  tasks dispatched by the full pass before a round, p50 / p95", "aging: full pass dispatched", 95),
)


def _table(results: list[tuple[int, int, str, dict[str, list[float]]]]) -> str:
    """A column per size; timings in ms."""
    lines = ["| | " + " | ".join(f"{size:,}" for size, _, _, _ in results) + " |",
             "|---|" + "---|" * len(results),
             "| tenants | " + " | ".join(str(tenants) for _, tenants, _, _ in results) + " |",
             "| load average (1 min) at start -> end | " + " | ".join(load for _, _, load, _ in results) + " |"]
    for label, name, high in _ROWS:
        lines.append(f"| {label} | " + " | ".join(_pair(t.get(name), high) for _, _, _, t in results) + " |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> None:
    default_sizes = "1000,10000" if args.quick else "1000,10000,100000,1000000"
    sizes = [int(s) for s in os.environ.get("BACKLOG_SIZES", default_sizes).split(",") if s.strip()]
    parts = set(os.environ.get("BACKLOG_PARTS", "inproc,clicks").split(","))
    clicks = int(os.environ.get("BACKLOG_CLICKS", "15" if args.quick else "100"))
    window_rate = int(os.environ.get("BACKLOG_WINDOW_RATE", "5000"))
    rounds, aging_rounds = (3, 2) if args.quick else (20, 10)
    results: list[tuple[int, int, str, dict[str, list[float]]]] = []
    if "aging" in parts and os.environ.get("BACKLOG_AGING_PLANS"):
        await asyncio.to_thread(Path(os.environ["BACKLOG_AGING_PLANS"]).write_text, "")
    turns = [int(t) for t in os.environ.get("BACKLOG_TENANT_TURNS", "").split(",") if t.strip()]
    for size in sizes:
        if turns:
            results.extend(await _inproc_turns(size, turns, clicks=clicks, window_rate=window_rate, rounds=rounds))
            continue
        load_at_start = os.getloadavg()[0]
        print(f"  {size:,}: load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
        async with bench_environment(shards=16) as base:
            settings = replace(base, gateway_jwt_secret=JWT_SECRET)
            world = await _prepare(settings, size=size, clicks=clicks, window_rate=window_rate)
            timings: dict[str, list[float]] = {}
            if "explain" in parts:
                await _explain(settings, world, os.environ.get("BACKLOG_EXPLAIN_OUT"))
            if "inproc" in parts:
                timings.update(await _inproc(settings, world, rounds=rounds, aging_rounds=aging_rounds))
                for name, values in sorted(timings.items()):
                    print(f"  {size:,} in-process {name}: " + ", ".join(f"{v:.1f}" for v in values), flush=True)
            if "retention" in parts:
                await _retention(settings)
            if "aging" in parts:
                aged = await _aging(settings, world, size=size, rounds=3 if args.quick else 10,
                                    plans_out=os.environ.get("BACKLOG_AGING_PLANS"))
                timings.update(aged)
                for name, values in sorted(aged.items()):
                    print(f"  {size:,} {name}: " + ", ".join(f"{v:.1f}" for v in values), flush=True)
            if "clicks" in parts:
                timings.update(await _clicks(settings, world, clicks))
                for name in ("click -> socket", "click -> high pass starts"):
                    values = timings[name]
                    print(f"  {size:,} {name} (ms): p50 {_fmt(values, 50)} p90 {_fmt(values, 90)} "
                          f"p99 {_fmt(values, 99)} max {_fmt(values, 100)}", flush=True)
            load = f"{load_at_start:.1f} -> {os.getloadavg()[0]:.1f}"
            results.append((size, len(world["backlog_tenants"]), load, timings))
    print("\n" + _table(results), flush=True)
