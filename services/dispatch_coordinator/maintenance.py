"""Periodic work of the leader besides dispatch: backlog metrics, aging (§9.4), auto slow-down (§12.4)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
from prometheus_client import Gauge
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.db.write_health import FRESH_S, FRESH_TOTALS
from libs.dispatch_settings import DispatchSettings
from libs.domain.aging import age_task, oldest_share
from libs.domain.slowdown import Signals, Thresholds, WriteStats, slowdown_reasons
from libs.telemetry import metrics
from services.dispatch_coordinator import queries as q

log = logging.getLogger("dispatch.maintenance")


@dataclass(slots=True)
class Backlog:
    high: int = 0
    normal: int = 0
    retry: int = 0
    high_oldest_ms: float = 0.0
    tenant_normal: dict[int, int] = field(default_factory=dict)


async def observe_backlog(conn: Conn) -> Backlog:
    """Ready backlog per lane and tenant, into the §15.1 gauges."""
    backlog = Backlog()
    cur = await conn.execute(q.BACKLOG)
    for r in await cur.fetchall():
        n = int(r["n"])
        if r["lane"] == "high":
            backlog.high += n
            backlog.high_oldest_ms = max(backlog.high_oldest_ms, float(r["oldest_ms"] or 0))
        elif r["lane"] == "retry":
            backlog.retry += n
        else:
            backlog.normal += n
            backlog.tenant_normal[r["tenant_id"]] = backlog.tenant_normal.get(r["tenant_id"], 0) + n
    metrics.monitor_dispatch_high_backlog.set(backlog.high)
    metrics.monitor_dispatch_normal_backlog.set(backlog.normal)
    metrics.monitor_dispatch_high_oldest_age_ms.set(backlog.high_oldest_ms)
    _set_tenant_backlog(backlog.tenant_normal)
    cur = await conn.execute(q.NORMAL_WAIT_P99)
    row = await cur.fetchone()
    metrics.monitor_normal_starvation_age_p99.set(float(row["p99_ms"]) if row else 0.0)
    cur = await conn.execute(q.OWNER_COUNTS)
    owners = {r["execution_owner"]: int(r["n"]) for r in await cur.fetchall()}
    metrics.execution_owner_legacy_count.set(owners.get("legacy", 0))
    metrics.execution_owner_desktop_tasks_count.set(owners.get("desktop_tasks", 0))
    cur = await conn.execute(q.CLIENT_QUEUE_DEPTH)
    depths = {str(r["id"]): int(r["queued"]) for r in await cur.fetchall()}
    _set_labelled(metrics.desktop_client_monitor_queue_depth, "client_id", depths, _seen_clients)
    return backlog


_seen_tenants: set[str] = set()
_seen_clients: set[str] = set()


def _set_tenant_backlog(values: dict[int, int]) -> None:
    _set_labelled(metrics.tenant_monitor_normal_backlog, "tenant_id", {str(k): v for k, v in values.items()},
                  _seen_tenants)


def _set_labelled(gauge: Gauge, label: str, values: dict[str, int], seen: set[str]) -> None:
    """Set a per-label gauge; labels that disappeared are removed, not left at a stale value."""
    for key in seen - set(values):
        gauge.remove(key)
    for key, value in values.items():
        gauge.labels(**{label: key}).set(value)
    seen.clear()
    seen.update(values)


async def run_aging(pool: AsyncConnectionPool[Conn], settings: DispatchSettings) -> int:
    """One aging round: the oldest `aging_fraction` of ready normal work gets its boost (one transaction)."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(q.AGING_READY_COUNT)
        row = await cur.fetchone()
        ready = int(row["n"]) if row else 0
        limit = oldest_share(ready, settings.aging_fraction)
        if limit == 0:
            return 0
        cur = await conn.execute(q.AGING_OLDEST, {"limit": limit})
        ids: list[int] = []
        lanes: list[str] = []
        priorities: list[int] = []
        boosts: list[int] = []
        for r in await cur.fetchall():
            aged = age_task(r["lane"], r["priority"], r["aging_boost"], float(r["wait_minutes"]), settings.aging_cap)
            if aged is None:
                continue
            ids.append(r["id"])
            lanes.append(aged.lane)
            priorities.append(aged.priority)
            boosts.append(aged.aging_boost)
        if ids:
            await conn.execute(q.AGING_APPLY, {"ids": ids, "lanes": lanes, "priorities": priorities,
                                               "boosts": boosts})
    if ids:
        metrics.dispatch_aging_boosted_count.inc(len(ids))
        log.info("aging round", extra={"ready": ready, "considered": limit, "boosted": len(ids)})
    return len(ids)


@dataclass(slots=True)
class SlowdownState:
    active: bool = False
    reasons: list[str] = field(default_factory=list)
    signals: Signals = field(default_factory=Signals)
    since: float | None = None


async def measure_signals(conn: Conn, stats: WriteStats, *, min_writes: int = 20) -> Signals:
    """Lags from the tables; write latency and conflicts from every writer of the monitoring database (ingest,
    projection and hub replicas publish theirs: libs/db/write_health.py) and from this coordinator's own
    dispatch transactions: the worst p95, and the conflict share of all their writes."""
    cur = await conn.execute(q.INGEST_LAG)
    ingest = await cur.fetchone()
    cur = await conn.execute(q.PROJECTION_LAG)
    projection = await cur.fetchone()
    cur = await conn.execute(FRESH_TOTALS, {"fresh_s": FRESH_S})
    writers = await cur.fetchone()
    now = time.monotonic()
    own_writes, own_conflicts = stats.counts(now)
    writes = own_writes + (int(writers["writes"]) if writers else 0)
    conflicts = own_conflicts + (int(writers["conflicts"]) if writers else 0)
    return Signals(ingest_lag_ms=float(ingest["lag_ms"]) if ingest else 0.0,
                   projection_lag_ms=float(projection["lag_ms"]) if projection else 0.0,
                   write_p95_ms=max(stats.p95_ms(now), float(writers["p95_ms"]) if writers else 0.0),
                   conflict_rate=conflicts / writes if writes >= min_writes else 0.0)


def update_slowdown(state: SlowdownState, signals: Signals, settings: DispatchSettings) -> bool:
    """Apply the thresholds; logs and metrics on every transition. Returns whether normal is paused."""
    thresholds = Thresholds(ingest_lag_ms=settings.ingest_lag_threshold_ms,
                            projection_lag_ms=settings.projection_lag_threshold_ms,
                            write_p95_ms=settings.db_write_p95_threshold_ms,
                            conflict_rate=settings.conflict_rate_threshold)
    reasons = slowdown_reasons(signals, thresholds) if settings.auto_slowdown_enabled else []
    active = bool(reasons)
    metrics.dispatch_auto_slowdown_signal.labels(signal="ingest_lag_ms").set(signals.ingest_lag_ms)
    metrics.dispatch_auto_slowdown_signal.labels(signal="projection_lag_ms").set(signals.projection_lag_ms)
    metrics.dispatch_auto_slowdown_signal.labels(signal="db_write_p95_ms").set(signals.write_p95_ms)
    metrics.dispatch_auto_slowdown_signal.labels(signal="conflict_rate").set(signals.conflict_rate)
    metrics.dispatch_auto_slowdown_active.set(1 if active else 0)
    extra = {"reasons": reasons, "ingest_lag_ms": round(signals.ingest_lag_ms),
             "projection_lag_ms": round(signals.projection_lag_ms),
             "db_write_p95_ms": round(signals.write_p95_ms, 1), "conflict_rate": round(signals.conflict_rate, 4)}
    if active and not state.active:
        log.warning("auto slow-down: pausing normal and retry dispatch, high continues", extra=extra)
        state.since = time.time()
    elif state.active and not active:
        log.info("auto slow-down over: normal dispatch resumes", extra=extra)
        state.since = None
    elif active and reasons != state.reasons:
        log.warning("auto slow-down continues", extra=extra)
    state.active, state.reasons, state.signals = active, reasons, signals
    return active


async def publish_state(conn: Conn, key: str, value: object) -> None:
    await conn.execute(q.PUBLISH_STATE, {"key": key, "value": msgspec.json.encode(value).decode()})
