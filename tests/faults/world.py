"""The world the fault tests run in: one tenant, one desktop, three brands to click."""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from tests.support.db import fetch as rows
from tests.support.stack import Stack
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions

OPS_TOKEN = "fault-test-ops-token-0123456789abcdef"
# The hub flushes heartbeats and pings sockets often, so a client's coming and going shows quickly.
HUB_ENV: dict[str, str | int] = {"HUB_HEARTBEAT_FLUSH_S": "0.3", "HUB_PING_INTERVAL_S": "1"}


async def seed_one_desktop(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=3, questions=2, clients=1, platforms=("openai",), due=False)
        await conn.execute("UPDATE platform_settings SET max_concurrent = 20")
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000}.items():
            await set_setting(conn, key, value)
    return seed


def one_desktop(stack: Stack, token: str) -> SimClient:
    """The world's desktop on the stack's hub: fast timings, a heartbeat a second (start it with `async with`)."""
    return SimClient(SimOptions(hub_url=stack.hub_url, token=token, timings=TIMING_PROFILES["fast"],
                                heartbeat_interval_s=1.0, ws_ping_interval_s=2.0, idle_poll_s=1.0, seed=7))


async def reached_desktop(pool: AsyncConnectionPool[Conn], desktop: SimClient) -> set[str]:
    """The high executions that reached the desktop: their `task_available` arrived, or the desktop leased them
    first. The event is a hint: a desktop that finishes a task leases the next by pull without waiting for its
    event, and an event published while the hub's queue was being declared again (the broker just back) is gone,
    its replay covering only the tasks still queued -- not one the desktop had leased meanwhile."""
    leased = await rows(pool, "SELECT id::text AS id FROM desktop_tasks WHERE lane = 'high' AND lease_epoch > 0")
    return set(desktop.stats.event_arrivals) | {r["id"] for r in leased}
