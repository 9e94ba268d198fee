"""Platform-health pause end to end: real services, a simulated desktop reporting a broken login on one platform
in its heartbeats. That platform's scheduled work stops reaching it within seconds while its other platform keeps
flowing; once it reports the login working again, the held work is dispatched and completed."""

from __future__ import annotations

import json
from pathlib import Path

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from tests.support.db import fetch
from tests.support.reconcile_factory import insert_task, make_world
from tests.support.reconcile_stack import FAST_ENV, configure
from tests.support.stack import DISPATCH_SERVICES, running_stack
from tests.support.wait import eventually
from tools.desktop_sim.client import SimClient, SimOptions
from tools.desktop_sim.timings import TIMING_PROFILES


async def test_a_broken_login_holds_its_platform_and_recovery_releases_it(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=1, questions=3, platforms=("openai", "gemini"))
        await configure(conn)
        tasks = {code: [await insert_task(conn, world, question_index=i, platform=code) for i in range(3)]
                 for code in ("openai", "gemini")}

    async def statuses(code: str) -> list[str]:
        rows = await fetch(pool, "SELECT status FROM monitoring_collect_tasks WHERE id = ANY(%s)", tasks[code])
        return [r["status"] for r in rows]

    health = {"openai": "login_required", "gemini": "healthy"}
    async with pool.connection() as conn:  # what the client reported before this run (its last heartbeat)
        await conn.execute("UPDATE desktop_clients SET platform_health = %s::jsonb WHERE id = %s",
                           (json.dumps(health), world.clients[0]))
    async with running_stack(settings, tmp_path, services=DISPATCH_SERVICES, **FAST_ENV) as stack:
        sim = SimClient(SimOptions(hub_url=stack.hub_url, token=world.tokens[0], name="sim-0",
                                   timings=TIMING_PROFILES["fast"], heartbeat_interval_s=0.3, idle_poll_s=0.5,
                                   platform_health=health))
        await sim.start()
        try:
            async def gemini_done() -> bool | None:
                return True if await statuses("gemini") == ["completed"] * 3 else None

            await eventually(gemini_done, timeout=30, message="the healthy platform's work completed")
            assert await statuses("openai") == ["pending"] * 3
            leased = await fetch(pool, "SELECT count(*) AS n FROM desktop_tasks WHERE monitor_task_id = ANY(%s)",
                                 tasks["openai"])
            assert leased == [{"n": 0}]  # none of it ever reached the client
            assert await stack.metric("dispatch-coordinator", 'monitor_tenant_platform_paused{platform="openai",'
                                      f'source="health",tenant_id="{world.tenant_id}"}}') == 1.0

            health["openai"] = "healthy"  # the user logged in again; the next heartbeats say so

            async def openai_done() -> bool | None:
                return True if await statuses("openai") == ["completed"] * 3 else None

            await eventually(openai_done, timeout=30, message="the held platform's work released and completed")
        finally:
            await sim.stop()
