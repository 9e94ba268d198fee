"""`monitorctl status`: leaders, schema version and ingest lag, and an exit code that says whether all is well."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.migrate import load_migrations
from libs.db.pool import Conn
from libs.leader import LEADER_LOCKS, LeaderLock
from tests.support.monitorctl import monitorctl_status
from tests.support.wait import eventually


@contextlib.asynccontextmanager
async def _leading(settings: Settings, role: str) -> AsyncIterator[LeaderLock]:
    lock = LeaderLock(settings.database_url, role, holder=f"test-{role}", retry_interval=0.1)
    stop = asyncio.Event()

    async def lead(leading_stop: asyncio.Event) -> None:
        await leading_stop.wait()

    task = asyncio.create_task(lock.run(stop, lead))
    try:
        await eventually(lock.is_leader.is_set, message=f"{role} leading")
        yield lock
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_status_names_a_missing_leader_and_exits_1(settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with _leading(settings, "reconciler"):
        code, status = await monitorctl_status(settings)
    assert code == 1
    assert status["healthy"] is False
    assert status["problems"] == ["no dispatch-coordinator replica holds the leader lock"]
    by_role = {r["role"]: r for r in status["leaders"]}
    assert by_role["reconciler"]["leading"] and by_role["reconciler"]["holder"] == "test-reconciler"
    assert by_role["reconciler"]["term"] == 1
    assert not by_role["dispatch-coordinator"]["leading"] and by_role["dispatch-coordinator"]["term"] is None


async def test_status_with_every_leader_and_the_schema_current_exits_0(settings: Settings) -> None:
    async with contextlib.AsyncExitStack() as leaders:
        for role in LEADER_LOCKS:
            await leaders.enter_async_context(_leading(settings, role))
        code, status = await monitorctl_status(settings)
    assert (code, status["healthy"], status["problems"]) == (0, True, [])
    latest = max(m.version for m in load_migrations())
    assert status["schema"] == {"version": latest, "expected": latest}
    assert status["ingest_lag_ms"] == 0


async def test_status_names_a_schema_behind_the_code(settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM schema_migrations WHERE version = (SELECT max(version) FROM schema_migrations)")
    async with contextlib.AsyncExitStack() as leaders:
        for role in LEADER_LOCKS:
            await leaders.enter_async_context(_leading(settings, role))
        code, status = await monitorctl_status(settings)
    assert code == 1
    assert status["problems"][0].startswith("schema at version")
