"""Operator actions on the outbox: inspect dead letters, replay them explicitly."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from libs.db.pool import Conn
from libs.outbox import queries as q
from libs.outbox.state import TRANSITION_EVENT, ReplayPlan, plan_replay, source_of_row, transition_fields
from libs.outbox.writer import NOTIFY_CHANNEL

log = logging.getLogger("outbox.admin")


async def dead_letters(conn: Conn, limit: int = 100) -> list[dict[str, Any]]:
    cur = await conn.execute(q.LIST_DEAD_LETTERS, {"limit": limit})
    return list(await cur.fetchall())


async def replay(conn: Conn, *, ids: list[int] | None = None, replay_all: bool = False,
                 include_permanent: bool = False, operator: str = "operator") -> ReplayPlan:
    """Put dead letters back in the queue (attempts from zero), in one transaction: the named ones, or every one
    with `replay_all`. Only those whose failure was transient, unless `include_permanent` (a dead letter from
    before failures were classed counts as permanent). Returns what was reset and what was not, and why; each
    reset is logged as a transition by `operator`."""
    if not ids and not replay_all:
        raise ValueError("name the dead letters to replay (ids) or ask for all of them")
    async with conn.transaction():
        cur = await conn.execute(q.REPLAY_CANDIDATES, {"ids": ids or [], "all": replay_all})
        rows = {int(row["id"]): row for row in await cur.fetchall()}
        plan = plan_replay(rows.values(), requested=None if replay_all else ids, include_permanent=include_permanent)
        reset: list[dict[str, Any]] = []
        if plan.reset:
            cur = await conn.execute(q.REPLAY_DEAD_LETTERS, {"ids": plan.reset})
            reset = sorted(await cur.fetchall(), key=lambda r: int(r["id"]))
            await conn.execute("SELECT pg_notify(%(c)s, '')", {"c": NOTIFY_CHANNEL})
    for row in reset:  # after the commit: these transitions happened
        before = rows[int(row["id"])]
        log.info(TRANSITION_EVENT, extra=transition_fields(
            "replayed", "dead_letter", "queued", owner=operator, source=source_of_row(row),
            error_class=before["last_error_class"] or "unclassified", attempts_before=before["attempts"],
            include_permanent=include_permanent))
    return dataclasses.replace(plan, reset=[int(r["id"]) for r in reset])


async def depth(conn: Conn) -> dict[str, dict[str, int]]:
    cur = await conn.execute(q.DEPTH_BY_STATUS)
    return {r["status"]: {"count": int(r["n"]), "oldest_ms": int(r["oldest_ms"])} for r in await cur.fetchall()}
