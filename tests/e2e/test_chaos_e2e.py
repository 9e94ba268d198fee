"""Chaos: a fleet of desktop clients killed and restarted at random during a small day's schedule plus
collect-nows. Whatever happens, every business task ends terminal, no business task ever has two
active executions at once, and every succeeded result is in the raw facts exactly once."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from pathlib import Path
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from tests.support.reconcile_clients import ScriptedClient
from tests.support.reconcile_stack import Stack, configure, running_stack
from tests.support.wait import eventually

CHAOS_SECONDS = 15.0
TERMINAL = ("completed", "failed", "skipped", "expired")


async def fetch(pool: AsyncConnectionPool[Conn], query: str, *params: Any) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(query, params)
        return [dict(r) for r in await cur.fetchall()]


class Fleet:
    def __init__(self, stack: Stack, tenant: dict[str, Any], rng: random.Random) -> None:
        self.stack = stack
        self.rng = rng
        self.creds = [(c["client_id"], c["token"]) for c in tenant["clients"]]
        self.live: dict[int, ScriptedClient] = {}
        self.all: list[ScriptedClient] = []
        self.kills = 0

    async def start(self, index: int) -> None:
        client_id, token = self.creds[index]
        sim = ScriptedClient(self.stack.hub_url, uuid.UUID(client_id), token,
                             work_seconds=self.rng.uniform(0.5, 1.5))
        await sim.start()
        self.live[index] = sim
        self.all.append(sim)

    async def kill(self, index: int) -> None:
        await self.live.pop(index).kill()
        self.kills += 1

    async def churn(self) -> None:
        """Kill a random live client (keeping at least one) or bring a dead one back."""
        dead = [i for i in range(len(self.creds)) if i not in self.live]
        if dead and (len(self.live) <= 1 or self.rng.random() < 0.5):
            await self.start(self.rng.choice(dead))
        else:
            # Prefer a client in the middle of a task: that is the crash the reconciler must repair.
            busy = sorted(i for i, sim in self.live.items() if sim.current_task is not None)
            await self.kill(self.rng.choice(busy or sorted(self.live)))

    async def stop(self) -> None:
        for index in list(self.live):
            await self.live.pop(index).kill()


async def test_fleet_chaos_every_task_terminal_no_double_execution_results_once(
    settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path,
) -> None:
    rng = random.Random(20240611)
    async with pool.connection() as conn:
        seeded = await seed_demo(conn, tenants=1, brands=2, questions=3, clients=4, due=True)
        await configure(conn, request_ttl_seconds=60)
    tenant = seeded["tenants"][0]
    tenant_id = tenant["tenant_id"]
    async with running_stack(settings, tmp_path) as stack:
        fleet = Fleet(stack, tenant, rng)
        try:
            for index in range(len(fleet.creds)):
                await fleet.start(index)
            collect_nows = [CHAOS_SECONDS * 0.2, CHAOS_SECONDS * 0.5]
            requests: list[str] = []
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < CHAOS_SECONDS:
                if collect_nows and elapsed >= collect_nows[0]:
                    collect_nows.pop(0)
                    brand = tenant["brands"][len(requests) % len(tenant["brands"])]
                    accepted = await stack.collect_now(tenant_id=tenant_id, workspace_id=tenant["workspace_id"],
                                                       user_id=tenant["user_id"], brand_id=brand["brand_id"])
                    requests.append(accepted["request_id"])
                await fleet.churn()
                await asyncio.sleep(rng.uniform(0.4, 1.2))  # the pace of the chaos, not a wait for a condition
            for index in range(len(fleet.creds)):
                if index not in fleet.live:
                    await fleet.start(index)

            async def all_terminal() -> bool:
                rows = await fetch(pool, "SELECT count(*) FILTER (WHERE status NOT IN ('completed', 'failed', "
                                         "'skipped', 'expired')) AS open, count(*) AS total "
                                         "FROM monitoring_collect_tasks WHERE tenant_id = %s", tenant_id)
                return rows[0]["total"] > 0 and rows[0]["open"] == 0

            await eventually(all_terminal, timeout=45, interval=0.25,
                             message=f"every business task terminal\n{stack.logs()}")
        finally:
            await fleet.stop()

    assert fleet.kills >= 3, "the chaos must actually kill clients"
    tasks = await fetch(pool, "SELECT id, status FROM monitoring_collect_tasks WHERE tenant_id = %s", tenant_id)
    assert len(tasks) == 2 * 3 * 3  # brands x questions x platforms: no duplicate business task
    assert all(t["status"] in TERMINAL for t in tasks)

    overlapping_attempts = await fetch(pool, """
        SELECT a.monitor_task_id, a.id AS first, b.id AS second FROM desktop_task_attempts a
        JOIN desktop_task_attempts b ON b.monitor_task_id = a.monitor_task_id AND b.id > a.id
        WHERE a.tenant_id = %s
          AND tstzrange(a.started_at, coalesce(a.finished_at, 'infinity'), '[)')
           && tstzrange(b.started_at, coalesce(b.finished_at, 'infinity'), '[)')""", tenant_id)
    assert overlapping_attempts == []
    still_active = await fetch(pool, "SELECT id, status FROM desktop_tasks WHERE tenant_id = %s "
                                     "AND status IN ('queued', 'in_progress', 'unknown')", tenant_id)
    assert still_active == []

    runs = await fetch(pool, "SELECT r.id, r.status, t.id AS task_id, t.status AS task_status, "
                             "(SELECT count(*) FROM monitoring_citation_facts f WHERE f.run_id = r.id) AS facts "
                             "FROM question_monitor_runs r JOIN monitoring_collect_tasks t "
                             "ON t.tenant_id = r.tenant_id AND t.brand_id = r.brand_id "
                             "AND t.question_id = r.question_id AND t.ai_platform_id = r.ai_platform_id "
                             "AND t.business_date = r.business_date "
                             "WHERE r.tenant_id = %s", tenant_id)
    by_task = {r["task_id"]: r for r in runs}
    assert len(by_task) == len(runs)  # one raw-fact run per business key
    succeeded_tasks = {r["monitor_task_id"] for r in await fetch(
        pool, "SELECT DISTINCT monitor_task_id FROM desktop_tasks WHERE tenant_id = %s AND status = 'succeeded'",
        tenant_id)}
    completed = {t["id"] for t in tasks if t["status"] == "completed"}
    assert completed, "the fleet completed nothing"
    assert succeeded_tasks <= set(by_task)
    for task_id in completed:
        run = by_task[task_id]
        assert run["status"] == "succeeded" and run["facts"] == 1, run
    open_requests = await fetch(pool, "SELECT id, status FROM monitoring_collect_requests WHERE tenant_id = %s "
                                      "AND status IN ('accepted', 'dispatching', 'running')", tenant_id)
    assert open_requests == []
    assert requests
    repairs = await fetch(pool, "SELECT status, abort_reason, count(*) AS n FROM desktop_task_attempts "
                                "WHERE tenant_id = %s GROUP BY 1, 2 ORDER BY 1, 2", tenant_id)
    print("chaos kills:", fleet.kills, "attempts:", repairs)  # shown with -s: how much repair the run needed
    assert any(r["status"] == "expired" for r in repairs), "no client died holding a lease: the chaos was too mild"
