"""Service chaos end to end: every service as real processes (two dispatch-coordinators, two outbox-pumps, two
dispatch-hubs, two ingest-shard-workers, a projection-worker, a reconciler, the collect-now-api) on real Postgres
and RabbitMQ, twelve simulated desktop clients on three tenants spread over both hubs (failing over to the other),
a compressed business day of scheduled work plus collect-now clicks, one tenant on the legacy (Phase 1) execution
path and two on desktop_tasks (`rollout_percentage` between them), while replicas are `kill -9`ed and restarted,
the broker closes or loses every connection of the services, and their Postgres backends are terminated.

Then the system settles and the invariants are read back from the database and the broker (tests/support/chaos.py
says what each one checks). The quick variant (60 s of faults) runs in `make test`; `make chaos` runs the long one
(`CHAOS_MINUTES=15`). `CHAOS_SEED=N` replays a run's schedule, workload and clicks; `CHAOS_REPORT=PATH` also
writes the report to a file; `CHAOS_LOGS=DIR` keeps the services' logs in DIR/chaos-SEED.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from pathlib import Path

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from tests.support.chaos import (
    KILL_TARGETS,
    Clicker,
    FaultInjector,
    Fleet,
    check_all,
    format_report,
    running_chaos_stack,
    schedule_business_day,
    seed_world,
    settle,
    work_summary,
)
from tests.support.wait import eventually

CHAOS_MINUTES = float(os.environ.get("CHAOS_MINUTES") or 0)
FAULT_SECONDS = CHAOS_MINUTES * 60 if CHAOS_MINUTES > 0 else 60.0
MEAN_FAULT_GAP_S = 4.0
MEAN_CLICK_GAP_S = 5.0
SETTLE_TIMEOUT_S = 180.0
# Scheduled work: about 120 business tasks per minute of faults (3 tenants x 2 brands x 3 platforms per question),
# below the budgets' 216 a minute, so the day's work gets done while the faults go on.
TENANTS, BRANDS, CLIENTS_PER_TENANT = 3, 2, 4
# Both execution paths at once: this many of the tenants on legacy (docs/legacy-path.md), the others on desktop_tasks.
LEGACY_TENANTS = 1
QUESTIONS = max(4, math.ceil(120 * FAULT_SECONDS / 60 / (TENANTS * BRANDS * 3)))
SEED = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**31))


@pytest.mark.timeout(FAULT_SECONDS + 480)
async def test_service_chaos_keeps_every_invariant(
    settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path,
) -> None:
    # CHAOS_LOGS=DIR keeps the services' logs where pytest's rotation of its temporary directories does not reach.
    log_dir = Path(os.environ["CHAOS_LOGS"]) / f"chaos-{SEED}" if os.environ.get("CHAOS_LOGS") else tmp_path
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"\nservice chaos seed {SEED} (replay with CHAOS_SEED={SEED}); logs in {log_dir}", flush=True)
    # One generator per concern, each from the run's seed: the coroutines draw concurrently, so a shared one would
    # hand out its numbers in an order that depends on timing.
    async with pool.connection() as conn:
        seeded = await seed_world(conn, tenants=TENANTS, brands=BRANDS, questions=QUESTIONS,
                                  clients=CLIENTS_PER_TENANT, legacy_tenants=LEGACY_TENANTS)
    print(f"rollout_percentage {seeded['rollout_percentage']}: " + ", ".join(
        f"tenant {t['tenant_id']} {t['execution_owner']}" for t in seeded["tenants"]), flush=True)
    async with running_chaos_stack(settings, log_dir) as stack:
        fleet = Fleet(seeded, stack.hub_urls, random.Random(f"{SEED}-fleet"))
        await fleet.start()
        try:
            await eventually(fleet.all_connected, timeout=30, message="every simulated client connected")
            async with pool.connection() as conn:
                plans = await schedule_business_day(conn, random.Random(f"{SEED}-day"), FAULT_SECONDS * 0.85)
            injector = FaultInjector(stack, random.Random(f"{SEED}-faults"))
            clicker = Clicker(stack, seeded, random.Random(f"{SEED}-clicks"))
            await asyncio.gather(injector.run(FAULT_SECONDS, mean_gap_s=MEAN_FAULT_GAP_S),
                                 clicker.run(FAULT_SECONDS, mean_gap_s=MEAN_CLICK_GAP_S))
            settled = await settle(pool, stack, timeout=SETTLE_TIMEOUT_S)
            invariants = await check_all(pool, stack, fleet, rollout=seeded["rollout_percentage"])
            work = {"plans due during the run": plans, "collect-now clicks by path": clicker.by_path(),
                    **await work_summary(pool)}
        finally:
            await fleet.stop()
    report = format_report(seed=SEED, fault_seconds=FAULT_SECONDS, faults=injector.faults,
                           fault_errors=injector.errors, clicks=clicker.summary(), work=work, settled=settled,
                           invariants=invariants, results_202=len(fleet.accepted_results))
    print(report, flush=True)
    if os.environ.get("CHAOS_REPORT"):
        await asyncio.to_thread(Path(os.environ["CHAOS_REPORT"]).write_text, report + "\n")

    assert not injector.errors, report
    injected = {f.target.split("#")[0] for f in injector.faults} | {f.kind for f in injector.faults}
    assert {"dispatch-coordinator", *KILL_TARGETS[1:], "broker_close", "broker_partition", "pg_terminate"} <= injected
    assert any(c.status == 202 for c in clicker.clicks), "no collect-now was accepted: the run proves little"
    paths = work["tasks per path"]
    assert all(paths.get(p, {}).get("results_applied") for p in ("desktop_tasks", "legacy")), \
        f"both execution paths must have run work: {paths}\n{report}"
    # Each path had its clicks (the clicker's first round); whether they were accepted is reported, not judged (a
    # click right after a Postgres termination may be a 500, docs/reliability.md).
    assert set(clicker.by_path()) == {"desktop_tasks", "legacy"}, f"a collect-now on each path\n{report}"
    assert settled[0], f"the system did not settle within {SETTLE_TIMEOUT_S}s\n{report}"
    assert [i.name for i in invariants if i.violations] == [], report
