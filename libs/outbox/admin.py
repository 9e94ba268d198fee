"""Operator actions on the outbox: inspect dead letters, replay them explicitly."""

from __future__ import annotations

from typing import Any

from libs.db.pool import Conn
from libs.outbox import queries as q
from libs.outbox.writer import NOTIFY_CHANNEL


async def dead_letters(conn: Conn, limit: int = 100) -> list[dict[str, Any]]:
    cur = await conn.execute(q.LIST_DEAD_LETTERS, {"limit": limit})
    return list(await cur.fetchall())


async def replay(conn: Conn, *, ids: list[int] | None = None, replay_all: bool = False) -> list[int]:
    if not ids and not replay_all:
        raise ValueError("name the dead letters to replay (ids) or ask for all of them")
    async with conn.transaction():
        cur = await conn.execute(q.REPLAY_DEAD_LETTERS, {"ids": ids or [], "all": replay_all})
        replayed = [row["id"] for row in await cur.fetchall()]
        if replayed:
            await conn.execute("SELECT pg_notify(%(c)s, '')", {"c": NOTIFY_CHANNEL})
    return replayed


async def depth(conn: Conn) -> dict[str, dict[str, int]]:
    cur = await conn.execute(q.DEPTH_BY_STATUS)
    return {r["status"]: {"count": int(r["n"]), "oldest_ms": int(r["oldest_ms"])} for r in await cur.fetchall()}
