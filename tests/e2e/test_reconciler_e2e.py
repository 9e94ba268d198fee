"""Reconcile scenarios end to end: real service processes, real WebSockets, simulated desktop clients
(tools/desktop_sim) told to misbehave: crash mid-task, ignore interrupts, go away."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from tests.support.db import fetch, one
from tests.support.reconcile_factory import World, insert_task, make_world
from tests.support.reconcile_stack import FAST_ENV, SERVICES, configure
from tests.support.stack import Stack, running_stack
from tests.support.wait import eventually
from tools.desktop_sim.client import SimClient, SimOptions
from tools.desktop_sim.timings import TIMING_PROFILES


def client(stack: Stack, world: World, index: int, *, scale: float = 2.0, **kwargs: Any) -> SimClient:
    """A simulated desktop (fast timings x `scale`), heartbeating well inside the 3 s timeout."""
    return SimClient(SimOptions(
        hub_url=stack.hub_url, token=world.tokens[index], name=f"sim-{index}",
        timings=TIMING_PROFILES["fast"].scaled(scale), heartbeat_interval_s=0.5, idle_poll_s=0.5,
        platform_health={code: "healthy" for code in world.platform_ids}, **kwargs))


async def started(sim: SimClient) -> SimClient:
    await sim.start()
    await eventually(lambda: sim.connected.is_set(), timeout=10, message="simulated client connected")
    return sim


async def request_status(pool: AsyncConnectionPool[Conn], request_id: str) -> str:
    row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s", uuid.UUID(request_id))
    return str(row["status"])


async def test_killed_client_task_rerun_elsewhere_and_ingested_once(
    settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path,
) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=2, questions=1)
        await configure(conn)
        task = await insert_task(conn, world)
    async with running_stack(settings, tmp_path, services=SERVICES, **FAST_ENV) as stack:
        victim = await started(client(stack, world, 0, die_at_phase="WAITING"))
        rescuer = client(stack, world, 1)
        try:
            await eventually(lambda: victim.stats.died, timeout=15, message="victim crashed mid-task")
            assert len(victim.stats.leased) == 1 and not victim.stats.executed
            await started(rescuer)

            async def completed() -> bool:
                row = await one(pool, "SELECT status FROM monitoring_collect_tasks WHERE id = %s", task)
                return row["status"] == "completed"

            await eventually(completed, timeout=30, message=f"task re-run and completed\n{stack.logs()}")
        finally:
            await victim.stop()
            await rescuer.stop()
        attempts = await fetch(pool, "SELECT client_id, status, abort_reason FROM desktop_task_attempts "
                                     "WHERE monitor_task_id = %s ORDER BY id", task)
        assert [(a["client_id"], a["status"]) for a in attempts] == [
            (world.clients[0], "expired"), (world.clients[1], "succeeded")]
        runs = await fetch(pool, "SELECT status, client_id, desktop_task_id FROM question_monitor_runs "
                                 "WHERE tenant_id = %s", world.tenant_id)
        assert len(runs) == 1 and runs[0]["status"] == "succeeded" and runs[0]["client_id"] == world.clients[1]
        assert len(rescuer.stats.executed) == 1 and not rescuer.stats.results_refused
        offline = await one(pool, "SELECT online FROM desktop_clients WHERE id = %s", world.clients[0])
        assert offline["online"] is False


async def test_client_ignoring_interrupts_loses_its_lease_and_high_task_completes_elsewhere(
    settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path,
) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=2, questions=2)
        await configure(conn)
        await conn.execute("UPDATE platform_settings SET interrupt_soft_timeout_ms = 1000, "
                           "interrupt_hard_timeout_ms = 2000 WHERE ai_platform_id = %s", (world.platform_id,))
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1 WHERE id = %s",
                           (world.clients[0],))
        scheduled = await insert_task(conn, world, question_index=0)
    async with running_stack(settings, tmp_path, services=SERVICES, **FAST_ENV) as stack:
        # WAITING alone lasts 0.1 s x 300 = 30 s: the stubborn client is mid-answer when collect-now comes.
        stubborn = await started(client(stack, world, 0, scale=300, ignore_interrupts=True))
        helper: SimClient | None = None
        try:
            await eventually(lambda: bool(stubborn.stats.leased), timeout=15, message="stubborn client leased")
            helper = await started(client(stack, world, 1))
            accepted = await stack.collect_now(
                world.principal(), world.brand_id,
                {"target_client_id": str(world.clients[0]), "question_ids": [world.question_ids[1]]})
            assert accepted["target_client_id"] == str(world.clients[0])
            assert accepted["interrupt_requested_count"] == 1
            request_id = accepted["request_id"]

            async def succeeded() -> bool:
                return await request_status(pool, request_id) == "succeeded"

            await eventually(succeeded, timeout=40, message=f"high task completed elsewhere\n{stack.logs()}")
        finally:
            await stubborn.stop()
            if helper is not None:
                await helper.stop()
        revoked = await one(pool, "SELECT status, interrupt_reason FROM desktop_tasks WHERE monitor_task_id = %s "
                                  "AND target_client_id = %s ORDER BY created_at LIMIT 1", scheduled, world.clients[0])
        assert revoked == {"status": "aborted", "interrupt_reason": "interrupt_hard_timeout"}
        assert any(control == "lease_revoked" for _, control in stubborn.stats.dropped)
        high_run = await one(pool, "SELECT r.client_id FROM question_monitor_runs r "
                                   "WHERE r.tenant_id = %s AND r.question_id = %s",
                             world.tenant_id, world.question_ids[1])
        assert high_run["client_id"] == world.clients[1]
        timeouts = await stack.metric("reconciler", f'monitor_preempt_timeout_count{{client_id="{world.clients[0]}"}}')
        assert timeouts >= 1


async def test_all_clients_offline_for_the_whole_ttl_times_out(
    settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path,
) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=1, questions=1)
        await configure(conn, request_ttl_seconds=6)
    async with running_stack(settings, tmp_path, services=SERVICES, **FAST_ENV) as stack:
        idle = await started(client(stack, world, 0, auto_lease=False))
        accepted = await stack.collect_now(world.principal(), world.brand_id)
        assert accepted["target_client_id"] == str(world.clients[0])
        await idle.stop()

        async def timed_out() -> bool:
            return await request_status(pool, accepted["request_id"]) == "timed_out"

        await eventually(timed_out, timeout=25, message=f"request timed out\n{stack.logs()}")
        assert await stack.metric("reconciler", "collect_request_ttl_expired_count") >= 1
        leased = await fetch(pool, "SELECT 1 FROM desktop_task_attempts WHERE tenant_id = %s", world.tenant_id)
        assert leased == []


async def test_client_back_within_ttl_completes_the_request(
    settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path,
) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=1, questions=2)
        await configure(conn, request_ttl_seconds=30)
    async with running_stack(settings, tmp_path, services=SERVICES, **FAST_ENV) as stack:
        flaky = await started(client(stack, world, 0, auto_lease=False))
        accepted = await stack.collect_now(world.principal(), world.brand_id)
        assert accepted["target_client_id"] == str(world.clients[0])
        await flaky.stop()

        async def unbound() -> bool:
            rows = await fetch(pool, "SELECT target_client_id FROM monitoring_collect_tasks "
                                     "WHERE collect_request_id = %s", uuid.UUID(accepted["request_id"]))
            return bool(rows) and all(r["target_client_id"] is None for r in rows)

        await eventually(unbound, timeout=15, message="high tasks unbound from the offline client")
        back = await started(client(stack, world, 0))
        try:
            async def succeeded() -> bool:
                return await request_status(pool, accepted["request_id"]) == "succeeded"

            await eventually(succeeded, timeout=25, message=f"request completed after reconnect\n{stack.logs()}")
        finally:
            await back.stop()
        runs = await fetch(pool, "SELECT status FROM question_monitor_runs WHERE tenant_id = %s", world.tenant_id)
        assert [r["status"] for r in runs] == ["succeeded"] * 2
