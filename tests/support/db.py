"""Reading the database from a test: all rows of a query, or exactly one."""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn


async def fetch(pool: AsyncConnectionPool[Conn], query: str, *params: Any) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(query, params)
        return [dict(r) for r in await cur.fetchall()]


async def one(pool: AsyncConnectionPool[Conn], query: str, *params: Any) -> dict[str, Any]:
    found = await fetch(pool, query, *params)
    assert len(found) == 1, found
    return found[0]
