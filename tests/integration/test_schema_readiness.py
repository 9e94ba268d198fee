"""Deployment order you can trust: a replica is not ready while the database schema is older than the migrations
its code ships (its rollout's migration has not run yet), and becomes ready once it has."""

from __future__ import annotations

import aiohttp
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.migrate import load_migrations
from libs.db.pool import Conn
from tests.support.desktop import running_hub


async def test_readiness_waits_for_the_schema_this_code_needs(settings: Settings,
                                                              pool: AsyncConnectionPool[Conn]) -> None:
    newest = max(m.version for m in load_migrations())
    async with pool.connection() as conn:
        cur = await conn.execute("DELETE FROM schema_migrations WHERE version = %s RETURNING version, name, checksum",
                                 (newest,))
        removed = await cur.fetchone()
    assert removed is not None

    async def readyz(server: TestServer) -> tuple[int, dict[str, str]]:
        async with aiohttp.ClientSession() as http, http.get(str(server.make_url("/readyz"))) as resp:
            return resp.status, (await resp.json())["checks"]

    async with running_hub(settings) as hub:
        status, checks = await readyz(hub)
        assert status == 503 and checks["schema"] == "failing" and checks["postgres"] == "ok"
        async with pool.connection() as conn:  # the rollout's migration ran
            await conn.execute("INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                               (removed["version"], removed["name"], removed["checksum"]))
        status, checks = await readyz(hub)
        assert status == 200 and checks["schema"] == "ok"
