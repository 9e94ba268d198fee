"""Platform-health pause end to end: real services, simulated desktops reporting a broken login on one platform in
their heartbeats (from before the services start, or breaking while they run). That platform's scheduled work stops
reaching the client within seconds (what was queued for it released and planned again) while its other platform keeps
flowing; once it reports the login working again, the held work is dispatched and completed."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

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


async def test_a_login_that_breaks_at_runtime_releases_its_queued_work(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    """Client A reports every login working and has work of both platforms queued; its openai login breaks. Within
    seconds its queued openai work is released (aborted `platform_unhealthy`, the client told) and planned again, on
    client B whose openai login works, while A's gemini work keeps flowing and A leases no openai work; once B's
    openai login breaks too nothing of openai is leased anywhere, and when A's login works again A gets it."""
    async with pool.connection() as conn:
        world = await make_world(conn, clients=2, questions=12, platforms=("openai", "gemini"))
        await configure(conn)
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1, max_queue_depth = 4")
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 10 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 10")
        tasks = {"openai": [await insert_task(conn, world, question_index=i, platform="openai") for i in range(12)],
                 "gemini": [await insert_task(conn, world, question_index=i, platform="gemini") for i in range(4)]}
    a_id, b_id = world.clients
    openai = world.platform_ids["openai"]

    async def a_queued_openai() -> int:
        rows = await fetch(pool, "SELECT count(*) AS n FROM desktop_tasks WHERE target_client_id = %s "
                                 "AND ai_platform_id = %s AND status = 'queued'", a_id, openai)
        return int(rows[0]["n"])

    async def released_from_a() -> list[dict[str, Any]]:
        return await fetch(pool, "SELECT id, monitor_task_id FROM desktop_tasks WHERE target_client_id = %s "
                                 "AND interrupt_reason = 'platform_unhealthy'", a_id)

    async def openai_leased_by(client: uuid.UUID, since: datetime) -> int:
        rows = await fetch(pool, "SELECT count(*) AS n FROM desktop_tasks WHERE target_client_id = %s "
                                 "AND ai_platform_id = %s AND leased_at > %s", client, openai, since)
        return int(rows[0]["n"])

    async def now() -> datetime:
        return (await fetch(pool, "SELECT now() AS t"))[0]["t"]

    async def statuses(code: str) -> list[str]:
        rows = await fetch(pool, "SELECT status FROM monitoring_collect_tasks WHERE id = ANY(%s)", tasks[code])
        return [r["status"] for r in rows]

    healthy = {"openai": "healthy", "gemini": "healthy"}
    async with running_stack(settings, tmp_path, services=DISPATCH_SERVICES, **FAST_ENV) as stack:
        fast = TIMING_PROFILES["fast"]
        a = SimClient(SimOptions(hub_url=stack.hub_url, token=world.tokens[0], name="sim-a", timings=fast.scaled(4),
                                 heartbeat_interval_s=0.3, idle_poll_s=0.5, platform_health=healthy))
        # B's gemini login is broken from the start: gemini work can only run on A.
        b = SimClient(SimOptions(hub_url=stack.hub_url, token=world.tokens[1], name="sim-b", timings=fast.scaled(10),
                                 heartbeat_interval_s=0.3, idle_poll_s=0.5,
                                 platform_health={"openai": "healthy", "gemini": "login_required"}))
        await a.start()
        await b.start()
        try:
            await eventually(a_queued_openai, timeout=30, message="openai work queued for A")
            a.set_platform_health({"openai": "login_required", "gemini": "healthy"})

            async def released() -> list[dict[str, Any]] | None:
                return (await released_from_a() or None) if await a_queued_openai() == 0 else None

            freed = await eventually(released, timeout=10, message="A's queued openai work released")
            broke_at = await now()
            freed_ids = {str(r["id"]) for r in freed}

            async def told() -> bool:  # a task_control(cancelled) per released execution reached the client
                sent = {str(e["task_id"]) for e in a.stats.events if e.get("type") == "task_control"
                        and e.get("control") == "cancelled" and e.get("reason") == "platform_unhealthy"}
                return freed_ids <= sent

            await eventually(told, timeout=10, message="A told its openai work is cancelled")

            async def replanned() -> bool:  # each released task has a newer execution, on B
                rows = await fetch(pool, "SELECT DISTINCT monitor_task_id FROM desktop_tasks "
                                         "WHERE target_client_id = %s AND monitor_task_id = ANY(%s)",
                                   b_id, [r["monitor_task_id"] for r in freed])
                return len(rows) == len(freed)

            await eventually(replanned, timeout=30, message="the released openai work planned again on B")

            async def gemini_done() -> bool | None:
                return True if await statuses("gemini") == ["completed"] * 4 else None

            await eventually(gemini_done, timeout=60, message="A's gemini work kept flowing")
            assert await openai_leased_by(a_id, broke_at) == 0  # none of openai reached A since it broke

            # B's openai login breaks too: the tenant's openai is paused, B's queued openai released.
            b.set_platform_health({"openai": "login_required", "gemini": "login_required"})

            async def b_holds_no_queued_openai() -> bool:
                rows = await fetch(pool, "SELECT count(*) AS n FROM desktop_tasks WHERE target_client_id = %s "
                                         "AND ai_platform_id = %s AND status = 'queued'", b_id, openai)
                return int(rows[0]["n"]) == 0

            await eventually(b_holds_no_queued_openai, timeout=10, message="B's queued openai work released")
            assert "pending" in await statuses("openai")  # work left for A's recovery
            a.set_platform_health(healthy)  # the user logged in again
            recovered_at = await now()

            async def openai_done() -> bool | None:
                return True if await statuses("openai") == ["completed"] * 12 else None

            await eventually(openai_done, timeout=90, message="the held openai work completed after A recovered")
            assert await openai_leased_by(a_id, recovered_at) > 0
        finally:
            await a.stop()
            await b.stop()
