"""Leader election: a Postgres session advisory lock says who leads, a fencing term makes a deposed leader harmless.

The lock lives on a dedicated session. A leader that dies cleanly ends its session and frees the lock at once; a
leader whose node goes silent (no FIN, no RST) is found out by the server's own keepalive and `tcp_user_timeout`
on that session (per-session settings, set below), which end the session and free the lock within
`lease_seconds`. A standby polling every `retry_interval` then takes the lock.

Each takeover takes a new term (`leader_terms`, migration 024) and re-opens the leader's pooled sessions with that
term in their options; a trigger on every table refuses a statement whose session's term is not the stored one
(SQLSTATE MLF01, `is_fenced`). So a deposed leader that comes back after its successor started cannot commit leader
work, whatever its timing. The leader also steps down by itself when it has not renewed within
`renew_deadline` (the health query has that deadline too), as client-go's leader election does with its
RenewDeadline. docs/reliability.md "Leader election and fencing".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn, connect
from libs.telemetry import metrics

log = logging.getLogger("leader")

LEADER_LOCKS = {"dispatch-coordinator": 7_401_552_101, "reconciler": 7_401_552_102}
FENCED_SQLSTATE = "MLF01"

Lead = Callable[[asyncio.Event], Coroutine[Any, Any, None]]

# The Kubernetes Lease defaults: a silent leader is replaced within 15 s, a leader that cannot renew for 10 s
# steps down (client-go's LeaseDuration and RenewDeadline).
LEASE_SECONDS = 15.0
RENEW_DEADLINE_SECONDS = 10.0

TAKE_TERM = """
INSERT INTO leader_terms AS t (role, term, holder) VALUES (%(role)s, 1, %(holder)s)
ON CONFLICT (role) DO UPDATE SET term = t.term + 1, holder = excluded.holder, taken_at = now()
RETURNING term
"""


def is_fenced(exc: BaseException) -> bool:
    """A statement refused because its session's leader term is no longer the current one."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate == FENCED_SQLSTATE


def lock_session_options(lease_seconds: float) -> str:
    """Server-side settings of the lock's session: the server probes an idle session after a third of the lease
    and gives up on a peer that stops acknowledging (keepalives or sent data) within about two thirds of it, so
    a silent leader's session, and its lock, end before the lease has passed."""
    idle = max(1, int(lease_seconds / 5))
    interval = max(1, int(lease_seconds / 10))
    user_timeout_ms = int(lease_seconds * 1000 * 0.6)
    return (f"-c tcp_keepalives_idle={idle} -c tcp_keepalives_interval={interval} -c tcp_keepalives_count=3 "
            f"-c tcp_user_timeout={user_timeout_ms}")


TERM_MARK = " -c monitoring.leader_role="


def term_options(role: str, term: int | None, lease_seconds: float) -> str:
    """The session options that bind a pooled session to a leader term (empty: not leader work). Its sessions get
    the lock session's keepalives too: a silent leader's open transaction holds the term row's share lock, which
    the successor's takeover waits for, until the server ends that session."""
    if term is None:
        return ""
    return f"{TERM_MARK}{role} -c monitoring.leader_term={term} {lock_session_options(lease_seconds)}"


async def fence_pools(pools: Sequence[AsyncConnectionPool[Conn]], role: str, term: int | None,
                       lease_seconds: float) -> None:
    """New sessions of `pools` carry `term` (None: none); the idle ones are closed now and the ones in use when
    they come back (psycopg_pool's `drain`), so no session of another term is handed out afterwards."""
    for pool in pools:
        if not isinstance(pool.kwargs, dict):
            raise TypeError("a fenced pool needs its connection kwargs as a dict")
        base = pool.kwargs.get("options", "").split(TERM_MARK)[0]
        pool.kwargs["options"] = base + term_options(role, term, lease_seconds)
        await pool.drain()


class LeaderLock:
    """Holds `pg_try_advisory_lock(key)` on a dedicated session while leading; `fenced` pools run the leader's
    work and are bound to the current term while it leads (to none otherwise)."""

    def __init__(self, database_url: str, role: str, *, holder: str = "",
                 fenced: Sequence[AsyncConnectionPool[Conn]] = (), retry_interval: float = 1.0,
                 check_interval: float = 1.0, lease_seconds: float = LEASE_SECONDS,
                 renew_deadline: float = RENEW_DEADLINE_SECONDS) -> None:
        if not check_interval < renew_deadline < lease_seconds:
            raise ValueError("leader election needs check_interval < renew_deadline < lease_seconds")
        self._url = database_url
        self.role = role
        self._key = LEADER_LOCKS[role]
        self._holder = holder or role
        self._fenced = tuple(fenced)
        self._retry = retry_interval
        self._check = check_interval
        self._lease = lease_seconds
        self._renew_deadline = renew_deadline
        self.is_leader = asyncio.Event()
        self.term: int | None = None

    async def run(self, stop: asyncio.Event, lead: Lead) -> None:
        while not stop.is_set():
            conn: Conn | None = None
            try:
                conn = await connect(self._url, name=f"{self.role}-leader",
                                     options=lock_session_options(self._lease))
                while not stop.is_set():
                    if await self._try_lock(conn):
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
                await self._step_down_state()
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()

    async def _try_lock(self, conn: Conn) -> bool:
        async with asyncio.timeout(self._renew_deadline):
            cur = await conn.execute("SELECT pg_try_advisory_lock(%s) AS ok", (self._key,))
            row = await cur.fetchone()
            if not (row and row["ok"]):
                return False
            # A deposed leader's statement in flight holds the term row's share lock; the increment waits for it
            # (the server ends that session within the lease if its node is gone).
            cur = await conn.execute(TAKE_TERM, {"role": self.role, "holder": self._holder})
            term_row = await cur.fetchone()
        assert term_row is not None
        self.term = int(term_row["term"])
        await fence_pools(self._fenced, self.role, self.term, self._lease)
        return True

    async def _step_down_state(self) -> None:
        was_leading = self.is_leader.is_set() or self.term is not None
        self.is_leader.clear()
        metrics.leader_is_active.labels(role=self.role).set(0)
        metrics.set_leading(self.role, False)
        if was_leading:
            self.term = None
            with contextlib.suppress(Exception):
                await fence_pools(self._fenced, self.role, None, self._lease)

    async def _lead(self, conn: Conn, stop: asyncio.Event, lead: Lead) -> None:
        log.info("became leader", extra={"role": self.role, "term": self.term})
        self.is_leader.set()
        metrics.leader_is_active.labels(role=self.role).set(1)
        metrics.set_leading(self.role, True)
        leading_stop = asyncio.Event()
        work = asyncio.create_task(lead(leading_stop), name=f"{self.role}-lead")
        deposed = False
        try:
            deposed = not await self._renew_until_done(conn, stop, work)
        finally:
            leading_stop.set()
            # A deposed leader stops at once: its sessions are fenced already, so its work could not commit. Its
            # cancelled queries may wait for psycopg's cancel timeout on a silent network: not waited for long.
            await asyncio.wait({work}, timeout=1 if deposed else 30)
            if not work.done():
                work.cancel()
                await asyncio.wait({work}, timeout=1 if deposed else 30)
            log.info("stopped leading", extra={"role": self.role, "term": self.term, "deposed": deposed})
        if not work.done():
            work.add_done_callback(lambda task: task.cancelled() or task.exception())
        elif not work.cancelled() and work.exception() is not None:
            raise work.exception()  # type: ignore[misc]

    async def _renew_until_done(self, conn: Conn, stop: asyncio.Event, work: asyncio.Task[None]) -> bool:
        """Renews (a health query on the lock's session) every `check_interval` until `stop` or the work ends:
        True. False when a renewal failed or `renew_deadline` passed without one: the leader steps down."""
        renewed = time.monotonic()
        while not stop.is_set() and not work.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stop.wait()), self._check)
            if stop.is_set() or work.done():
                return True
            # Not asyncio.timeout: cancelling a query makes psycopg send a cancel request, which a silent network
            # holds for psycopg's cancel timeout (30 s). Past the deadline the query is left to fail on the closed
            # connection instead.
            renewal = asyncio.ensure_future(conn.execute("SELECT 1"))  # fails if the session (the lock) is gone
            done, _ = await asyncio.wait({renewal}, timeout=max(0.1, renewed + self._renew_deadline - time.monotonic()))
            error = "renew deadline passed" if not done else renewal.exception()
            if error is not None:
                if not done:
                    renewal.add_done_callback(lambda task: task.cancelled() or task.exception())
                    await conn.close()
                log.warning("leader renewal failed: stepping down",
                            extra={"role": self.role, "term": self.term, "error": str(error)})
                return False
            renewed = time.monotonic()
        return True


LEADER_STATES = """
SELECT r.role, t.term, t.holder, t.taken_at,
       EXISTS (SELECT 1 FROM pg_locks l
               WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.database = (
                   SELECT oid FROM pg_database WHERE datname = current_database())
                 AND ((l.classid::bigint << 32) | l.objid::bigint) = r.lock_key) AS leading
FROM unnest(%(roles)s::text[], %(keys)s::bigint[]) AS r (role, lock_key)
LEFT JOIN leader_terms t ON t.role = r.role
ORDER BY r.role
"""


async def leader_states(conn: Conn) -> list[dict[str, Any]]:
    """Per leader-elected role: whether a replica holds its lock now, and the term and holder of the last takeover."""
    cur = await conn.execute(LEADER_STATES, {"roles": list(LEADER_LOCKS), "keys": list(LEADER_LOCKS.values())})
    return [{"role": r["role"], "leading": r["leading"], "term": r["term"], "holder": r["holder"],
             "taken_at": r["taken_at"].isoformat() if r["taken_at"] else None} for r in await cur.fetchall()]
