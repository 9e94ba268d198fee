"""Periodic work of the leader besides dispatch: backlog and execution-path metrics, aging (§9.4), auto slow-down
(§12.4)."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Generic, TypeVar

import msgspec
from prometheus_client import Gauge
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.db.write_health import FRESH_S, FRESH_TOTALS
from libs.dispatch_settings import DispatchSettings
from libs.domain.aging import AgingPace, age_task, oldest_share
from libs.domain.lanes import monitor_lane
from libs.domain.slowdown import Signals, Thresholds, WriteStats, slowdown_reasons
from libs.ingest.lag import ingest_lag_ms
from libs.tasks import backlog_reads, business
from libs.telemetry import metrics
from services.dispatch_coordinator import queries as q

log = logging.getLogger("dispatch.maintenance")
LabelKey = TypeVar("LabelKey", int, str)


@dataclass(slots=True)
class Backlog:
    high: int = 0
    normal: int = 0
    retry: int = 0
    high_oldest_ms: float = 0.0
    tenant_normal: dict[int, int] = field(default_factory=dict)


# A census slice: this many pending tasks, in id order (~75 ms at 1,000,000 ready tasks). A tick of the maintenance
# loop counts one slice, so no tick scans the whole backlog (the three whole-backlog statements took 4.9 s a tick at
# 1,000,000 ready tasks) and the gauges move once a sweep is complete: every tick while the pending tasks fit in one
# slice, every ~80 s at 1,000,000 (docs/benchmarks.md "Cost as the backlog grows").
CENSUS_SLICE_ROWS = 25_000
# The census's wait buckets: ln(1 + wait_s) * WAIT_BUCKETS_PER_E (libs/tasks/backlog_reads.py, its census slice).
WAIT_BUCKETS_PER_E = 64


@dataclass(frozen=True, slots=True)
class CensusTotals:
    """One complete sweep: ready non-high tasks per lane and tenant (`lanes`: lane -> tenant -> tasks), pending tasks
    per execution path, and the ready normal tasks' waits (bucket -> tasks) as of `reference` (epoch seconds);
    `tenant_normal` (derived) is the ready normal backlog per tenant, summed over the normal backlog's lanes."""

    lanes: dict[str, dict[int, int]]
    owners: dict[str, int]
    waits: dict[int, int]
    reference: float
    tenant_normal: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        normal: Counter[int] = Counter()
        for lane, tenants in self.lanes.items():
            if monitor_lane(lane).normal_backlog:
                normal.update(tenants)
        object.__setattr__(self, "tenant_normal", dict(normal))

    @property
    def tenant_lanes(self) -> dict[tuple[int, str], int]:
        """The same counts per (tenant, lane)."""
        return {(tenant, lane): n for lane, tenants in self.lanes.items() for tenant, n in tenants.items()}

    @property
    def ready_normal(self) -> int:
        return sum(self.tenant_normal.values())

    @property
    def ready_retry(self) -> int:
        """Ready non-high tasks outside the normal backlog's lanes (retry)."""
        return sum(sum(tenants.values()) for lane, tenants in self.lanes.items()
                   if not monitor_lane(lane).normal_backlog)

    def wait_percentile_ms(self, quantile: float, now: float) -> float:
        """The nearest-rank `quantile` of the ready normal tasks' waits, as of `now` (they all waited on since the
        sweep measured them); 0 without any."""
        total = sum(self.waits.values())
        if total == 0:
            return 0.0
        rank, seen = max(1, math.ceil(quantile * total)), 0
        for bucket in sorted(self.waits):
            seen += self.waits[bucket]
            if seen >= rank:
                wait_s = math.exp((bucket + 0.5) / WAIT_BUCKETS_PER_E) - 1
                return (wait_s + max(0.0, now - self.reference)) * 1000
        return 0.0


@dataclass(slots=True)
class BacklogCensus:
    """The pending tasks counted a slice per maintenance tick (`advance`), in id order. A slice's counts are exact when
    it runs; a sweep's slices run seconds apart, so a task that changes meanwhile is counted as it was when its slice
    ran (tasks created during a sweep are counted by it, being the newest ids): a gauge's accuracy, while no tick and
    no statement costs more than one slice. The aging round takes its share from the last sweep's count."""

    after_id: int = 0
    reference: float = 0.0
    lanes: dict[str, Counter[int]] = field(default_factory=dict)
    owners: Counter[str] = field(default_factory=Counter)
    waits: Counter[int] = field(default_factory=Counter)
    done: CensusTotals | None = None

    async def advance(self, conn: Conn, *, slices: int = 1) -> CensusTotals | None:
        """Count up to `slices` slices (every slice, before the first sweep is complete); the last complete sweep."""
        counted = 0
        while self.done is None or counted < slices:
            if self.after_id == 0:
                self.reference = time.time()
            counts = await backlog_reads.census_slice(conn, after_id=self.after_id, rows=CENSUS_SLICE_ROWS,
                                                      reference=self.reference)
            for lane, tenants in counts.lanes.items():
                self.lanes.setdefault(lane, Counter()).update(tenants)
            self.owners.update(counts.owners)
            self.waits.update(counts.waits)
            self.after_id = int(counts.last_id or self.after_id)
            counted += 1
            if counts.pending < CENSUS_SLICE_ROWS:  # the sweep reached the newest pending task
                self.done = CensusTotals({lane: dict(t) for lane, t in self.lanes.items()}, dict(self.owners),
                                         dict(self.waits), self.reference)
                self.after_id = 0
                self.lanes, self.owners, self.waits = {}, Counter(), Counter()
                break
        return self.done


# The census of each database this process watches (one in production; tests use a database each).
_censuses: dict[str, BacklogCensus] = {}


def _database(conn: Conn) -> str:
    return f"{conn.info.host}:{conn.info.port}/{conn.info.dbname}"


def census_for(conn: Conn) -> BacklogCensus:
    """The census `observe_backlog` keeps for the connection's database."""
    return _censuses.setdefault(_database(conn), BacklogCensus())


@dataclass(frozen=True, slots=True)
class Paths:
    """The rollout as stored and the work in flight per execution path (docs/legacy-path.md)."""

    rollout_percentage: int
    in_flight: dict[str, int]


async def observe_paths(conn: Conn) -> Paths:
    """The rollout dashboard's gauges, exactly, in one statement: the rollout percentage as stored (what the scanner and
    collect-now give new tasks), active executions and live legacy leases."""
    read = await backlog_reads.paths_in_flight(conn, default_rollout=DispatchSettings().rollout_percentage)
    paths = Paths(read.rollout_percentage, {"desktop_tasks": read.desktop_tasks, "legacy": read.legacy})
    metrics.dispatch_rollout_percentage.set(paths.rollout_percentage)
    for owner, n in paths.in_flight.items():
        metrics.dispatch_in_flight_tasks.labels(execution_owner=owner).set(n)
    return paths


@dataclass(slots=True)
class LabelledGauge(Generic[LabelKey]):
    """A per-label gauge published from a whole mapping (label value -> value) at a time: only the labels whose value
    changed are written, and those that disappeared are removed, not left at a stale value. Writing every label every
    tick was 20,000 `labels().set()` calls a tick at 10,000 tenants and 10,000 clients, for values a tick mostly leaves
    as they were (docs/benchmarks.md "The maintenance tick and the aging round at 10,000 tenants and 1,000,000
    tasks")."""

    gauge: Gauge
    label: str
    published: dict[LabelKey, int] = field(default_factory=dict)

    def publish(self, values: dict[LabelKey, int]) -> int:
        """Publish `values`; the labels written or removed."""
        published = self.published
        if values == published:
            return 0
        gone = published.keys() - values.keys()
        written = len(gone)
        if len(gone) > len(values):
            # Most labels went (a fleet gone offline): one clear and the rest written anew, rather than a `remove`
            # each (10,000 removes held the leader's event loop ~190 ms in the 10,000-client probe).
            self.gauge.clear()
            published = {}
        else:
            for key in gone:
                self.gauge.remove(str(key))
        for key, value in values.items():
            if published.get(key) != value:
                self.gauge.labels(**{self.label: str(key)}).set(value)
                written += 1
        self.published = dict(values)
        return written


_tenant_backlog: LabelledGauge[int] = LabelledGauge(metrics.tenant_monitor_normal_backlog, "tenant_id")
_client_queue_depth: LabelledGauge[str] = LabelledGauge(metrics.desktop_client_monitor_queue_depth, "client_id")


async def observe_backlog(conn: Conn, census: BacklogCensus | None = None) -> Backlog:
    """Ready backlog per lane and tenant, into the §15.1 gauges: the high lane and the clients' queues exactly, the rest
    from the census (`census_for(conn)` unless given), one slice further each call; and the execution paths' gauges
    (`observe_paths`). The per-tenant and per-client gauges are written where they changed (`LabelledGauge`)."""
    backlog = Backlog()
    await observe_paths(conn)
    high = await backlog_reads.high_backlog(conn)
    backlog.high, backlog.high_oldest_ms = high.n, high.oldest_ms
    totals = await (census or census_for(conn)).advance(conn)
    if totals is not None:
        backlog.tenant_normal = dict(totals.tenant_normal)
        backlog.normal, backlog.retry = totals.ready_normal, totals.ready_retry
        metrics.monitor_normal_starvation_age_p99.set(totals.wait_percentile_ms(0.99, time.time()))
        metrics.execution_owner_legacy_count.set(totals.owners.get("legacy", 0))
        metrics.execution_owner_desktop_tasks_count.set(totals.owners.get("desktop_tasks", 0))
        _tenant_backlog.publish(totals.tenant_normal)
        metrics.monitor_dispatch_normal_backlog.set(backlog.normal)
    metrics.monitor_dispatch_high_backlog.set(backlog.high)
    metrics.monitor_dispatch_high_oldest_age_ms.set(backlog.high_oldest_ms)
    _client_queue_depth.publish(await backlog_reads.client_queue_depths(conn))
    return backlog


# An aging round's updates go in transactions of this many tasks (each a few tens of ms, so a collect-now promoting
# one of them waits at most that long), oldest first; and a round changes at least this many (AgingPace's floor).
AGING_BATCH = 500


def aging_round_limit(settings: DispatchSettings) -> int:
    """The most tasks one aging round may change: twice what the cluster budget lets dispatch before the next round
    (a boost stays; the next round boosts the next oldest). More reorders tasks none of which can go before then,
    at ~0.17 ms of index maintenance a task: at 1,000,000 ready tasks a round's share is 100,000 tasks, 17 s of
    updates every 30 s (docs/benchmarks.md "Cost as the backlog grows"). The coordinator's rounds go at the dispatch
    pace below it (`aging_pace`)."""
    per_round = settings.cluster_dispatch_per_minute * max(1, settings.aging_interval_seconds) / 60
    return max(AGING_BATCH, math.ceil(2 * per_round))


def aging_pace() -> AgingPace:
    """The coordinator's pace of aging rounds (libs/domain/aging.py): at least one batch a round."""
    return AgingPace(floor=AGING_BATCH)


@dataclass(frozen=True, slots=True)
class AgingRound:
    """One aging round: the tasks it boosted (what its UPDATEs changed), the statements it ran and its limit."""

    boosted: int
    statements: int
    limit: int


async def run_aging(pool: AsyncConnectionPool[Conn], settings: DispatchSettings, *,
                    limit: int | None = None) -> AgingRound:
    """One aging round: the oldest `aging_fraction` of ready normal work gets its boost, oldest first, in batches of
    AGING_BATCH (one transaction each, a read and an UPDATE), at most `limit` tasks (the coordinator's pace;
    default: `aging_round_limit`). How many are ready comes from the last complete census of the backlog (counted
    here only before there is one)."""
    most = aging_round_limit(settings) if limit is None else max(1, limit)
    statements = 0
    async with pool.connection() as conn:
        totals = census_for(conn).done
        if totals is not None:
            ready = totals.ready_normal
        else:
            ready = await backlog_reads.ready_normal_count(conn)
            statements += 1
    considered = share = oldest_share(ready, settings.aging_fraction)
    after: tuple[datetime, int] = (_START_OF_TIME, 0)
    boosted = written = 0
    while share > 0 and written < most:
        batch = min(AGING_BATCH, most - written)
        async with pool.connection() as conn, conn.transaction():
            rows = await backlog_reads.aging_candidates(conn, cap=settings.aging_cap, after=after, share=share,
                                                        batch=batch)
            statements += 1
            tids: list[str] = []
            versions: list[str] = []
            ids: list[int] = []
            lanes: list[str] = []
            priorities: list[int] = []
            boosts: list[int] = []
            for r in rows:
                aged = age_task(r.lane, r.priority, r.aging_boost, r.wait_minutes, settings.aging_cap)
                if aged is None:
                    continue
                tids.append(r.tid)
                versions.append(r.version)
                ids.append(r.id)
                lanes.append(aged.lane)
                priorities.append(aged.priority)
                boosts.append(aged.aging_boost)
            if ids:
                boosted += await business.apply_aging(conn, tids=tids, versions=versions, ids=ids, lanes=lanes,
                                                      priorities=priorities, boosts=boosts)
                statements += 1
        written += len(ids)
        if len(rows) < batch:  # the share's end, or the ready tasks'
            break
        after = (rows[-1].enqueued_at, rows[-1].id)
        share -= rows[-1].walked
    metrics.dispatch_aging_round_limit.set(most)
    if boosted:
        metrics.dispatch_aging_boosted_count.inc(boosted)
        log.info("aging round", extra={"ready": ready, "considered": considered,
                                       "limit": most, "boosted": boosted, "statements": statements})
    return AgingRound(boosted=boosted, statements=statements, limit=most)


_START_OF_TIME = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(slots=True)
class SlowdownState:
    active: bool = False
    reasons: list[str] = field(default_factory=list)
    signals: Signals = field(default_factory=Signals)
    since: float | None = None


async def measure_signals(conn: Conn, stats: WriteStats, *, min_writes: int = 20, now: float | None = None) -> Signals:
    """Lags from the tables; write latency and conflicts from every writer of the monitoring database (ingest,
    projection and hub replicas publish theirs: libs/db/write_health.py) and from this coordinator's own
    dispatch transactions: the worst p95, and the conflict share of all their writes. `now`: the monotonic time
    on the clock `stats` were recorded by (default: the system's)."""
    ingest = await ingest_lag_ms(conn)
    cur = await conn.execute(q.PROJECTION_LAG)
    projection = await cur.fetchone()
    cur = await conn.execute(FRESH_TOTALS, {"fresh_s": FRESH_S})
    writers = await cur.fetchone()
    now = time.monotonic() if now is None else now
    own_writes, own_conflicts = stats.counts(now)
    writes = own_writes + (int(writers["writes"]) if writers else 0)
    conflicts = own_conflicts + (int(writers["conflicts"]) if writers else 0)
    return Signals(ingest_lag_ms=ingest,
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
