"""Batched heartbeat writes: every sign of life only marks the client; one UPDATE per flush
interval covers every client that showed one (thousands of clients, one statement)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

import msgspec
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.tasks.transitions import emit_lifecycle
from services.dispatch_hub import queries as q

log = logging.getLogger("hub.heartbeats")


class HeartbeatWriter:
    def __init__(self, pool: AsyncConnectionPool[Conn], *, hub: str, interval_s: float,
                 is_connected: Callable[[uuid.UUID], bool]) -> None:
        self._pool = pool
        self._hub = hub
        self._interval = interval_s
        self._is_connected = is_connected
        self._touched: set[uuid.UUID] = set()
        self._health: dict[uuid.UUID, dict[str, str]] = {}
        self.flushes = 0

    def touch(self, client_id: uuid.UUID) -> None:
        self._touched.add(client_id)

    def report_health(self, client_id: uuid.UUID, health: dict[str, str]) -> None:
        self._health.setdefault(client_id, {}).update(health)
        self._touched.add(client_id)

    async def flush(self) -> int:
        touched, self._touched = self._touched, set()
        health, self._health = self._health, {}
        # A client that disconnected since its last sign of life is not revived here.
        ids = sorted((c for c in touched if self._is_connected(c)), key=str)
        if not ids and not health:
            return 0
        # Two round trips (the batch and the health reports; the lifecycle events with the COMMIT): the clients'
        # rows stay locked briefly, and a collect-now bumping a client's generation rarely waits for them.
        async with self._pool.connection() as conn, pipelined_transaction(conn) as pipe:
            cur = None
            if ids:
                cur = await conn.execute(q.HEARTBEAT_BATCH, {"ids": ids, "hub": self._hub})
            for client_id, platform_health in health.items():
                await conn.execute(q.PLATFORM_HEALTH, {"client_id": client_id,
                                                       "health": msgspec.json.encode(platform_health).decode()})
            revived = []
            if cur is not None:
                await pipe.sync()
                revived = [r for r in await cur.fetchall() if not r["was_online"]]
            for row in revived:
                await emit_lifecycle(conn, "client.online", tenant_id=int(row["tenant_id"]), client_id=row["id"])
        self.flushes += 1
        return len(ids)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
            try:
                await self.flush()
            except Exception:
                log.exception("heartbeat flush failed; will retry at the next interval")
