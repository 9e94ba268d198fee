"""Dispatch coordinator throughput: scanner plans/s and dispatch decisions/s (execution row + outbox event each).

10 tenants x 4 online clients, 3 platforms, 20,000 plans due at once (2,000 with --quick). Budgets,
platform limits and queue depths are raised out of the way, so the figure is the coordinator's own cost:
the snapshot reads, the candidate probes, the planner and the write (claim, attempt count, execution rows,
outbox rows) per pass. The scanner is one INSERT..SELECT statement per batch.
"""

from __future__ import annotations

import argparse
import time

from bench.common import bench_environment, summary
from libs.db.pool import make_pool
from libs.dispatch_settings import load_settings, set_setting
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_coordinator.scanner import scan_once
from tests.support.dispatch_fleet import seed_fleet

_HEARTBEAT = "UPDATE desktop_clients SET last_heartbeat_at = now() WHERE id = ANY(%(ids)s)"


async def run(args: argparse.Namespace) -> None:
    total = 2_000 if args.quick else 20_000
    tenants, clients = 10, 4
    async with bench_environment() as settings:
        pool = make_pool(settings, name="bench-dispatch", min_size=1, max_size=4)
        await pool.open(wait=True)
        try:
            async with pool.connection() as conn:
                seeded = await seed_fleet(conn, plans_per_tenant=[total // tenants] * tenants,
                                          clients_per_tenant=clients, max_queue_depth=1_000_000)
                for key, value in (("cluster_dispatch_per_minute", 10_000_000),
                                   ("tenant_dispatch_per_minute", 10_000_000), ("dispatch_batch_size", 2000),
                                   ("scan_batch_size", 2000)):
                    await set_setting(conn, key, value)
                await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 1000000 "
                                   "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE "
                                   "SET max_concurrent = EXCLUDED.max_concurrent")
                dispatch_settings = await load_settings(conn)

            started = time.perf_counter()
            scanned = created = 0
            while True:
                result = await scan_once(pool, batch_size=dispatch_settings.scan_batch_size, rollout_percentage=100)
                scanned += result.plans
                created += result.created
                if result.plans == 0:
                    break
            scan_s = time.perf_counter() - started
            print(f"scanner: {scanned} plans -> {created} tasks in {scan_s:.2f}s = {scanned / scan_s:,.0f} plans/s")

            dispatcher = Dispatcher(pool)
            passes: list[float] = []
            dispatched = 0
            started = time.perf_counter()
            while dispatched < created:
                # The clients stay eligible as they would with a hub: heartbeats are fresh (a run longer than
                # heartbeat_timeout_seconds without them finds no eligible client and stops dispatching).
                async with pool.connection() as conn:
                    await conn.execute(_HEARTBEAT, {"ids": seeded.client_ids})
                t0 = time.perf_counter()
                outcome = await dispatcher.run_pass(dispatch_settings)
                passes.append((time.perf_counter() - t0) * 1000)
                if outcome.dispatched == 0 and not outcome.conflicted:
                    break
                dispatched += outcome.dispatched
            dispatch_s = time.perf_counter() - started
            print(f"dispatch: {dispatched} executions (+ {dispatched} outbox events) in {dispatch_s:.2f}s "
                  f"= {dispatched / dispatch_s:,.0f} dispatches/s over {len(passes)} passes")
            print(f"dispatch pass ms: {summary(passes)}")
        finally:
            await pool.close()
