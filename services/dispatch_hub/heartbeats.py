"""Batched heartbeat writes: every sign of life only marks the client; one UPDATE per flush
interval covers every client that showed one (thousands of clients, one statement), each client at most once
per `refresh_s`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import msgspec
import psycopg
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.db.write_health import WriterHealth
from libs.tasks.transitions import emit_lifecycle
from services.dispatch_hub import queries as q

log = logging.getLogger("hub.heartbeats")


class HeartbeatWriter:
    """Marks clients alive in one statement per interval, and stores their platform-health reports.

    Liveness and health are written in separate transactions, and health reports set-based first and one by
    one (each in its own savepoint) only when the set-based write fails: nothing one client sends can fail
    another client's heartbeat, or make every client of this replica look offline.

    A client's liveness is written at most once per `refresh_s` (a sign of life in between waits for the first
    flush after that): readers judge it against the heartbeat timeout (30 s), and 10,000 clients heartbeating and
    answering pings wrote 2,000 rows a second, each touching two indexes on `last_heartbeat_at`.
    """

    def __init__(self, pool: AsyncConnectionPool[Conn], *, hub: str, interval_s: float,
                 is_connected: Callable[[uuid.UUID], bool], write_health: WriterHealth | None = None,
                 refresh_s: float = 0.0) -> None:
        self._pool = pool
        self._timings = write_health or WriterHealth("hub", hub)
        self._hub = hub
        self._interval = interval_s
        self._is_connected = is_connected
        self._touched: set[uuid.UUID] = set()
        self._health: dict[uuid.UUID, dict[str, str]] = {}
        self._refresh = refresh_s
        self._written: dict[uuid.UUID, float] = {}  # client -> when its liveness was written (monotonic)
        self.flushes = 0
        self.health_rejected = 0

    def touch(self, client_id: uuid.UUID) -> None:
        self._touched.add(client_id)

    def report_health(self, client_id: uuid.UUID, health: dict[str, str]) -> None:
        """The client's whole current view: it replaces what was stored (the last report of the interval wins)."""
        self._health[client_id] = dict(health)
        self._touched.add(client_id)

    def forget(self, client_id: uuid.UUID) -> None:
        """The client's last socket here closed."""
        self._written.pop(client_id, None)

    async def flush(self) -> int:
        touched, self._touched = self._touched, set()
        health, self._health = self._health, {}
        now = time.monotonic()
        # A client that disconnected since its last sign of life is not revived here.
        connected = [c for c in touched if self._is_connected(c)]
        due = [c for c in connected if now - self._written.get(c, -self._refresh) >= self._refresh]
        if len(due) < len(connected):
            self._touched.update(set(connected).difference(due))  # written at a later flush
        ids = sorted(due, key=str)
        if ids:
            await self._write_liveness(ids)
            self._written.update(dict.fromkeys(ids, now))
        if health:
            await self._write_health(health)
        self.flushes += 1
        return len(ids)

    async def _write_liveness(self, ids: list[uuid.UUID]) -> None:
        # Two round trips (the batch; the lifecycle events with the COMMIT): the clients' rows stay locked
        # briefly, and a collect-now bumping a client's generation rarely waits for them.
        async with self._timings.timed(), self._pool.connection() as conn, pipelined_transaction(conn) as pipe:
            cur = await conn.execute(q.HEARTBEAT_BATCH, {"ids": ids, "hub": self._hub})
            await pipe.sync()
            for row in await cur.fetchall():  # the clients that were marked offline meanwhile
                await emit_lifecycle(conn, "client.online", tenant_id=int(row["tenant_id"]), client_id=row["id"])

    async def _write_health(self, health: dict[uuid.UUID, dict[str, str]]) -> None:
        rows = [{"id": str(client_id), "health": report} for client_id, report in sorted(health.items(),
                                                                                         key=lambda i: str(i[0]))]
        try:
            async with self._pool.connection() as conn, conn.transaction():
                await conn.execute(q.PLATFORM_HEALTH_BATCH, {"rows": msgspec.json.encode(rows).decode()})
            return
        except psycopg.DataError:
            log.warning("platform-health batch refused; writing the reports one by one")
        async with self._pool.connection() as conn, conn.transaction():
            for row in rows:
                try:
                    async with conn.transaction():  # a savepoint: one bad report fails only itself
                        await conn.execute(q.PLATFORM_HEALTH, {"client_id": row["id"],
                                                               "health": msgspec.json.encode(row["health"]).decode()})
                except psycopg.DataError as exc:
                    self.health_rejected += 1
                    log.warning("platform-health report refused by the database",
                                extra={"client_id": row["id"], "error": type(exc).__name__})

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
            try:
                await self.flush()
            except Exception:
                log.exception("heartbeat flush failed; will retry at the next interval")
