"""Leader election through a Postgres session advisory lock: one active replica, hot standbys."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from libs.db.pool import Conn, connect
from libs.telemetry import metrics

log = logging.getLogger("leader")

LEADER_LOCKS = {"dispatch-coordinator": 7_401_552_101, "reconciler": 7_401_552_102}

Lead = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


class LeaderLock:
    """Holds `pg_try_advisory_lock(key)` on a dedicated connection while leading.

    If the leader dies, Postgres ends its session and frees the lock; a standby polling every
    `retry_interval` seconds takes over. If the leader loses its connection, it stops leading
    at once (the lock went with the session).
    """

    def __init__(self, database_url: str, role: str, *, retry_interval: float = 1.0,
                 check_interval: float = 1.0) -> None:
        self._url = database_url
        self.role = role
        self._key = LEADER_LOCKS[role]
        self._retry = retry_interval
        self._check = check_interval
        self.is_leader = asyncio.Event()

    async def run(self, stop: asyncio.Event, lead: Lead) -> None:
        while not stop.is_set():
            conn: Conn | None = None
            try:
                conn = await connect(self._url, name=f"{self.role}-leader")
                while not stop.is_set():
                    cur = await conn.execute("SELECT pg_try_advisory_lock(%s) AS ok", (self._key,))
                    row = await cur.fetchone()
                    if row and row["ok"]:
                        await self._lead(conn, stop, lead)
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self._retry)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("leader election connection failed", extra={"role": self.role, "error": str(exc)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._retry)
            finally:
                self.is_leader.clear()
                metrics.leader_is_active.labels(role=self.role).set(0)
                metrics.set_leading(self.role, False)
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()

    async def _lead(self, conn: Conn, stop: asyncio.Event, lead: Lead) -> None:
        log.info("became leader", extra={"role": self.role})
        self.is_leader.set()
        metrics.leader_is_active.labels(role=self.role).set(1)
        metrics.set_leading(self.role, True)
        leading_stop = asyncio.Event()
        work = asyncio.create_task(lead(leading_stop), name=f"{self.role}-lead")
        try:
            while not stop.is_set() and not work.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stop.wait()), self._check)
                if work.done():
                    break
                await conn.execute("SELECT 1")  # raises if the session (and so the lock) is gone
        finally:
            leading_stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(work, 30)
            if not work.done():
                work.cancel()
            log.info("stopped leading", extra={"role": self.role})
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()  # type: ignore[misc]
