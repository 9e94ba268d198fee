"""One dispatch pass: read a snapshot, decide with the pure planner, write every execution in one transaction.

Hot path per pass (whatever the number of tasks): a pass lock, the window's budget use, platform
settings and active counts, eligible clients with their load, high candidates, per-(tenant, platform)
candidates, then one INSERT..SELECT for the executions, one INSERT for the outbox events and (for
collect-now work) one UPDATE of the requests. Everything runs in one transaction under a transaction
advisory lock, so the budgets read are exactly the budgets spent, even across a leader failover.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from opentelemetry.trace import Span
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from libs.clock import SYSTEM_CLOCK, Clock
from libs.contracts.wire import TaskAvailable
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.dispatch_settings import DispatchSettings
from libs.domain.dispatch import (
    CANDIDATE_ROWS_PER_DISPATCH,
    LANE_ORDER,
    Candidate,
    ClientState,
    Decision,
    Ledger,
    PairRead,
    PassLimits,
    PassResult,
    RejectReason,
    normal_client_room,
    pair_fetch_limit,
    pair_read_window,
    pair_window_share,
    pairs_after,
    plan_pass,
    retry_allowed,
    window_start,
)
from libs.domain.lanes import CLICK_LANE, execution_source, lane_weight, monitor_lane, routing_word
from libs.domain.platform_health import ClientHealth, OverrideMode, PauseSource, blocked_platforms, paused_pairs
from libs.domain.slowdown import WriteStats
from libs.mq.topology import DISPATCH
from libs.outbox import OutboxEvent, enqueue_many
from libs.outbox.relay import OutboxRelay, OwnClaim, claim_own
from libs.tasks import business, dispatch_reads, execution_paths
from libs.tasks.dispatch_reads import CandidateRow, ClaimedTask, HighRead, PlatformSetting, RequestsDispatched
from libs.tasks.push_leases import PushLeaseIssuer
from libs.telemetry import metrics, tracing
from services.dispatch_coordinator import queries as q
from services.dispatch_coordinator.high_relay import HighRelay
from services.dispatch_coordinator.pending_pairs import PendingPairs

log = logging.getLogger("dispatch.pass")

CONFLICT_ERRORS: tuple[type[Exception], ...] = (
    pg_errors.UniqueViolation, pg_errors.SerializationFailure, pg_errors.DeadlockDetected,
    pg_errors.LockNotAvailable,
)
# What a new pooled connection plans before its first click (libs.db.pool: EXPLAIN, nothing runs).
WARM_UP = dispatch_reads.high_pass_warm_up()
PER_PAIR_CAP = 50
# A lane whose pairs' windows found fewer candidates than the pass's budget reads at most this many windows a pass.
WINDOWS_PER_LANE = 3
# A window visits at most this many pairs per candidate row it may read (those without room are skipped unread).
VISITS_PER_ROW = 4
# A full pass reads its normal candidates in statements of about this many rows (see `read_candidates`).
CANDIDATE_CHUNK_ROWS = 100
# A full pass reads the clients of at least this many pairs' tenants at a time (see `Dispatcher._pair_window`).
MIN_STRETCH_PAIRS = 16


class WindowRolledOver(Exception):
    """The budget window changed while the pass was reading; it is redone at once in the new window."""


class Preempted(Exception):
    """High work was signalled while a full pass was reading: it yields (rolls back) before writing. A full pass
    checks after each of its reads (snapshot, candidates, plan) and after its claim, so a click waits at most
    for the statement in flight or for the pass's final write."""


# A full pass yields to waiting high work at most this many times in a row, so a stream of clicks cannot
# starve the normal lanes.
MAX_PREEMPTIONS = 3


@dataclass(slots=True)
class Snapshot:
    """What one pass reads (also what `explain` reads)."""

    now: float
    window_start: float
    window_seconds: int
    ledger: Ledger
    clients: list[ClientState]
    platform_codes: dict[int, str] = field(default_factory=dict)
    # (tenant, platform) -> why its scheduled work is held (platform-health pause).
    platform_pauses: dict[tuple[int, int], PauseSource] = field(default_factory=dict)
    # The operators' health overrides (a client's blocked platforms leave out its tenant's `ignore_health` ones).
    overrides: dict[tuple[int, int], OverrideMode] = field(default_factory=dict)
    # The tenants whose eligible clients are all in `clients` (a full pass: those its reads reached, see
    # `WindowClients`; `read_snapshot(all_clients=True)`: None, every tenant).
    client_tenants: set[int] | None = None


@dataclass(slots=True)
class ClientReads:
    """A full pass's reads of the clients (docs/architecture.md "Full pass: clients of the window"): statements, client
    rows returned and the budget rows of their tenants."""

    statements: int = 0
    rows: int = 0
    budget_rows: int = 0  # the tenants' budget use read with them (rows of dispatch_budget_ledger's sums)


@dataclass(slots=True)
class CandidateReads:
    """A full pass's normal-lane candidate reads: statements, (tenant, platform, lane) probes, rows returned."""

    statements: int = 0
    pairs: int = 0
    rows: int = 0


@dataclass(slots=True)
class PassOutcome:
    dispatched: int = 0
    high_dispatched: int = 0
    considered: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    cluster_exhausted: bool = False
    conflicted: bool = False
    preempted: bool = False
    full_batch: bool = False
    seconds_to_next_window: float = 0.0


def routing_key(lane: str, client_id: uuid.UUID) -> str:
    """`monitor.{lane}.{client}`; normal_boosted travels as normal."""
    return f"monitor.{routing_word(lane)}.{client_id}"


def limits_from(settings: DispatchSettings, *, slowdown: bool) -> PassLimits:
    return PassLimits(
        cluster_per_window=settings.cluster_dispatch_per_minute,
        tenant_per_window=settings.tenant_dispatch_per_minute,
        normal_background_share=settings.normal_background_share,
        high_reserved_share=settings.high_reserved_share,
        paused_lanes=frozenset(settings.paused_lanes),
        slowdown=slowdown,
        retry_low_watermark=settings.retry_low_watermark,
    )


async def read_snapshot(conn: Conn, settings: DispatchSettings, *, all_clients: bool = True) -> Snapshot:
    """Budget use of the current window, platform limits and activity, the platform-health pauses and (`all_clients`)
    every eligible client with its load; a full pass reads only the clients of its candidates' tenants
    (`WindowClients`)."""
    cur = await conn.execute(q.NOW)
    row = await cur.fetchone()
    assert row is not None
    now = float(row["now"])
    window = max(1, settings.budget_window_seconds)
    start = window_start(now, window)
    ledger = Ledger()
    read = await dispatch_reads.read_pass_snapshot(conn, window_start=int(start), window_seconds=window,
                                                   heartbeat_timeout_s=settings.heartbeat_timeout_seconds,
                                                   all_clients=all_clients)
    _fold_budget(ledger, read.budget)
    codes = _fold_platforms(ledger, read.platforms)
    ledger.platform_active = {(r.tenant_id, r.ai_platform_id): r.n for r in read.active if r.ai_platform_id is not None}
    overrides: dict[tuple[int, int], OverrideMode] = {
        (r.tenant_id, r.ai_platform_id): r.mode for r in read.overrides}
    ids_by_code = {code: pid for pid, code in codes.items()}
    clients = [_client_state(r, ids_by_code, overrides) for r in read.clients]
    pauses = health_pauses(read.health_pauses, overrides, ids_by_code)
    ledger.paused_pairs = frozenset(pauses)
    return Snapshot(now=now, window_start=start, window_seconds=window, ledger=ledger, clients=clients,
                    platform_codes=codes, platform_pauses=pauses, overrides=overrides,
                    client_tenants=None if all_clients else set())


def health_pauses(read: Sequence[dispatch_reads.HealthPause], overrides: dict[tuple[int, int], OverrideMode],
                  ids_by_code: dict[str, int]) -> dict[tuple[int, int], PauseSource]:
    """The pauses `paused_pairs` finds over every eligible client, from the (tenant, platform code) pairs every
    eligible client of the tenant blocks (the store's read of the blocking clients only, migration 070): one
    `ClientHealth` per tenant, blocking those platforms, stands for its clients; unknown codes block nothing; the
    overrides apply as there."""
    by_tenant: dict[int, set[int]] = defaultdict(set)
    for p in read:
        if p.code in ids_by_code:
            by_tenant[p.tenant_id].add(ids_by_code[p.code])
    return paused_pairs((ClientHealth(uuid.UUID(int=0), t, frozenset(b)) for t, b in by_tenant.items()), overrides,
                        sorted({pid for b in by_tenant.values() for pid in b}))


def _client_state(r: dispatch_reads.ClientLoad, ids_by_code: dict[str, int],
                  overrides: dict[tuple[int, int], OverrideMode]) -> ClientState:
    ignored = [pid for (tenant, pid), mode in overrides.items() if tenant == r.tenant_id and mode == "ignore_health"]
    return ClientState(id=r.id, tenant_id=r.tenant_id, workspace_id=r.workspace_id,
                       max_concurrent=r.max_concurrent_monitor, max_queue_depth=r.max_queue_depth,
                       in_progress=r.in_progress, queued=r.queued, pending_high=r.pending_high,
                       interrupt_overdue=r.interrupt_overdue, interrupt_generation=r.interrupt_generation,
                       blocked_platforms=blocked_platforms(r.platform_health, ids_by_code, ignored=ignored))


def _fold_budget(ledger: Ledger, rows: list[dispatch_reads.BudgetUse]) -> None:
    """The window's use into the ledger: per tenant (each row also counts against the cluster budget) or the totals
    (`tenant_id` None: a full pass's snapshot, whose `WindowClients` adds its tenants' own, `_fold_tenant_budget`)."""
    for r in rows:
        ledger.cluster_used += r.n
        if not r.high:
            ledger.non_high_used += r.n
    _fold_tenant_budget(ledger, rows)


def _fold_tenant_budget(ledger: Ledger, rows: list[dispatch_reads.BudgetUse]) -> None:
    """Some tenants' use (read with their clients, after the snapshot's totals): their own budgets only."""
    for r in rows:
        if r.tenant_id is not None and not r.high:
            ledger.tenant_used[r.tenant_id] = ledger.tenant_used.get(r.tenant_id, 0) + r.n


def _fold_platforms(ledger: Ledger, rows: list[PlatformSetting]) -> dict[int, str]:
    codes: dict[int, str] = {}
    paused: set[int] = set()
    for r in rows:
        codes[r.ai_platform_id] = r.code
        ledger.platform_limit[r.ai_platform_id] = r.max_concurrent
        if r.paused or not r.enabled:
            paused.add(r.ai_platform_id)
    ledger.paused_platforms = frozenset(paused)
    return codes


def _high_snapshot(read: HighRead, window: int) -> Snapshot:
    """The high pass's snapshot, as a pass's."""
    row = read.snapshot
    ledger = Ledger()
    _fold_platforms(ledger, row.platforms)
    ledger.cluster_used, ledger.non_high_used = row.cluster_used, row.non_high_used
    ledger.platform_active = {(r.tenant_id, r.ai_platform_id): r.n for r in row.active
                              if r.ai_platform_id is not None}
    clients = [ClientState(id=c.id, tenant_id=c.tenant_id, workspace_id=c.workspace_id,
                           max_concurrent=c.max_concurrent_monitor, max_queue_depth=c.max_queue_depth,
                           in_progress=c.in_progress, queued=c.queued, interrupt_generation=c.interrupt_generation)
               for c in row.clients]
    return Snapshot(now=row.now, window_start=row.window_start, window_seconds=window, ledger=ledger,
                    clients=clients)


def _candidate(r: CandidateRow) -> Candidate:
    return Candidate(id=r.id, tenant_id=r.tenant_id, workspace_id=r.workspace_id, ai_platform_id=r.ai_platform_id,
                     lane=r.lane, priority=r.priority, enqueued_at=r.enqueued_at, target_client_id=r.target_client_id)


class WindowClients:
    """The clients a full pass reads: those of the tenants its candidate reads reach, added to its snapshot as it goes
    (docs/architecture.md "Full pass: clients of the window"). Every eligible client of a tenant is read at once, so
    what the planner decides for a tenant (its clients' room, `normal_client_room`; the client an unbound task goes
    to) is what it decided over the whole fleet; a task bound to a client of another tenant has that client read by
    id (`cover_bound`)."""

    def __init__(self, conn: Conn, snap: Snapshot, settings: DispatchSettings, reads: ClientReads) -> None:
        assert snap.client_tenants is not None
        self._conn = conn
        self._snap = snap
        self._tenants = snap.client_tenants
        self._ids_by_code = {code: pid for pid, code in snap.platform_codes.items()}
        self._heartbeat_timeout_s = settings.heartbeat_timeout_seconds
        self._reads = reads
        self._known = {c.id for c in snap.clients}
        self.room: dict[int, int] = {}  # normal_client_room over the tenants read
        self.refused: dict[int, RejectReason] = {}

    async def cover(self, tenants: Iterable[int]) -> None:
        """Read the clients of those of `tenants` not read yet (one statement, none when all were)."""
        missing = set(tenants) - self._tenants
        if missing:
            self._add(await self._read(tenants=missing), missing)

    async def cover_bound(self, candidates: Iterable[Candidate]) -> None:
        """Read the clients bound candidates name that are not read yet (one statement, none when all were): a client
        of another tenant than its task's, or one that is not eligible (read again, found not eligible again: a bound
        task names its client, whatever its tenant, and the read of every client found it)."""
        ids = {c.target_client_id for c in candidates if c.target_client_id is not None
               and c.target_client_id not in self._known}
        if ids:
            self._add(await self._read(ids=ids), set())

    async def _read(self, *, tenants: Iterable[int] = (), ids: Iterable[uuid.UUID] = ()) -> list[ClientState]:
        tenants = list(tenants)
        read = await dispatch_reads.clients_of(self._conn, tenants=tenants, ids=list(ids),
                                               heartbeat_timeout_s=self._heartbeat_timeout_s,
                                               window_start=int(self._snap.window_start),
                                               window_seconds=self._snap.window_seconds)
        # The tenants' budget use, read with their clients: the snapshot has the window's totals only.
        _fold_tenant_budget(self._snap.ledger, read.budget)
        self._reads.statements += 1
        self._reads.rows += len(read.clients)
        self._reads.budget_rows += len(read.budget)
        return [_client_state(r, self._ids_by_code, self._snap.overrides) for r in read.clients
                if r.id not in self._known]

    def _add(self, clients: list[ClientState], tenants: set[int]) -> None:
        self._snap.clients.extend(clients)
        self._known.update(c.id for c in clients)
        self._tenants |= tenants
        room, refused = normal_client_room([c for c in clients if c.tenant_id in tenants])
        self.room.update(room)
        self.refused.update(refused)


class Dispatcher:
    """One dispatch pass at a time, high-only or full. Stateful across passes only for fairness rotation
    (`last_served`), the pending-pair cache (`pending`), the relay of its high events (`high_relay`) and write
    statistics.

    `clock` dates the pending pairs' reads and the write statistics; `candidate_chunk_rows` is how many rows one
    statement of a full pass's candidate read asks for (between two, the pass may yield to a click)."""

    def __init__(self, pool: AsyncConnectionPool[Conn], *, relay: OutboxRelay | None = None,
                 relay_lease_seconds: float = 5.0, clock: Clock = SYSTEM_CLOCK,
                 candidate_chunk_rows: int = CANDIDATE_CHUNK_ROWS, push_leases: PushLeaseIssuer | None = None) -> None:
        self._pool = pool
        self.push_leases = push_leases  # leases at dispatch for push clients (libs/tasks/push_leases.py)
        self._clock = clock
        self._chunk_rows = candidate_chunk_rows
        self.high_relay = HighRelay(relay, lease_seconds=relay_lease_seconds)
        self.last_served: dict[str, int] = {}
        self.pending = PendingPairs(pool, clock=clock)
        self.write_stats = WriteStats()
        self.slowdown = False
        # Refreshed by the maintenance loop: ready backlog, for the retry low-water rule.
        self.cluster_high_backlog = 0
        self.tenant_normal_backlog: dict[int, int] = {}
        self.passes = 0
        # Set by the coordinator: is high work waiting for a high-only pass? A full pass that has not
        # written yet then yields to it (collect-now latency must not wait for a batch of normal writes).
        self.high_waiting: Callable[[], bool] | None = None
        self._preempted_in_a_row = 0
        self._pause_labels: set[tuple[str, str, str]] = set()  # monitor_tenant_platform_paused series
        # (window length, window start) the budget ledger was last checked for (see `_ensure_ledger`).
        self._ledger_window: tuple[int, float] = (0, 0.0)
        # Per lane, the last (tenant, platform) a full pass read candidates of: the next pass reads on from there
        # (`read_candidates`, libs.domain.dispatch.pair_read_window).
        self._read_after: dict[str, tuple[int, int] | None] = {}
        self.candidate_reads = CandidateReads()  # what the last full pass's candidate read cost (the benchmark's)
        self.client_reads = ClientReads()  # and its reads of the clients

    @property
    def pairs(self) -> AbstractSet[tuple[int, int]]:
        """Every (tenant, platform) with a pending task (services/dispatch_coordinator/pending_pairs.py)."""
        return self.pending.pairs

    @property
    def pairs_read_at(self) -> float:
        """Monotonic time of the last read of the pending pairs (0 before the first)."""
        return self.pending.read_at

    @property
    def ledger_window(self) -> tuple[int, float]:
        """(window length, window start) the budget ledger was last checked for; (0, 0.0) before the first full
        pass."""
        return self._ledger_window

    def has_pending(self, tenant_id: int) -> bool:
        """Does `pairs` list the tenant?"""
        return self.pending.has_pending(tenant_id)

    def add_pairs(self, pairs: Sequence[tuple[int, int]]) -> None:
        """New work the scanner just created (so the pass need not wait for the next pair refresh)."""
        self.pending.add(pairs)

    async def _ensure_ledger(self, conn: Conn, window: int) -> None:
        """Once a window, before a full pass: the budget ledger (migration 021) counts this window length (else it is
        started: one count of the executions from the current window on, under the pass lock and the ledger's lock),
        and windows over an hour old are pruned. Until it runs the passes count instead (BUDGET_USE), so the budget
        read is exact either way; a zombie ex-leader with another window length restarts it for its own, which this
        undoes at its next window."""
        async with conn.transaction():
            await conn.execute(q.PASS_LOCK)
            cur = await conn.execute(q.NOW)
            row = await cur.fetchone()
            assert row is not None
            start = int(window_start(float(row["now"]), window))
            cur = await conn.execute(q.LEDGER_TRACKING)
            tracking = {r["window_seconds"]: r["since_window_start"] for r in await cur.fetchall()}
            params = {"window": window, "window_start": start}
            if len(tracking) != 1 or tracking.get(window, start + 1) > start:
                await conn.execute(q.LEDGER_LOCK)
                for statement in (q.LEDGER_FORGET, q.LEDGER_CLEAR, q.LEDGER_TRACK, q.LEDGER_START):
                    await conn.execute(statement, params)
                log.info("budget ledger started", extra={"window_seconds": window, "window_start": start})
            await conn.execute(q.LEDGER_PRUNE, params)
        self._ledger_window = (window, start)

    async def read_candidates(self, conn: Conn, snap: Snapshot, limits: PassLimits, settings: DispatchSettings,
                              blocked: Counter[str] | None = None) -> dict[str, list[Candidate]]:
        """Ready candidates per lane (a full pass's read, on `conn`, for the pending pairs), and into `snap.clients`
        the clients of the tenants they are of (when `snap` was read without them: `WindowClients`). Pairs whose
        tenant has no client able to take non-high work are not read at all (their rejection is counted once per pair
        in `blocked`). Read in chunks of about `candidate_chunk_rows` rows; before each chunk after the first it
        raises Preempted when the pass should yield to waiting high work (see `_yield_to_high`)."""
        batch = max(1, settings.dispatch_batch_size)
        found: dict[str, list[Candidate]] = defaultdict(list)
        self.candidate_reads = CandidateReads()
        self.client_reads = ClientReads()
        window_clients = WindowClients(conn, snap, settings, self.client_reads) if snap.client_tenants is not None \
            else None
        if CLICK_LANE.name not in limits.paused_lanes:
            found[CLICK_LANE.name].extend(
                _candidate(r) for r in await dispatch_reads.high_candidates(conn, limit=batch))
        if window_clients is not None:
            await window_clients.cover(c.tenant_id for c in found[CLICK_LANE.name])
            client_room, refused = window_clients.room, window_clients.refused
        else:
            client_room, refused = normal_client_room(snap.clients)
        if limits.slowdown or snap.ledger.non_high_used >= limits.non_high_cap:
            if window_clients is not None:
                await window_clients.cover_bound(found[CLICK_LANE.name])
            return found  # non-high cannot go this pass: no need to read its candidates
        lanes = [lane for lane in LANE_ORDER if lane != CLICK_LANE.name and lane not in limits.paused_lanes]
        seen: set[tuple[int, int]] = set()  # pairs whose blocked reason this pass already counted

        def pair_k(lane: str, tenant_id: int, platform_id: int) -> int:
            """How many candidates of this pair and lane the pass could use (0: none; a blocked pair's reason counted
            once a pass)."""
            room = snap.ledger.platform_room(tenant_id, platform_id)
            tenant_room = limits.tenant_per_window - snap.ledger.tenant_used.get(tenant_id, 0)
            first = (tenant_id, platform_id) not in seen
            seen.add((tenant_id, platform_id))
            if platform_id in snap.ledger.paused_platforms:
                return 0
            if (tenant_id, platform_id) in snap.ledger.paused_pairs:
                if blocked is not None and first:
                    blocked["tenant_platform_paused"] += 1
                return 0
            if client_room.get(tenant_id, 0) <= 0:
                if blocked is not None and first and tenant_room > 0 and room > 0:
                    blocked[refused.get(tenant_id, "no_eligible_client")] += 1
                return 0
            if monitor_lane(lane).retry_gated and not retry_allowed(
                    tenant_id, cluster_high_backlog=self.cluster_high_backlog,
                    tenant_normal_backlog=self.tenant_normal_backlog, watermark=limits.retry_low_watermark):
                return 0
            return pair_fetch_limit(room, tenant_room, lane=lane, cap=min(PER_PAIR_CAP, batch),
                                    client_room=client_room[tenant_id])

        # Candidate rows in lane order, bounded by what the pass may still dispatch: each lane reads windows of its
        # pairs (those with work in the lane) after the ones the last pass read (libs.domain.dispatch.pair_read_window),
        # at most WINDOWS_PER_LANE of them while the rows found fall short of the budget (pairs without room), each
        # visiting at most VISITS_PER_ROW pairs per budget row (pairs without room are skipped, not read).
        # Not less for the high candidates found: while high has work, normal keeps its background share of the
        # window, which the planner can only give when normal candidates were read.
        budget_rows = CANDIDATE_ROWS_PER_DISPATCH * batch
        reads = 0
        for lane in lanes:
            pairs = self.pending.sorted_lane_pairs(lane)
            visited = 0
            for _ in range(WINDOWS_PER_LANE):
                if budget_rows <= 0 or visited >= len(pairs):
                    break
                window, n = await self._pair_window(pairs, lane, budget_rows, functools.partial(pair_k, lane),
                                                    min(len(pairs) - visited, VISITS_PER_ROW * budget_rows),
                                                    window_clients)
                visited += n
                if not window:
                    continue
                before = len(found[lane])
                if reads:
                    self._yield_to_high()  # between two reads, as between the chunks of one
                reads += 1
                await self._read_pairs(conn, [r.tenant_id for r in window], [r.ai_platform_id for r in window],
                                       [lane] * len(window), [r.k for r in window], found)
                budget_rows -= len(found[lane]) - before
        if window_clients is not None:
            await window_clients.cover_bound(c for tasks in found.values() for c in tasks)
        return found

    async def _pair_window(self, pairs: list[tuple[int, int]], lane: str, budget_rows: int,
                           k_of: Callable[[int, int], int], max_visits: int,
                           window_clients: WindowClients | None) -> tuple[list[PairRead], int]:
        """The lane's next window of pairs (`pair_read_window`, moving the lane's cursor) and how many pairs it visited.
        With `window_clients`, walked in stretches, the clients of a stretch's tenants read before it is walked (what
        `k_of` asks of them): a stretch of the pairs the rows still wanted would fill at the window's share each,
        each at least twice the last, so the clients read follow the window, not the fleet; the stretches pick what one
        walk would have."""
        after = self._read_after.get(lane)
        if window_clients is None:
            whole, self._read_after[lane], n = pair_read_window(pairs, after, budget_rows, k_of, max_visits=max_visits)
            return whole, n
        share = pair_window_share(budget_rows, len(pairs))
        window: list[PairRead] = []
        visited = rows = stretch = 0
        while visited < max_visits and rows < budget_rows:
            # Twice the last stretch at least: when its pairs had less room than the share (tenants without an
            # eligible client), the pairs still to visit take a few statements, not one per stretch.
            if visited:
                self._yield_to_high()  # between two reads of the clients, as between two of the candidates
            stretch = min(max_visits - visited,
                          max(MIN_STRETCH_PAIRS, math.ceil((budget_rows - rows) / share), 2 * stretch))
            await window_clients.cover(t for t, _ in pairs_after(pairs, after, stretch))
            part, after, n = pair_read_window(pairs, after, budget_rows - rows, k_of, max_visits=stretch, share=share)
            window.extend(part)
            rows += sum(r.k for r in part)
            visited += n
        self._read_after[lane] = after
        return window, visited

    async def _read_pairs(self, conn: Conn, tenants: list[int], platforms: list[int], lanes: list[str],
                          ks: list[int], found: dict[str, list[Candidate]]) -> None:
        """The candidates of each (tenant, platform, lane) up to its k, in chunks of about `candidate_chunk_rows`
        rows, yielding to a click between them: under the benchmark's load one read of every pair took ~20 ms (up
        to 50), all of it a click's wait."""
        start = 0
        while start < len(tenants):
            end, wanted = start, 0
            while end < len(tenants) and (end == start or wanted + ks[end] <= self._chunk_rows):
                wanted += ks[end]
                end += 1
            if start:
                self._yield_to_high()
            rows = await dispatch_reads.pair_candidates(conn, tenants=tenants[start:end],
                                                        platforms=platforms[start:end], lanes=lanes[start:end],
                                                        limits=ks[start:end])
            for r in rows:
                found[r.lane].append(_candidate(r))
            self.candidate_reads.statements += 1
            self.candidate_reads.pairs += end - start
            self.candidate_reads.rows += len(rows)
            start = end

    def _report_pauses(self, snap: Snapshot) -> None:
        """`monitor_tenant_platform_paused`, and one log line when a pause starts or ends."""
        current = {(str(t), snap.platform_codes.get(p, str(p)), source): (t, p)
                   for (t, p), source in snap.platform_pauses.items()}
        for labels in self._pause_labels - set(current):
            metrics.monitor_tenant_platform_paused.remove(*labels)
            log.info("platform-health pause ended", extra={"tenant_id": labels[0], "platform": labels[1],
                                                           "source": labels[2]})
        for labels in set(current) - self._pause_labels:
            log.warning("platform-health pause: the tenant's scheduled work of this platform is held",
                        extra={"tenant_id": labels[0], "platform": labels[1], "source": labels[2]})
        for labels in current:
            metrics.monitor_tenant_platform_paused.labels(*labels).set(1)
        self._pause_labels = set(current)

    @tracing.traced("dispatch.high_pass", root=True)
    async def run_high_pass(self, settings: DispatchSettings) -> PassOutcome:
        """Dispatch ready HIGH work only, in its own short transaction (collect-now latency).

        Runs before the full pass when a collect-now woke the coordinator, so the click does not wait for a
        pass that also plans and writes a batch of normal work. Same rules as the full pass (same pass
        lock, so the budgets read are the budgets spent): cluster budget with the normal guarantee held
        back whenever normal work may be pending (conservative: what this pass leaves, the full pass that
        follows re-decides with the real normal candidates), client concurrency, platform concurrency per
        (tenant, platform), and the write-time re-check of every task (CLAIM). Rejections are counted by
        the full pass only.
        """
        outcome = PassOutcome()
        limits = limits_from(settings, slowdown=self.slowdown)
        if CLICK_LANE.name in limits.paused_lanes:
            return outcome
        batch = max(1, settings.dispatch_batch_size)
        started_at = time.time()  # wall clock, logged with the commit (a click's hops: docs/benchmarks.md)
        async with self._pool.connection() as conn:
            timing = _WriteTiming()
            try:
                # Two round trips in all: BEGIN + the locks + the reads; the writes + COMMIT (queued in the
                # pipeline and sent together when it ends).
                async with pipelined_transaction(conn):
                    read = await self._read_high(conn, settings, batch)
                    if read is None:
                        return outcome
                    plan, written = await self._write_high(conn, read, limits, batch, outcome, timing)
                if written is not None:
                    committed_at = time.time()
                    await self._after_commit(written)
                    outcome.dispatched = outcome.high_dispatched = len(written.rows)
                    tracing.set_attributes(dispatched=outcome.dispatched)
                    log.info("high pass committed", extra={
                        "task_ids": [str(r["id"]) for r in written.rows], "pass_started_at": started_at,
                        "committed_at": committed_at})
            except CONFLICT_ERRORS as exc:
                self._record_write(timing, conflicted=True)
                log.warning("high dispatch pass hit a write conflict; the full pass redoes it",
                            extra={"error": str(exc)[:300]})
                outcome.conflicted = True
                return outcome
            self._record_write(timing, conflicted=False)
        self.last_served.update(plan.last_served)
        return outcome

    async def _read_high(self, conn: Conn, settings: DispatchSettings, batch: int) -> _HighRead | None:
        """The high pass's locks and reads, one round trip: the pass lock, the clients bound to ready high work
        (locked), the high candidates (locked) and the snapshot. None: no ready high work."""
        window = max(1, settings.budget_window_seconds)
        await conn.execute(q.PASS_LOCK)
        await conn.execute(q.ASYNC_COMMIT)
        read = await dispatch_reads.read_high_pass(conn, limit=batch, window_seconds=window,
                                                   heartbeat_timeout_s=settings.heartbeat_timeout_seconds)
        if read is None:
            return None
        return _HighRead(read, _high_snapshot(read, window))

    async def _write_high(self, conn: Conn, read: _HighRead, limits: PassLimits, batch: int, outcome: PassOutcome,
                          timing: _WriteTiming) -> tuple[PassResult, _Written | None]:
        """Plan the high candidates and queue the writes of what the plan dispatches (inside the caller's pipelined
        transaction)."""
        candidates = [_candidate(r) for r in read.read.candidates]
        outcome.considered = len(candidates)
        tracing.set_attributes(considered=outcome.considered)
        snapshot = read.snapshot
        plan = plan_pass({CLICK_LANE.name: candidates}, snapshot.clients, snapshot.ledger, limits,
                         last_served=self.last_served, max_dispatches=batch, normal_has_work=bool(self.pairs))
        outcome.seconds_to_next_window = snapshot.window_start + snapshot.window_seconds - snapshot.now
        if not plan.decisions:
            return plan, None
        # Stamped with the snapshot's clock: the window whose budget was read (under the pass lock).
        timing.started = time.perf_counter()
        if all(d.client_id in read.read.locked_clients for d in plan.decisions):
            # Clients and tasks were locked by the reads: nothing to re-check.
            rows = _dispatchable_rows(plan.decisions, read.read.tasks, frozenset())
        else:  # an unbound task went to a client not locked above: the full re-check
            rows = await self._claim(conn, plan)
        return plan, (await self._queue_writes(conn, rows, read.read.snapshot.ts) if rows else None)

    def _record_write(self, timing: _WriteTiming, *, conflicted: bool) -> None:
        """The pass's write latency (and whether it conflicted) for the auto slow-down's statistics; nothing when it
        did not write (a conflict before writing counts as one, with no latency)."""
        if timing.started:
            self.write_stats.record(self._clock.monotonic(), (time.perf_counter() - timing.started) * 1000,
                                    conflicted)
        elif conflicted:
            self.write_stats.record(self._clock.monotonic(), 0.0, True)

    @tracing.traced("dispatch.full_pass", root=True)
    async def run_pass(self, settings: DispatchSettings) -> PassOutcome:
        for _ in range(3):
            try:
                return await self._run_pass(settings)
            except WindowRolledOver:
                continue
        return PassOutcome()

    async def _run_pass(self, settings: DispatchSettings) -> PassOutcome:
        outcome = PassOutcome()
        limits = limits_from(settings, slowdown=self.slowdown)
        async with self._pool.connection() as conn:
            await self._before_pass(conn, settings)
            timing = _WriteTiming()
            try:
                async with pipelined_transaction(conn):
                    plan, written = await self._plan_and_write(conn, settings, limits, outcome, timing)
                if written is not None:
                    await self._after_commit(written)
                    outcome.dispatched = len(written.rows)
                    tracing.set_attributes(considered=outcome.considered, dispatched=outcome.dispatched)
                    outcome.high_dispatched = sum(1 for r in written.rows if r["lane"] == CLICK_LANE.name)
            except Preempted:
                outcome.preempted = True
                return outcome
            except CONFLICT_ERRORS as exc:
                self._record_write(timing, conflicted=True)
                log.warning("dispatch pass hit a write conflict; redoing it", extra={"error": str(exc)[:300]})
                outcome.conflicted = True
                return outcome
            self._record_write(timing, conflicted=False)
        self.passes += 1
        self._preempted_in_a_row = 0  # this pass ran to its end: the next one may yield again
        self.last_served.update(plan.last_served)
        for reason, n in plan.rejections.items():
            metrics.monitor_dispatch_reject_by_reason_count.inc(n, reason=reason)
        outcome.rejections = dict(plan.rejections)
        outcome.cluster_exhausted = plan.cluster_exhausted
        outcome.full_batch = len(plan.decisions) >= max(1, settings.dispatch_batch_size)
        if outcome.dispatched:
            log.debug("dispatched", extra={"count": outcome.dispatched, "high": outcome.high_dispatched})
        return outcome

    async def _before_pass(self, conn: Conn, settings: DispatchSettings) -> None:
        """A full pass's preparations outside its transaction: the pending pairs (read now for the first pass,
        refreshed in the background when stale) and, once a window, the budget ledger."""
        if not self.pending.read_at:
            await self.pending.refresh(conn)  # the first pass has none to go on with
        elif self.pending.stale:
            self.pending.refresh_in_background()
        window = max(1, settings.budget_window_seconds)
        if self._ledger_window[0] != window or time.time() >= self._ledger_window[1] + window:
            try:
                await self._ensure_ledger(conn, window)
            except CONFLICT_ERRORS as exc:  # e.g. a lock timeout: this pass counts; the next one tries again
                log.warning("starting the budget ledger failed", extra={"error": str(exc)[:300]})

    async def _plan_and_write(self, conn: Conn, settings: DispatchSettings, limits: PassLimits, outcome: PassOutcome,
                              timing: _WriteTiming) -> tuple[PassResult, _Written | None]:
        """Inside the pass's transaction, under the pass lock: the snapshot, the candidates, the plan, and (in the
        window that was read, else WindowRolledOver) its writes. Yields to waiting high work between the reads."""
        await conn.execute(q.PASS_LOCK)
        snap = await read_snapshot(conn, settings, all_clients=False)
        self._report_pauses(snap)
        self._yield_to_high()
        blocked: Counter[str] = Counter()
        candidates = await self.read_candidates(conn, snap, limits, settings, blocked)
        self._yield_to_high()
        outcome.considered = sum(len(v) for v in candidates.values())
        plan = plan_pass(candidates, snap.clients, snap.ledger, limits, last_served=self.last_served,
                         cluster_high_backlog=self.cluster_high_backlog,
                         tenant_normal_backlog=self.tenant_normal_backlog,
                         max_dispatches=max(1, settings.dispatch_batch_size))
        await self._read_other_budgets(conn, snap, limits, candidates)
        self._count_blocked_without_candidates(plan, snap, limits, candidates)
        plan.rejections.update(blocked)
        outcome.seconds_to_next_window = snap.window_start + snap.window_seconds - snap.now
        if not plan.decisions:
            return plan, None
        self._yield_to_high(plan)
        cur = await conn.execute(q.NOW)
        stamp = await cur.fetchone()
        assert stamp is not None
        if window_start(float(stamp["now"]), snap.window_seconds) != snap.window_start:
            raise WindowRolledOver
        timing.started = time.perf_counter()
        return plan, await self._write(conn, plan, stamp["ts"])

    def _yield_to_high(self, plan: PassResult | None = None) -> None:
        """Raise Preempted (the caller's transaction rolls back, before any write) when the waiting high-only
        pass should go first: high work is waiting, this pass is not writing only high work, and it has not
        yielded MAX_PREEMPTIONS times in a row (a stream of clicks cannot starve the normal lanes)."""
        if self.high_waiting is None or not self.high_waiting() or self._preempted_in_a_row >= MAX_PREEMPTIONS:
            return
        if plan is not None and all(d.task.lane == CLICK_LANE.name for d in plan.decisions):
            return  # nothing but high to write: writing it is the fastest way
        self._preempted_in_a_row += 1
        raise Preempted

    async def _read_other_budgets(self, conn: Conn, snap: Snapshot, limits: PassLimits,
                                  candidates: dict[str, list[Candidate]]) -> None:
        """When `_count_blocked_without_candidates` will tell a spent tenant budget from a full platform over every
        pending pair: the budget use of the tenants the pass's reads did not reach (its snapshot read the window's
        totals, `WindowClients` its tenants' use). Every tenant's, as the snapshot read it before; only in a pass that
        read no non-high candidate."""
        if snap.client_tenants is None or not self.pairs or limits.slowdown \
                or snap.ledger.non_high_used >= limits.non_high_cap \
                or any(candidates.get(lane) for lane in LANE_ORDER if lane != CLICK_LANE.name):
            return
        used: dict[int, int] = defaultdict(int)
        for r in await dispatch_reads.budget_use(conn, window_start=int(snap.window_start),
                                                 window_seconds=snap.window_seconds):
            if r.tenant_id is not None and not r.high and r.tenant_id not in snap.client_tenants:
                used[r.tenant_id] += r.n
        snap.ledger.tenant_used.update(used)

    def _count_blocked_without_candidates(self, plan: PassResult, snap: Snapshot, limits: PassLimits,
                                          candidates: dict[str, list[Candidate]]) -> None:
        """Work the pass did not even read (no platform room, slow-down, spent budget) is still a rejection:
        counted once per blocked (tenant, platform) pair and pass, not once per waiting task."""
        if any(candidates.get(lane) for lane in LANE_ORDER if lane != CLICK_LANE.name):
            return
        if not self.pairs:
            return
        if limits.slowdown:
            plan.rejections["auto_slowdown"] += 1
            return
        if snap.ledger.non_high_used >= limits.non_high_cap:
            plan.rejections["cluster_budget"] += 1
            plan.cluster_exhausted = True
            return
        for tenant_id, platform_id in self.pairs:
            if self.tenant_normal_backlog and self.tenant_normal_backlog.get(tenant_id, 0) <= 0:
                continue
            if snap.ledger.tenant_used.get(tenant_id, 0) >= limits.tenant_per_window:
                plan.rejections["tenant_budget"] += 1
            elif snap.ledger.platform_room(tenant_id, platform_id) <= 0:
                plan.rejections["platform_concurrency"] += 1

    async def _write(self, conn: Conn, plan: PassResult, ts: datetime) -> _Written | None:
        """Claim re-check, then the writes (inside the caller's pipelined transaction: they are queued and go out
        with its COMMIT, as the high pass's do; the caller calls `_after_commit` once it committed)."""
        rows = await self._claim(conn, plan)
        if not rows:
            return None
        self._yield_to_high(plan)  # the claim took a round trip: a click may have arrived meanwhile
        return await self._queue_writes(conn, rows, ts)

    async def _claim(self, conn: Conn, plan: PassResult) -> list[dict[str, Any]]:
        """Lock the clients, claim the decided tasks and re-check each (one round trip); the rows to write."""
        decisions = plan.decisions
        claimed = await dispatch_reads.claim(
            conn, client_ids=sorted({d.client_id for d in decisions}, key=str),
            task_ids=[d.task.id for d in decisions],
            normal_clients=sorted({d.client_id for d in decisions if not monitor_lane(d.task.lane).preempts},
                                  key=str))
        return _dispatchable_rows(decisions, claimed.tasks, claimed.clients_with_high)

    async def _queue_writes(self, conn: Conn, rows: list[dict[str, Any]], ts: datetime) -> _Written:
        """Queue the writes of claimed rows in the caller's pipeline: executions, attempts, outbox events
        (NOTIFY when high work is among them), collect-request counters. Nothing is read back here: the
        caller commits and then calls `_after_commit`."""
        clicks = _click_spans(rows)
        events = [
            OutboxEvent(
                exchange=DISPATCH, routing_key=routing_key(r["lane"], r["target_client_id"]),
                message=TaskAvailable(kind="monitor", task_id=r["id"], target_client_id=r["target_client_id"],
                                      priority=r["priority"], lane=r["lane"],
                                      scheduler_group_key=r["scheduler_group_key"],
                                      business_date=r["business_date"],
                                      interrupt_generation=r["interrupt_generation"], updated_at=ts,
                                      monitor_task_id=r["monitor_task_id"],
                                      collect_request_id=r["collect_request_id"]),
                ordering_key=f"client:{r['target_client_id']}", tenant_id=r["tenant_id"],
                priority=monitor_lane(r["lane"]).outbox_priority,  # high: claimed before older normal events
                traceparent=tracing.traceparent_of(clicks.get(r["collect_traceparent"] or "")))
            for r in rows
        ]
        requests: dict[uuid.UUID, int] = defaultdict(int)
        for r in rows:
            if r["lane"] == CLICK_LANE.name and r["collect_request_id"] is not None:
                requests[r["collect_request_id"]] += 1
        refs = [r["row_ref"] for r in rows]
        await business.count_dispatched(conn, refs)
        # Routed by owner (docs/legacy-path.md): an execution for desktop_tasks work, an offer on the business row
        # for legacy work; the same event tells the client either way.
        created = await execution_paths.dispatch(conn, rows, ts=ts)
        if self.push_leases is not None and created.get("desktop_tasks"):
            # a round trip: the leases go on the events (libs/tasks/push_leases.py: the desktop_tasks path's)
            events = await self.push_leases.lease_created(conn, created["desktop_tasks"], events)
        high = any(monitor_lane(r["lane"]).outbox_priority > 0 for r in rows)
        relay = self.high_relay.ready() if high else None
        event_ids = await enqueue_many(conn, events, notify=high and relay is None)
        own = None
        if relay is not None:  # claim the high events for this process (the rest, if any, wake the pumps)
            own = await claim_own(conn, [i for i, e in zip(event_ids, events, strict=True) if e.priority > 0],
                                  claimed_by=relay.claimed_by, lease_seconds=self.high_relay.lease_seconds)
        marked = await dispatch_reads.mark_requests_dispatched(conn, requests) if requests else None
        return _Written(rows, marked, own, list(clicks.values()))

    async def drain_relays(self, timeout: float) -> None:
        """Let in-flight relays finish (shutdown): what is not published by then is left to the pumps. A re-read of
        the pairs in flight is let finish too (it holds a pool connection)."""
        refreshing = self.pending.refreshing
        pending = {*self.high_relay.in_flight, *([refreshing] if refreshing is not None else [])}
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def _after_commit(self, written: _Written) -> None:
        """Once the writes committed: start publishing what this pass claimed for itself, then first-dispatch
        latencies, metrics, logs."""
        for span in written.click_spans:
            span.end()
        await self.high_relay.publish_committed(written.own)
        if written.requests is not None:
            for first in await written.requests.fetch():
                if first.first:
                    metrics.collect_now_first_dispatch_latency_ms.observe(max(0.0, first.latency_ms))
        rows = written.rows
        for r in rows:
            metrics.dispatch_decisions_count.inc(lane=r["lane"])
            metrics.dispatch_dispatched_by_owner_count.inc(execution_owner=r["execution_owner"])
            if r["lane"] == CLICK_LANE.name:
                log.info("high task dispatched", extra={
                    "tenant_id": r["tenant_id"], "task_id": str(r["id"]), "monitor_task_id": r["monitor_task_id"],
                    "client_id": str(r["target_client_id"]),
                    "collect_request_id": str(r["collect_request_id"]) if r["collect_request_id"] else None})


@dataclass(slots=True)
class _WriteTiming:
    """When a pass started writing (perf_counter; 0: it has not)."""

    started: float = 0.0


@dataclass(frozen=True, slots=True)
class _HighRead:
    """What the high pass read (its locked candidates, the clients locked with them, its snapshot) and that snapshot
    as a pass's."""

    read: HighRead
    snapshot: Snapshot


@dataclass(frozen=True, slots=True)
class _Written:
    rows: list[dict[str, Any]]
    requests: RequestsDispatched | None
    own: OwnClaim | None = None
    click_spans: list[Span] = field(default_factory=list)


def _click_spans(rows: list[dict[str, Any]]) -> dict[str, Span]:
    """Tracing: a span per collect-now these rows serve, keyed by the click's traceparent (stored in its request
    row: a NOTIFY, which woke the pass, carries no context). Each is a child of the click's span and links to
    the pass's (which links back): one pass may serve several clicks, each click's trace goes on through its
    own span, whose context the click's TaskAvailable events carry. Ended once the pass committed (a pass that
    rolls back exports none). Empty while tracing is off."""
    if not tracing.enabled():
        return {}
    served: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["collect_traceparent"]:
            served[r["collect_traceparent"]].append(r)
    spans: dict[str, Span] = {}
    for traceparent, click_rows in served.items():
        first = click_rows[0]
        click = tracing.context_from_traceparent(traceparent)
        span = tracing.start_span("dispatch.collect_request", parent=click, links=[tracing.current_link()],
                                  attributes={
                                      tracing.COLLECT_REQUEST_ID: first["collect_request_id"],
                                      tracing.TENANT_ID: first["tenant_id"],
                                      tracing.CLIENT_ID: first["target_client_id"],
                                      tracing.TASK_ID: first["id"] if len(click_rows) == 1 else None,
                                      tracing.EXECUTION_OWNER: tracing.execution_owners(
                                          r["execution_owner"] for r in click_rows),
                                      "monitoring.tasks": len(click_rows)})
        if span is not None:
            spans[traceparent] = span
            tracing.add_link(click)
    return spans


def _dispatchable_rows(decisions: Sequence[Decision], claimed: dict[int, ClaimedTask],
                       clients_with_high: frozenset[uuid.UUID]) -> list[dict[str, Any]]:
    """The execution rows to write: the decisions whose locked, re-read business task still allows them."""
    rows = [r for d in decisions if (r := _still_dispatchable(d, claimed.get(d.task.id), clients_with_high))]
    if len(rows) < len(decisions):
        log.info("some decided tasks changed before the write (e.g. promoted by collect-now); skipped",
                 extra={"decided": len(decisions), "written": len(rows)})
    for r in rows:
        r["row_ref"] = claimed[r["monitor_task_id"]].row_ref
    return rows


def _still_dispatchable(decision: Decision, task: ClaimedTask | None,
                        clients_with_high: frozenset[uuid.UUID]) -> dict[str, Any] | None:
    """The execution row for a decision whose business task, re-read locked at write time, still allows it.

    Not when it is no longer ready (CLAIM did not return it), changed lane or was bound to another
    client (a collect-now promoted it), or is non-high for a client that now has pending high work.
    """
    if task is None or task.dispatch_lane != decision.task.lane:
        return None
    if task.target_client_id is not None and task.target_client_id != decision.client_id:
        return None
    lane = task.dispatch_lane
    if not monitor_lane(lane).preempts and decision.client_id in clients_with_high:
        return None
    return {
        # an id decided ahead (a collect-now named it as the replacement of an interrupted execution) or a new one
        "id": task.next_execution_id or uuid.uuid4(), "monitor_task_id": task.id, "tenant_id": task.tenant_id,
        "workspace_id": task.workspace_id, "target_client_id": decision.client_id,
        "priority": task.dispatch_priority, "lane": lane, "lane_weight": lane_weight("monitor", lane),
        "source": execution_source(lane, from_click=task.trigger_source == "manual"
                                   or task.collect_request_id is not None),
        "scheduler_group_key": f"qid:{task.question_id}",
        "interrupt_generation": decision.interrupt_generation if monitor_lane(lane).preempts else 0,
        "enqueued_at": task.enqueued_at, "brand_id": task.brand_id, "question_id": task.question_id,
        "ai_platform_id": task.ai_platform_id, "business_date": task.business_date,
        "collect_request_id": task.collect_request_id,
        "collect_traceparent": task.collect_traceparent,
        "execution_owner": task.execution_owner,
    }


def is_transient(exc: BaseException) -> bool:
    """Database errors a loop survives (connection loss, pool timeout) rather than crashing the service."""
    from psycopg_pool import PoolTimeout

    return isinstance(exc, psycopg.OperationalError | PoolTimeout)
