"""Chaos: a fleet of simulated desktop clients (`desktop-sim` processes) SIGKILLed and restarted at
random during a small day's schedule plus collect-nows. Whatever happens, every business task ends
terminal, no business task ever has two active executions at once (per desktop_task_attempts), and
every succeeded result is in the raw facts exactly once."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from tests.support.db import fetch
from tests.support.procs import BIN, die_with_parent
from tests.support.reconcile_stack import FAST_ENV, SERVICES, configure
from tests.support.stack import Stack, running_stack
from tests.support.wait import eventually

CHAOS_SECONDS = 15.0
TERMINAL = ("completed", "failed", "skipped", "expired")


class Fleet:
    """One `desktop-sim` process per client: killed with SIGKILL (no goodbye at all) and started again."""

    def __init__(self, stack: Stack, tenant: dict[str, Any], rng: random.Random, pool: AsyncConnectionPool[Conn],
                 log_dir: Path) -> None:
        self.stack = stack
        self.rng = rng
        self.pool = pool
        self.log_dir = log_dir
        self.creds = [(uuid.UUID(c["client_id"]), c["token"]) for c in tenant["clients"]]
        self.live: dict[int, subprocess.Popen[bytes]] = {}
        self.kills = 0
        self.starts = 0

    def start(self, index: int) -> None:
        _, token = self.creds[index]
        self.starts += 1
        log = (self.log_dir / f"desktop-sim-{index}-{self.starts}.log").open("wb")
        self.live[index] = subprocess.Popen(
            [str(BIN / "desktop-sim"), "--hub", self.stack.hub_url, "--token", token, "--timings", "fast",
             "--scale", "4", "--heartbeat-interval", "0.5", "--failure-rate", "0.05", "--stats-interval", "600"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        log.close()

    def kill(self, index: int) -> None:
        proc = self.live.pop(index)
        proc.kill()
        proc.wait(5)
        self.kills += 1

    async def busy(self) -> set[int]:
        """Clients holding a lease right now: killing those is the crash the reconciler must repair."""
        rows = await fetch(self.pool, "SELECT DISTINCT target_client_id FROM desktop_tasks "
                                      "WHERE status = 'in_progress' AND target_client_id = ANY(%s)",
                           [c for c, _ in self.creds])
        holding = {r["target_client_id"] for r in rows}
        return {i for i, (client_id, _) in enumerate(self.creds) if client_id in holding}

    async def churn(self) -> None:
        """Kill a live client (keeping at least one, preferring one mid-task) or bring a dead one back."""
        dead = [i for i in range(len(self.creds)) if i not in self.live]
        if dead and (len(self.live) <= 1 or self.rng.random() < 0.5):
            self.start(self.rng.choice(dead))
            return
        busy = sorted(await self.busy() & set(self.live))
        self.kill(self.rng.choice(busy or sorted(self.live)))

    def stop(self) -> None:
        for proc in self.live.values():
            proc.terminate()
        for proc in self.live.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.live.clear()


async def test_fleet_chaos_every_task_terminal_no_double_execution_results_once(
    settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path,
) -> None:
    rng = random.Random(20240611)
    async with pool.connection() as conn:
        seeded = await seed_demo(conn, tenants=1, brands=2, questions=3, clients=4, due=True)
        await configure(conn, request_ttl_seconds=60)
    tenant = seeded["tenants"][0]
    tenant_id = tenant["tenant_id"]
    async with running_stack(settings, tmp_path, services=SERVICES, **FAST_ENV) as stack:
        fleet = Fleet(stack, tenant, rng, pool, tmp_path)
        try:
            for index in range(len(fleet.creds)):
                fleet.start(index)
            collect_nows = [CHAOS_SECONDS * 0.2, CHAOS_SECONDS * 0.5]
            requests: list[str] = []
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < CHAOS_SECONDS:
                if collect_nows and elapsed >= collect_nows[0]:
                    collect_nows.pop(0)
                    brand = tenant["brands"][len(requests) % len(tenant["brands"])]
                    accepted = await stack.collect_now(tenant, brand["brand_id"])
                    requests.append(accepted["request_id"])
                await fleet.churn()
                await asyncio.sleep(rng.uniform(0.4, 1.2))  # the pace of the chaos, not a wait for a condition
            for index in range(len(fleet.creds)):
                if index not in fleet.live:
                    fleet.start(index)

            async def all_terminal() -> bool:
                rows = await fetch(pool, "SELECT count(*) FILTER (WHERE status NOT IN ('completed', 'failed', "
                                         "'skipped', 'expired')) AS open, count(*) AS total "
                                         "FROM monitoring_collect_tasks WHERE tenant_id = %s", tenant_id)
                return rows[0]["total"] > 0 and rows[0]["open"] == 0

            await eventually(all_terminal, timeout=45, interval=0.25,
                             message=f"every business task terminal\n{stack.logs()}")
        finally:
            fleet.stop()

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

    runs = await fetch(pool, "SELECT r.id, r.status, r.citation_count, r.desktop_task_id, t.id AS task_id, "
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
    winners = {r["id"]: r["monitor_task_id"] for r in await fetch(
        pool, "SELECT id, monitor_task_id FROM desktop_tasks WHERE tenant_id = %s AND status = 'succeeded'", tenant_id)}
    for task_id in completed:
        run = by_task[task_id]
        assert run["status"] == "succeeded" and winners.get(run["desktop_task_id"]) == task_id, run
        # Citation facts keyed by (run, fingerprint): never more than the result carried, none lost.
        assert run["facts"] <= run["citation_count"] and (run["citation_count"] == 0 or run["facts"] > 0), run
    open_requests = await fetch(pool, "SELECT id, status FROM monitoring_collect_requests WHERE tenant_id = %s "
                                      "AND status IN ('accepted', 'dispatching', 'running')", tenant_id)
    assert open_requests == []
    assert requests
    repairs = await fetch(pool, "SELECT status, abort_reason, count(*) AS n FROM desktop_task_attempts "
                                "WHERE tenant_id = %s GROUP BY 1, 2 ORDER BY 1, 2", tenant_id)
    print("chaos kills:", fleet.kills, "attempts:", repairs)  # shown with -s: how much repair the run needed
    assert any(r["status"] == "expired" for r in repairs), "no client died holding a lease: the chaos was too mild"
