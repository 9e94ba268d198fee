"""The legacy (Phase 1) execution path and the migration between the paths, end to end (docs/legacy-path.md): real
outbox-pump, dispatch-coordinator, dispatch-hub, collect-now-api, ingest-shard-workers and reconciler processes,
Postgres, RabbitMQ, and simulated desktop clients over real WebSockets.

(a) rollout 0 from the start: a day's scheduled work runs on the legacy path, results ingested;
(b) a collect-now for a legacy tenant: Phase-1 preemption;
(c) rollout 50 %: both paths at once, collect-nows on both, no business task ever held by both paths;
(d) rollback mid-day (dry run, apply, with and without --force), then rollout back to 100.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from tests.support.db import fetch as rows
from tests.support.db import one
from tests.support.stack import DISPATCH_SERVICES, Stack, running_stack
from tests.support.wait import eventually
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions

FAST = TIMING_PROFILES["fast"]
SERVICES = (*DISPATCH_SERVICES, "reconciler")
ENV: dict[str, str | int] = {"HUB_HEARTBEAT_FLUSH_S": "0.3", "HUB_PING_INTERVAL_S": "1"}

pytestmark = pytest.mark.timeout(240)


def sim(stack: Stack, token: str, *, scale: float = 1.0, **options: Any) -> SimClient:
    return SimClient(SimOptions(hub_url=stack.hub_url, token=token, timings=FAST.scaled(scale),
                                heartbeat_interval_s=1.0, ws_ping_interval_s=2.0, idle_poll_s=1.0, seed=11,
                                **options))


@contextlib.asynccontextmanager
async def fleet(stack: Stack, tokens: list[str], *, scale: float = 1.0) -> AsyncIterator[list[SimClient]]:
    clients = [sim(stack, token, scale=scale) for token in tokens]
    async with contextlib.AsyncExitStack() as stack_:
        for client in clients:
            await stack_.enter_async_context(client)
        yield clients


async def seed(pool: AsyncConnectionPool[Conn], *, tenants: int = 1, first_tenant_id: int | None = None,
               rollout: int, questions: int = 4, clients: int = 2, due: bool = True) -> dict[str, Any]:
    async with pool.connection() as conn:
        if first_tenant_id is not None:
            await conn.execute("SELECT setval('tenants_id_seq', %s, false)", (first_tenant_id,))
        world = await seed_demo(conn, tenants=tenants, brands=2, questions=questions, clients=clients,
                                platforms=("openai", "gemini"), due=due)
        await conn.execute("UPDATE platform_settings SET max_concurrent = 20")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 2")
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000,
                           "rollout_percentage": rollout}.items():
            await set_setting(conn, key, value)
    return world


async def all_done(pool: AsyncConnectionPool[Conn]) -> bool:
    open_ = await one(pool, "SELECT count(*) AS n FROM monitoring_collect_tasks WHERE status NOT IN "
                            "('completed', 'failed', 'expired', 'skipped')")
    return int(open_["n"]) == 0 and await _tasks_exist(pool)


async def _tasks_exist(pool: AsyncConnectionPool[Conn]) -> bool:
    return int((await one(pool, "SELECT count(*) AS n FROM monitoring_collect_tasks"))["n"]) > 0


async def never_both_paths(pool: AsyncConnectionPool[Conn]) -> list[dict[str, Any]]:
    """Business tasks that were ever held by both paths at the same instant: an execution's attempt interval and a
    legacy lease's [created_at, finished_at) overlapping (an open one runs to now)."""
    return await rows(pool, """
        SELECT a.monitor_task_id, a.task_id, l.id AS lease_id
        FROM desktop_task_attempts a JOIN legacy_leases l ON l.monitor_task_id = a.monitor_task_id
        WHERE tstzrange(a.started_at, coalesce(a.finished_at, now())) &&
              tstzrange(l.created_at, coalesce(l.finished_at, now()))
        UNION ALL
        SELECT d.monitor_task_id, d.id, l.id
        FROM desktop_tasks d JOIN legacy_leases l ON l.monitor_task_id = d.monitor_task_id
        WHERE d.kind = 'monitor' AND d.status IN ('queued', 'in_progress', 'unknown')
          AND l.status IN ('queued', 'in_progress')""")


async def test_a_rollout_zero_runs_a_days_schedule_on_the_legacy_path(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    world = await seed(pool, rollout=0)
    tenant = world["tenants"][0]
    async with running_stack(settings, tmp_path, services=SERVICES, **ENV) as stack, \
            fleet(stack, [c["token"] for c in tenant["clients"]]) as clients:
        await eventually(lambda: all_done(pool), timeout=90, interval=0.2,
                         message=f"every scheduled task completed\n{stack.logs()}")
        tasks = await rows(pool, "SELECT id, status, execution_owner, leased_to_executor, legacy_lease_id, "
                                 "lease_token_hash FROM monitoring_collect_tasks")
        assert {t["execution_owner"] for t in tasks} == {"legacy"}
        assert {t["status"] for t in tasks} == {"completed"}
        assert all(t["leased_to_executor"] is None and t["legacy_lease_id"] is None and t["lease_token_hash"] is None
                   for t in tasks), "a completed legacy task keeps no lease"
        # Nothing ran on the desktop_tasks path; every task has one succeeded legacy lease and one run row.
        assert (await one(pool, "SELECT count(*) AS n FROM desktop_tasks"))["n"] == 0
        leases = await rows(pool, "SELECT monitor_task_id, status, target_client_id FROM legacy_leases")
        succeeded = [lease for lease in leases if lease["status"] == "succeeded"]
        assert sorted(lease["monitor_task_id"] for lease in succeeded) == sorted(t["id"] for t in tasks)
        runs = await one(pool, "SELECT count(*) AS n FROM question_monitor_runs")
        assert runs["n"] == len(tasks)
        # The clients were told the path, and both worked.
        owners = {owner for client in clients for owner in client.stats.owners.values()}
        assert owners == {"legacy"}
        assert all(client.stats.executed for client in clients)
        # The budget counted every offer (the ledger of the window equals the offers made).
        assert await _budget_counted(pool) == len(leases)
        assert await never_both_paths(pool) == []


async def _budget_counted(pool: AsyncConnectionPool[Conn]) -> int:
    row = await one(pool, "SELECT coalesce(sum(used), 0) AS n FROM dispatch_budget_ledger")
    return int(row["n"])
