"""Batched heartbeat writes: every sign of life only marks the client; one UPDATE per flush
interval covers every client that showed one (thousands of clients, one statement), each client at most once
per `refresh_s`.

The platform-health pause at the hub (libs/domain/platform_health.py): with the reports it stores, a flush releases
the work already queued for a reporting client on a platform it reports a broken login on (the coordinator plans
none of it from then on, but what it queued before would still be leased and run): its queued executions and
unpulled legacy offers of the held lanes (normal, boosted, retry; high work still goes) end aborted with reason
`platform_unhealthy`, their business tasks get their dispatch attempt back for the coordinator to plan again
(to another client of the tenant whose login works, or held), `task.released` is emitted and the client told
`task_control(cancelled)`, in the transaction that stores the report. Every report while the login stays broken
does it again, so work queued by a pass that read the report before it changed is released at the next one (the
lease call skips it meanwhile: `held_for_broken_login_sql`). An operator's `ignore_health` override of the tenant's
platform keeps its work where it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec
import psycopg
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import LifecycleEvent
from libs.db.arrays import array_literal
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.db.write_health import WriterHealth
from libs.domain.platform_health import BLOCKING_STATES
from libs.mq.topology import LIFECYCLE
from libs.outbox import OutboxEvent, enqueue_many
from libs.tasks import execution_paths
from libs.tasks.controls import control_event
from libs.tasks.records import ReleasedWork
from libs.tasks.statuses import EndReason
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
                 refresh_s: float = 0.0, on_revived: Callable[[list[uuid.UUID]], None] | None = None) -> None:
        self._pool = pool
        self._on_revived = on_revived
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
        self.health_released = 0  # queued work released for a broken login
        self.release_failed = 0  # clients whose release failed (their report stored)

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
            cur = await conn.execute(q.HEARTBEAT_BATCH, {"ids": array_literal(ids), "hub": self._hub})
            await pipe.sync()
            revived = await cur.fetchall()
            for row in revived:  # the clients that were marked offline meanwhile
                await emit_lifecycle(conn, "client.online", tenant_id=int(row["tenant_id"]), client_id=row["id"])
        if revived and self._on_revived is not None:
            # Their presence moved here with this commit: events routed elsewhere before it are in a replay.
            self._on_revived([row["id"] for row in revived])

    async def _write_health(self, health: dict[uuid.UUID, dict[str, str]]) -> None:
        """Store the reports and release the work they block (module docstring): set-based for the whole flush, or,
        when that fails, one client at a time, its report and its release each in a savepoint of its own (one
        client's failure fails only that client's write; a report stored whose release failed is released again at
        the client's next report, and the lease call holds the work meanwhile)."""
        ids = sorted(health, key=str)
        rows = [{"id": str(client_id), "health": health[client_id]} for client_id in ids]
        # Only a report that names a blocking state can release anything (the report replaces the stored one): the
        # flush of a healthy fleet runs no release statement.
        broken = {client_id for client_id in ids if not BLOCKING_STATES.isdisjoint(health[client_id].values())}
        released: list[ReleasedWork] = []
        try:
            async with self._pool.connection() as conn, conn.transaction():
                await conn.execute(q.PLATFORM_HEALTH_BATCH, {"rows": msgspec.json.encode(rows).decode()})
                released = await release_unhealthy(conn, [c for c in ids if c in broken])
            self.health_released += len(released)
            _log_released(released)
            return
        except psycopg.DatabaseError as exc:
            log.warning("platform-health batch refused; writing the reports one by one",
                        extra={"clients": len(ids), "error": type(exc).__name__})
        released = []
        async with self._pool.connection() as conn, conn.transaction():
            for client_id, row in zip(ids, rows, strict=True):
                try:
                    async with conn.transaction():  # a savepoint: one bad report fails only itself
                        await conn.execute(q.PLATFORM_HEALTH, {"client_id": row["id"],
                                                               "health": msgspec.json.encode(row["health"]).decode()})
                except psycopg.DatabaseError as exc:
                    if conn.broken:
                        raise
                    self.health_rejected += 1
                    log.warning("platform-health report refused by the database",
                                extra={"client_id": row["id"], "error": type(exc).__name__})
                    continue
                if client_id not in broken:
                    continue
                try:
                    async with conn.transaction():
                        released += await release_unhealthy(conn, [client_id])
                except psycopg.DatabaseError as exc:
                    if conn.broken:
                        raise
                    self.release_failed += 1
                    log.warning("releasing a broken login's queued work failed; tried again at its next report",
                                exc_info=True, extra={"client_id": row["id"], "error": type(exc).__name__})
        self.health_released += len(released)
        _log_released(released)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
            try:
                await self.flush()
            except Exception:
                log.exception("heartbeat flush failed; will retry at the next interval")


RELEASE_REASON: EndReason = "platform_unhealthy"


async def release_unhealthy(conn: Conn, client_ids: list[uuid.UUID]) -> list[ReleasedWork]:
    """The clients' queued work of the held lanes on platforms they now report a broken login on, on both execution
    paths, released in the caller's transaction (execution_paths.release_unhealthy), each with its `task.released`
    and the client's `task_control(cancelled)`. Returns the released work."""
    if not client_ids:
        return []
    released = await execution_paths.release_unhealthy(conn, client_ids)
    if not released:
        return released
    now = datetime.now(UTC)
    events: list[OutboxEvent] = []
    for work in released:
        client_id = work.target_client_id
        events.append(control_event(task_id=work.id, client_id=client_id, control="cancelled",
                                    reason=RELEASE_REASON, interrupt_generation=work.interrupt_generation,
                                    tenant_id=work.tenant_id, collect_request_id=work.collect_request_id,
                                    now=now))
        events.append(OutboxEvent(
            exchange=LIFECYCLE, routing_key="task.released", tenant_id=work.tenant_id,
            message=LifecycleEvent(event="task.released", tenant_id=work.tenant_id, occurred_at=now,
                                   client_id=client_id, task_id=work.id, monitor_task_id=work.monitor_task_id,
                                   ai_platform_id=work.ai_platform_id, lane=work.lane, reason=RELEASE_REASON,
                                   collect_request_id=work.collect_request_id)))
    await enqueue_many(conn, events, notify=True)  # the client told and the coordinator woken now, not at a poll
    return released


def _log_released(released: list[ReleasedWork]) -> None:
    by_client: dict[tuple[uuid.UUID, int], list[ReleasedWork]] = {}
    for work in released:
        by_client.setdefault((work.target_client_id, work.tenant_id), []).append(work)
    for (client_id, tenant_id), rows in by_client.items():
        log.info("queued work released: the client reports a broken login on its platform", extra={
            "client_id": str(client_id), "tenant_id": tenant_id, "released": len(rows),
            "ai_platform_ids": sorted({r.ai_platform_id for r in rows}), "reason": RELEASE_REASON})
