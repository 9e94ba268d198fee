"""Reconciler throughput: how fast the jobs repair mass failures, and what an idle run costs.

- expired leases: N in-progress executions whose lease expired (a hub or a fleet died at once),
  repaired by repeated `expired_leases` runs (batch 500, one short transaction per row);
- offline clients: C clients lose their heartbeat with N queued executions waiting for them;
- unknown executions: N results accepted but never ingested (lease gone, no run row): marked
  unknown and converged to aborted + business retry;
- idle cost: one run of every job over a database holding 20,000 finished executions and 10,000
  pending business tasks, nothing to fix (what the leader pays every interval).
"""

from __future__ import annotations

import argparse
import logging
import time

from bench.common import bench_environment, percentile
from libs.db.pool import Conn, connect
from libs.demo import seed_demo
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.runner import run_job

_TASKS = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    ingest_shard_key, execution_owner, dispatch_attempts, status, run_mode)
SELECT %(tenant)s, %(tenant)s, %(brand)s, %(question)s, %(platform)s, current_date, 'k', 'desktop_tasks',
       %(attempts)s,
       %(status)s, 'bench-' || %(tag)s || '-' || g
FROM generate_series(1, %(n)s) g
"""

_EXECUTIONS = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
    source, monitor_task_id, ai_platform_id, brand_id, question_id, business_date, lease_epoch, leased_at,
    lease_expires_at, result_received_at, finished_at)
SELECT gen_random_uuid(), 'monitor', t.tenant_id, t.workspace_id,
       (%(clients)s::uuid[])[1 + (row_number() OVER ()) %% cardinality(%(clients)s::uuid[])],
       %(status)s::varchar, 100, 'normal', 40, 'daily_schedule', t.id, t.ai_platform_id, t.brand_id, t.question_id,
       t.business_date, 1, now() - interval '5 minutes', now() + make_interval(secs => %(lease_in)s),
       CASE WHEN %(received)s THEN now() - interval '10 minutes' END,
       CASE WHEN %(status)s::varchar IN ('succeeded', 'failed', 'aborted') THEN now() END
FROM monitoring_collect_tasks t WHERE t.run_mode LIKE 'bench-' || %(tag)s || '-%%'
"""

_ATTEMPTS = """
INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, lease_epoch)
SELECT id, monitor_task_id, tenant_id, target_client_id, 1 FROM desktop_tasks
WHERE status IN ('in_progress', 'unknown') AND NOT EXISTS (
    SELECT 1 FROM desktop_task_attempts a WHERE a.task_id = desktop_tasks.id)
"""


async def _seed(conn: Conn, ids: dict[str, object], tag: str, n: int, *, status: str, exec_status: str | None,
                lease_in: float = -10, received: bool = False) -> None:
    async with conn.transaction():
        await conn.execute(_TASKS, {**ids, "tag": tag, "n": n, "status": status,
                                    "attempts": 0 if exec_status is None else 1})
        if exec_status is not None:
            await conn.execute(_EXECUTIONS, {"clients": ids["clients"], "status": exec_status, "tag": tag,
                                             "lease_in": lease_in, "received": received})
            await conn.execute(_ATTEMPTS)
    await conn.execute("ANALYZE")


async def _drain(conn: Conn, job: str, config: ReconcilerConfig) -> tuple[int, float, int]:
    """Run `job` until a run fixes nothing; (rows fixed, seconds, runs)."""
    fixed, runs = 0, 0
    started = time.perf_counter()
    while True:
        result = await run_job(JOBS[job], conn, config)
        runs += 1
        fixed += result.fixed
        if result.fixed == 0:
            return fixed, time.perf_counter() - started, runs


async def run(args: argparse.Namespace) -> None:
    logging.getLogger("reconciler").setLevel(logging.ERROR)  # one line per repaired row otherwise
    n = 500 if args.quick else 5000
    config = ReconcilerConfig()
    async with bench_environment() as settings:
        conn = await connect(settings.database_url)
        try:
            seeded = await seed_demo(conn, clients=50, questions=1, platforms=("openai",), due=False)
            tenant = seeded["tenants"][0]
            ids: dict[str, object] = {
                "tenant": tenant["tenant_id"], "brand": tenant["brands"][0]["brand_id"],
                "question": tenant["brands"][0]["question_ids"][0],
                "platform": seeded["platforms"][0]["ai_platform_id"],
                "clients": [c["client_id"] for c in tenant["clients"]]}
            await conn.execute("UPDATE desktop_clients SET online = true, last_heartbeat_at = now() + interval '1 h'")

            # Idle cost first, over a realistic amount of history.
            await _seed(conn, ids, "done", 20_000 if not args.quick else 2000, status="completed",
                        exec_status="succeeded")
            await _seed(conn, ids, "pending", 10_000 if not args.quick else 1000, status="pending", exec_status=None)
            for name in JOBS:
                durations = []
                for _ in range(5 if args.quick else 20):
                    started = time.perf_counter()
                    await run_job(JOBS[name], conn, config)
                    durations.append((time.perf_counter() - started) * 1000)
                print(f"idle run {name:<22} p50 {percentile(durations, 50):7.2f} ms  "
                      f"p90 {percentile(durations, 90):7.2f} ms")

            await _seed(conn, ids, "expired", n, status="pending", exec_status="in_progress")
            fixed, seconds, runs = await _drain(conn, "expired_leases", config)
            print(f"expired leases: {fixed} repaired in {seconds:.2f} s over {runs} runs = "
                  f"{fixed / seconds:.0f} rows/s")

            await _seed(conn, ids, "queued", n, status="pending", exec_status="queued")
            await conn.execute("UPDATE desktop_clients SET last_heartbeat_at = now() - interval '1 h'")
            fixed, seconds, runs = await _drain(conn, "offline_clients", config)
            print(f"offline clients: 50 clients + {n} queued executions released = {fixed} rows in {seconds:.2f} s "
                  f"over {runs} runs = {fixed / seconds:.0f} rows/s")

            await _seed(conn, ids, "unknown", n, status="pending", exec_status="in_progress", lease_in=-10,
                        received=True)
            fixed, seconds, runs = await _drain(conn, "unknown_executions", config)
            print(f"unknown executions: {fixed} converged in {seconds:.2f} s over {runs} runs = "
                  f"{fixed / seconds:.0f} rows/s")
        finally:
            await conn.close()
