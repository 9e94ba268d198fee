"""Coordinator tests and bench: bulk seeding, a simulated client fleet straight on the database, DB-side checks.

The fleet stands in for the hub + desktop clients: one loop leases queued executions for every client
(lane_weight DESC, priority DESC, enqueued_at ASC, within max_concurrent_monitor), "runs" each for a
fixed time, then ends it (execution_paths.end + finish_business_task + lifecycle 'task.completed'), or yields
it when collect-now asked for an interrupt meanwhile. Heartbeats are kept fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.demo import create_client, ensure_platforms
from libs.tasks import execution_paths
from libs.tasks.records import EndedExecution, ExecutionEnd
from libs.tasks.transitions import emit_lifecycle, finish_business_task, yield_business_task

_TENANT = "INSERT INTO tenants (name, time_zone) VALUES (%(name)s, %(tz)s) RETURNING id"
_BRAND = "INSERT INTO brands (tenant_id, workspace_id, name) VALUES (%(t)s, %(t)s, 'brand') RETURNING id"
_QUESTIONS_AND_PLANS = """
WITH q AS (
    INSERT INTO monitoring_questions (tenant_id, brand_id, text)
    SELECT %(t)s, %(b)s, 'question ' || g FROM generate_series(1, %(n)s) g
    RETURNING id
)
INSERT INTO monitoring_plans (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, next_run_at)
SELECT %(t)s, %(t)s, %(b)s, q.id, p, now() - make_interval(secs => %(due_ago_s)s)
FROM q CROSS JOIN unnest(%(platforms)s::bigint[]) p
"""
_ONLINE = """
UPDATE desktop_clients SET online = true, last_heartbeat_at = now(), connected_hub = 'sim', updated_at = now()
WHERE id = ANY(%(ids)s)
"""

_LEASE = """
WITH load AS (
    SELECT c.id, c.max_concurrent_monitor - count(d.id) AS free
    FROM desktop_clients c
    LEFT JOIN desktop_tasks d ON d.target_client_id = c.id AND d.kind = 'monitor' AND d.status = 'in_progress'
    WHERE c.id = ANY(%(clients)s)
    GROUP BY c.id
), ranked AS (
    SELECT d.id, l.free,
           row_number() OVER (PARTITION BY d.target_client_id
                              ORDER BY d.lane_weight DESC, d.priority DESC, d.enqueued_at, d.id) AS rn
    FROM desktop_tasks d JOIN load l ON l.id = d.target_client_id
    WHERE d.status = 'queued' AND d.kind = 'monitor'
)
UPDATE desktop_tasks d
SET status = 'in_progress', lease_epoch = d.lease_epoch + 1, leased_at = clock_timestamp(),
    started_at = clock_timestamp(), lease_expires_at = now() + interval '120 seconds',
    execution_phase = 'PREPARING', updated_at = now()
FROM ranked r
WHERE r.id = d.id AND r.rn <= r.free AND d.status = 'queued'
RETURNING d.id, d.lease_epoch, d.monitor_task_id, d.target_client_id, d.tenant_id, d.lane, d.ai_platform_id
"""
_FLAGS = "SELECT id, control_flags FROM desktop_tasks WHERE id = ANY(%(ids)s)"


@dataclass
class SeededTenant:
    tenant_id: int
    brand_id: int
    clients: list[uuid.UUID]


@dataclass
class Seeded:
    platforms: dict[str, int]
    tenants: list[SeededTenant]

    @property
    def client_ids(self) -> list[uuid.UUID]:
        return [c for t in self.tenants for c in t.clients]


async def seed_fleet(conn: Conn, *, plans_per_tenant: list[int], clients_per_tenant: int,
                     platforms: tuple[str, ...] = ("openai", "gemini", "perplexity"),
                     max_concurrent: int = 2, max_queue_depth: int = 20, time_zone: str = "UTC") -> Seeded:
    """Tenants with one brand, questions x platforms plans all due now, online clients. Bulk SQL."""
    async with conn.transaction():
        rows = await ensure_platforms(conn, platforms)
        platform_ids = {r["code"]: int(r["ai_platform_id"]) for r in rows}
        tenants = []
        for index, plans in enumerate(plans_per_tenant):
            cur = await conn.execute(_TENANT, {"name": f"fleet-{index + 1}", "tz": time_zone})
            tenant_id = int((await cur.fetchone())["id"])  # type: ignore[index]
            cur = await conn.execute(_BRAND, {"t": tenant_id})
            brand_id = int((await cur.fetchone())["id"])  # type: ignore[index]
            questions = -(-plans // len(platform_ids))
            await conn.execute(_QUESTIONS_AND_PLANS, {
                "t": tenant_id, "b": brand_id, "n": questions, "platforms": list(platform_ids.values()),
                # Earlier tenants' plans are due earlier, so FIFO would serve them first.
                "due_ago_s": 3600 - index})
            clients = []
            for _ in range(clients_per_tenant):
                client_id, _token = await create_client(conn, tenant_id=tenant_id, workspace_id=tenant_id,
                                                        user_id=tenant_id, max_concurrent_monitor=max_concurrent,
                                                        max_queue_depth=max_queue_depth)
                clients.append(client_id)
            await conn.execute(_ONLINE, {"ids": clients})
            tenants.append(SeededTenant(tenant_id=tenant_id, brand_id=brand_id, clients=clients))
    return Seeded(platforms=platform_ids, tenants=tenants)


@dataclass
class Fleet:
    pool: AsyncConnectionPool[Conn]
    clients: list[uuid.UUID]
    task_seconds: float = 0.03
    tick_seconds: float = 0.01
    completed: int = 0
    aborted: int = 0
    leased: list[dict[str, Any]] = field(default_factory=list)
    _running: dict[uuid.UUID, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            async with self.pool.connection() as conn:
                await conn.execute(_ONLINE, {"ids": self.clients})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def step(self) -> None:
        """Lease what fits, finish what is done (one transaction each)."""
        async with self.pool.connection() as conn:
            async with conn.transaction():
                cur = await conn.execute(_LEASE, {"clients": self.clients})
                rows = await cur.fetchall()
            now = time.monotonic()
            for r in rows:
                self._running[r["id"]] = (now + self.task_seconds, dict(r))
                self.leased.append(dict(r))
            due = [r for t, (at, r) in list(self._running.items()) if at <= now]
            if not due:
                return
            async with conn.transaction():
                cur = await conn.execute(_FLAGS, {"ids": [r["id"] for r in due]})
                flags = {f["id"]: f["control_flags"] or {} for f in await cur.fetchall()}
                for r in due:
                    if flags.get(r["id"], {}).get("interrupt_requested"):
                        ended = await execution_paths.end(conn, ExecutionEnd(
                            task_id=r["id"], outcome="aborted", lease_epoch=r["lease_epoch"],
                            reason="collect_now_preempt"))
                        if isinstance(ended, EndedExecution):  # Stale / NotFound: ended meanwhile
                            await yield_business_task(conn, r["monitor_task_id"])
                            await emit_lifecycle(conn, "task.aborted", tenant_id=r["tenant_id"],
                                                 client_id=r["target_client_id"], task_id=r["id"],
                                                 monitor_task_id=r["monitor_task_id"], reason="collect_now_preempt")
                            self.aborted += 1
                        continue
                    ended = await execution_paths.end(conn, ExecutionEnd(task_id=r["id"], outcome="succeeded",
                                                                         lease_epoch=r["lease_epoch"]))
                    if isinstance(ended, EndedExecution):  # Stale / NotFound: ended meanwhile
                        await finish_business_task(conn, r["monitor_task_id"], status="completed")
                        await emit_lifecycle(conn, "task.completed", tenant_id=r["tenant_id"],
                                             client_id=r["target_client_id"], task_id=r["id"],
                                             monitor_task_id=r["monitor_task_id"], ai_platform_id=r["ai_platform_id"],
                                             lane=r["lane"])
                        self.completed += 1
            for r in due:
                self._running.pop(r["id"], None)

    async def run(self, stop: asyncio.Event) -> None:
        beats = asyncio.create_task(self._heartbeats(stop))
        try:
            while not stop.is_set():
                await self.step()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.tick_seconds)
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats


@contextlib.asynccontextmanager
async def running(*workers: Any) -> AsyncIterator[asyncio.Event]:
    """Run `worker.run(stop)` for each worker until the block ends."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.gather(*tasks)


# ---- database-side measurements --------------------------------------------------------------------

_WINDOW_COUNTS = """
SELECT floor(extract(epoch FROM d.created_at) / %(w)s)::bigint AS window, d.tenant_id, (d.lane = 'high') AS high,
       count(*) AS n
FROM desktop_tasks d
WHERE d.kind = 'monitor'
  AND NOT (d.status = 'aborted' AND d.interrupt_reason = 'collect_now_preempt' AND d.lease_epoch = 0)
GROUP BY 1, 2, 3
"""


async def window_counts(conn: Conn, window_s: int) -> dict[int, dict[tuple[int, bool], int]]:
    """Executions per budget window, per (tenant, high?), refunds excluded (as the coordinator counts)."""
    cur = await conn.execute(_WINDOW_COUNTS, {"w": window_s})
    out: dict[int, dict[tuple[int, bool], int]] = defaultdict(dict)
    for r in await cur.fetchall():
        out[int(r["window"])][(r["tenant_id"], r["high"])] = int(r["n"])
    return dict(out)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Largest number of half-open [start, end) intervals alive at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    live = best = 0
    for _, delta in events:  # ends sort before starts at the same instant (-1 < 1)
        live += delta
        best = max(best, live)
    return best


_INTERVALS = """
SELECT d.tenant_id, d.ai_platform_id, d.target_client_id, d.lane,
       extract(epoch FROM d.created_at)::float8 AS created,
       extract(epoch FROM d.leased_at)::float8 AS leased,
       extract(epoch FROM coalesce(d.finished_at, clock_timestamp()))::float8 AS finished
FROM desktop_tasks d WHERE d.kind = 'monitor'
"""


async def concurrency_peaks(conn: Conn) -> dict[str, dict[Any, int]]:
    """Peak active executions per (tenant, platform), in-progress per client, queued normal per client."""
    cur = await conn.execute(_INTERVALS)
    rows = await cur.fetchall()
    platform: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    running_: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    queued: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        platform[(r["tenant_id"], r["ai_platform_id"])].append((r["created"], r["finished"]))
        if r["leased"] is not None:
            running_[r["target_client_id"]].append((r["leased"], r["finished"]))
        if r["lane"] != "high":
            queued[r["target_client_id"]].append((r["created"], r["leased"] or r["finished"]))
    return {"platform": {k: max_overlap(v) for k, v in platform.items()},
            "client_running": {k: max_overlap(v) for k, v in running_.items()},
            "client_queued": {k: max_overlap(v) for k, v in queued.items()}}
