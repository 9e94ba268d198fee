"""Budgeted dispatch (§9.2, §9.3): the decision tree, lane rules, client choice and tenant fairness.

Everything here is pure: the coordinator reads one snapshot per pass (budgets used in the current
window, online clients with their load, active executions per (tenant, platform)), asks `plan_pass`
what to dispatch, and writes the outcome in one transaction.

Decision tree, in order, for one task (a failure skips the task; §9.2):
  1. cluster budget of the window has room            (all lanes)
  2. tenant budget of the window has room             (not high)
  3. client in_progress monitor executions < max      (all lanes)
  4. client queued monitor executions < queue depth   (not high)
  5. active executions of (tenant, platform) < limit  (all lanes; aggregated across the tenant's clients)

Rejection matrix: budget (1, 2) -> the task waits for the next window; concurrency (3, 5) -> it waits
for a completion event; queue depth (4) -> an unbound task tries the next eligible client, a bound
one waits.

Budget accounting: an execution row counts against the window it was created in. High work counts
against the cluster budget only (it bypasses the tenant budget, so it also does not spend it). An
execution cancelled by collect-now while still queued gives its budget back (`dispatch_budget_counts`,
migration 021). The coordinator reads a window's use from the budget ledger the database keeps in the
transaction of every execution it counts (or counts it, until the ledger is started: queries.BUDGET_USE).

Lane quotas on top of the tree (§9.3 and an operator's headroom for collect-now):
- `high_reserved_share` of every window is kept for high: non-high lanes stop at
  `cluster * (1 - high_reserved_share)`, so a collect-now never waits for the next window because
  scheduled work spent the budget first.
- While high has ready work, normal keeps its background share: high may not spend the last
  `ceil(cluster * normal_background_share) - normal_used` slots of the window while normal lanes
  have ready work (10-20% normal background throughput, so scheduled work never starves).

Fairness across tenants (documented choice: round-robin, i.e. deficit round-robin with a quantum of
one task and equal weights). Within each lane, candidates are grouped by tenant, each tenant's list
kept in lane order (priority DESC, enqueued_at ASC), and the pass takes one task per tenant in turn.
The rotation resumes after the tenant served last in the previous pass, so when a budget runs out in
the middle of a round the same low-numbered tenants do not always win the last slots. Tasks are of
uniform cost, so counting tasks is the right deficit unit. Consequence: a tenant with 50,000 ready
tasks gets the same share of a window's budget as a tenant with 100, not 500 times more; cross-tenant
priority inside one lane is deliberately not honoured (lanes still are: high before boosted before
normal before retry). The per-tenant minute budget caps the big tenant on top of that.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal
from uuid import UUID

from libs.domain.lanes import SCHEDULED_LANE, lane_names, monitor_lane

# Lanes in dispatch order (lane_weight DESC), and the lane classes the rules below name (libs/domain/lanes.py).
LANE_ORDER: tuple[str, ...] = lane_names()
NORMAL_LANES: frozenset[str] = frozenset(lane_names(lambda s: s.normal_backlog))
# The lanes that must leave the budget-exempt ones the normal background share when they have work.
NON_EXEMPT_LANES: tuple[str, ...] = lane_names(lambda s: not s.budget_exempt)

RejectReason = Literal[
    "cluster_budget", "tenant_budget", "client_concurrency", "client_queue_depth", "platform_concurrency",
    "no_eligible_client", "client_has_high", "client_interrupt_overdue", "lane_paused", "auto_slowdown",
    "platform_paused", "retry_waits_for_low_water", "platform_unhealthy", "tenant_platform_paused",
]
# Reasons in decision-tree order (the five of §9.2), then the lane rules.
TREE_REASONS: tuple[RejectReason, ...] = (
    "cluster_budget", "tenant_budget", "client_concurrency", "client_queue_depth", "platform_concurrency")
# What the rejection matrix says each reason waits for.
REMEDY: dict[str, str] = {
    "cluster_budget": "waits for the next budget window",
    "tenant_budget": "waits for the next budget window",
    "client_concurrency": "waits for a completion on the client",
    "client_queue_depth": "unbound: tries another client; bound: waits for the client's queue to drain",
    "platform_concurrency": "waits for a completion on the tenant's platform account",
    "no_eligible_client": "waits for an online client of the tenant and workspace",
    "client_has_high": "waits until the client's high-lane work is dispatched",
    "client_interrupt_overdue": "waits until the client's overdue interrupt is resolved",
    "lane_paused": "waits until an operator resumes the lane",
    "auto_slowdown": "waits until ingest/projection lag and database write health recover",
    "platform_paused": "waits until an operator resumes the platform",
    "retry_waits_for_low_water": "retry lane waits until high and normal backlogs are low",
    "platform_unhealthy": "waits until the client reports its login on the platform working (or another client)",
    "tenant_platform_paused": "waits until a client of the tenant reports the platform's login working, or an "
                              "operator lifts the pause",
}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A ready business task, as the planner needs it."""

    id: int
    tenant_id: int
    workspace_id: int
    ai_platform_id: int
    lane: str
    priority: int
    enqueued_at: float  # epoch seconds
    target_client_id: UUID | None = None


@dataclass(slots=True)
class ClientState:
    """An eligible (online, fresh heartbeat, not disabled) client and its monitor load."""

    id: UUID
    tenant_id: int
    workspace_id: int
    max_concurrent: int
    max_queue_depth: int
    in_progress: int = 0
    queued: int = 0
    # Ready or queued high work targets this client (§9.3 rule 2: no new normal to it).
    pending_high: bool = False
    # An interrupt on this client passed its platform's soft timeout (no new normal to it).
    interrupt_overdue: bool = False
    interrupt_generation: int = 0
    # Platforms whose login the client reports broken (libs/domain/platform_health.py): no scheduled work of them.
    blocked_platforms: frozenset[int] = frozenset()

    @property
    def load(self) -> int:
        return self.in_progress + self.queued


@dataclass(frozen=True, slots=True)
class PassLimits:
    cluster_per_window: int
    tenant_per_window: int
    normal_background_share: float = 0.15
    high_reserved_share: float = 0.10
    paused_lanes: frozenset[str] = frozenset()
    slowdown: bool = False
    # Retry enters only while high and normal backlogs are at or below this (§9.3 rule 4).
    retry_low_watermark: int = 100

    @property
    def non_high_cap(self) -> int:
        """The most non-high executions one window may create."""
        return self.cluster_per_window - math.ceil(self.cluster_per_window * self.high_reserved_share)

    @property
    def normal_guarantee(self) -> int:
        """Slots of a window high must leave to normal lanes while they have work."""
        return min(self.non_high_cap, math.ceil(self.cluster_per_window * self.normal_background_share))


@dataclass(slots=True)
class Ledger:
    """Budgets and capacities consumed so far in the window; the planner updates it as it decides."""

    cluster_used: int = 0
    non_high_used: int = 0
    tenant_used: dict[int, int] = field(default_factory=dict)
    # Active (queued + in_progress) executions per (tenant_id, ai_platform_id).
    platform_active: dict[tuple[int, int], int] = field(default_factory=dict)
    # Per-platform limits (platform_settings.max_concurrent); missing -> default_platform_limit.
    platform_limit: dict[int, int] = field(default_factory=dict)
    paused_platforms: frozenset[int] = frozenset()
    # (tenant, platform) pairs whose scheduled work is held (platform-health pause; high still goes).
    paused_pairs: frozenset[tuple[int, int]] = frozenset()
    default_platform_limit: int = 1

    def platform_room(self, tenant_id: int, platform_id: int) -> int:
        limit = self.platform_limit.get(platform_id, self.default_platform_limit)
        return limit - self.platform_active.get((tenant_id, platform_id), 0)


@dataclass(frozen=True, slots=True)
class Decision:
    task: Candidate
    client_id: UUID
    interrupt_generation: int  # the client's current generation for high work, else 0


@dataclass(slots=True)
class PassResult:
    decisions: list[Decision] = field(default_factory=list)
    rejections: Counter[str] = field(default_factory=Counter)
    # Tenant served last per lane (the next pass's rotation starts after it).
    last_served: dict[str, int] = field(default_factory=dict)
    # The cluster budget ran out for some lane: nothing more can go before the next window.
    cluster_exhausted: bool = False


# ---- the decision tree ---------------------------------------------------------------------------


def cluster_room(lane: str, ledger: Ledger, limits: PassLimits, *, normal_has_work: bool) -> int:
    """Slots of the window's cluster budget this lane may still use (tree step 1 plus lane quotas)."""
    room = limits.cluster_per_window - ledger.cluster_used
    if monitor_lane(lane).budget_exempt:
        if normal_has_work:
            room -= max(0, limits.normal_guarantee - ledger.non_high_used)
        return room
    return min(room, limits.non_high_cap - ledger.non_high_used)


def task_reject_reason(task: Candidate, ledger: Ledger, limits: PassLimits, *,
                       normal_has_work: bool) -> RejectReason | None:
    """Tree steps that depend on the task only (1, 2); lane pauses and slow-down come first."""
    lane = monitor_lane(task.lane)
    if task.lane in limits.paused_lanes:
        return "lane_paused"
    if limits.slowdown and not lane.slowdown_exempt:
        return "auto_slowdown"
    if cluster_room(task.lane, ledger, limits, normal_has_work=normal_has_work) <= 0:
        return "cluster_budget"
    if not lane.budget_exempt and ledger.tenant_used.get(task.tenant_id, 0) >= limits.tenant_per_window:
        return "tenant_budget"
    if lane.held_for_broken_login and (task.tenant_id, task.ai_platform_id) in ledger.paused_pairs:
        return "tenant_platform_paused"
    return None


def client_reject_reason(task: Candidate, client: ClientState) -> RejectReason | None:
    """Tree steps 3 and 4 for one client, plus the lane rules that keep normal off a client."""
    lane = monitor_lane(task.lane)
    if client.in_progress >= client.max_concurrent:
        return "client_concurrency"
    if not lane.preempts:
        if client.queued >= client.max_queue_depth:
            return "client_queue_depth"
        if client.pending_high:
            return "client_has_high"
        if client.interrupt_overdue:
            return "client_interrupt_overdue"
    if lane.held_for_broken_login and task.ai_platform_id in client.blocked_platforms:
        return "platform_unhealthy"
    return None


def platform_reject_reason(task: Candidate, ledger: Ledger) -> RejectReason | None:
    """Tree step 5: active executions of the tenant's platform account across all its clients."""
    if task.ai_platform_id in ledger.paused_platforms:
        return "platform_paused"
    if ledger.platform_room(task.tenant_id, task.ai_platform_id) <= 0:
        return "platform_concurrency"
    return None


def choose_client(task: Candidate, scope_clients: Sequence[ClientState],
                  clients: Mapping[UUID, ClientState]) -> tuple[ClientState | None, RejectReason | None]:
    """The bound client, or for an unbound task the least-loaded eligible client that passes 3 and 4.

    Queue depth on one client sends an unbound task to the next one (rejection matrix); when every
    client refuses, the reason reported is the least-loaded client's.
    """
    if task.target_client_id is not None:
        client = clients.get(task.target_client_id)
        if client is None:
            return None, "no_eligible_client"
        return (None, reason) if (reason := client_reject_reason(task, client)) else (client, None)
    if not scope_clients:
        return None, "no_eligible_client"
    first_reason: RejectReason | None = None
    for client in sorted(scope_clients, key=lambda c: (c.load, c.in_progress, str(c.id))):
        reason = client_reject_reason(task, client)
        if reason is None:
            return client, None
        first_reason = first_reason or reason
    return None, first_reason


def evaluate(task: Candidate, ledger: Ledger, limits: PassLimits, scope_clients: Sequence[ClientState],
             clients: Mapping[UUID, ClientState], *, normal_has_work: bool) -> tuple[ClientState | None,
                                                                                     RejectReason | None]:
    """The whole tree for one task, in order: (client to dispatch to, None) or (None, reason)."""
    reason = task_reject_reason(task, ledger, limits, normal_has_work=normal_has_work)
    if reason is not None:
        return None, reason
    client, reason = choose_client(task, scope_clients, clients)
    if reason is not None:
        return None, reason
    reason = platform_reject_reason(task, ledger)
    if reason is not None:
        return None, reason
    return client, None


def apply(task: Candidate, client: ClientState, ledger: Ledger) -> Decision:
    """Spend the budgets and capacity one dispatch uses."""
    lane = monitor_lane(task.lane)
    ledger.cluster_used += 1
    if not lane.budget_exempt:
        ledger.non_high_used += 1
        ledger.tenant_used[task.tenant_id] = ledger.tenant_used.get(task.tenant_id, 0) + 1
    key = (task.tenant_id, task.ai_platform_id)
    ledger.platform_active[key] = ledger.platform_active.get(key, 0) + 1
    client.queued += 1
    if lane.preempts:
        client.pending_high = True
    return Decision(task=task, client_id=client.id,
                    interrupt_generation=client.interrupt_generation if lane.preempts else 0)


# ---- lane order and fairness ---------------------------------------------------------------------


def lane_sort_key(task: Candidate) -> tuple[int, float, int]:
    """Within one tenant and lane: priority DESC, enqueued_at ASC (id breaks ties)."""
    return (-task.priority, task.enqueued_at, task.id)


def round_robin(candidates: Iterable[Candidate], last_served: int | None) -> list[Candidate]:
    """Interleave tenants one task at a time, starting after `last_served` (deficit round-robin, quantum 1)."""
    by_tenant: dict[int, list[Candidate]] = defaultdict(list)
    for task in candidates:
        by_tenant[task.tenant_id].append(task)
    for tasks in by_tenant.values():
        tasks.sort(key=lane_sort_key)
    tenants = sorted(by_tenant)
    if last_served is not None:
        later = [t for t in tenants if t > last_served]
        tenants = later + [t for t in tenants if t <= last_served]
    ordered: list[Candidate] = []
    depth = 0
    while True:
        row = [by_tenant[t][depth] for t in tenants if depth < len(by_tenant[t])]
        if not row:
            return ordered
        ordered.extend(row)
        depth += 1


def retry_allowed(tenant_id: int, *, cluster_high_backlog: int, tenant_normal_backlog: Mapping[int, int],
                  watermark: int) -> bool:
    """§9.3 rule 4: retry enters only when high (cluster-wide) and the tenant's normal backlog are low."""
    return cluster_high_backlog <= watermark and tenant_normal_backlog.get(tenant_id, 0) <= watermark


def plan_pass(candidates: Mapping[str, Sequence[Candidate]], clients: Sequence[ClientState], ledger: Ledger,
              limits: PassLimits, *, last_served: Mapping[str, int] | None = None,
              cluster_high_backlog: int = 0, tenant_normal_backlog: Mapping[int, int] | None = None,
              max_dispatches: int | None = None, normal_has_work: bool | None = None) -> PassResult:
    """Decide one pass: lanes in order (high first), tenants round-robin inside a lane, the tree per task.

    `candidates` maps lane -> ready tasks of that lane (any order). `ledger` and `clients` are updated
    in place as dispatches are decided. Rejections are counted once per task evaluated, except that a
    cluster budget stop ends the lane and a tenant budget stop skips that tenant's remaining tasks.
    `normal_has_work` (default: some non-high candidate is given) decides whether high leaves the normal
    guarantee of the window to the normal lanes; a high-only pass passes it explicitly.
    """
    result = PassResult()
    rotation = dict(last_served or {})
    normal_backlog = tenant_normal_backlog or {}
    by_id = {c.id: c for c in clients}
    by_scope: dict[tuple[int, int], list[ClientState]] = defaultdict(list)
    for client in clients:
        by_scope[(client.tenant_id, client.workspace_id)].append(client)
    if normal_has_work is None:
        normal_has_work = any(candidates.get(lane) for lane in NON_EXEMPT_LANES)
    budget_left = max_dispatches if max_dispatches is not None else math.inf

    for lane in LANE_ORDER:
        lane_tasks = candidates.get(lane) or ()
        if not lane_tasks:
            continue
        tenants_out: set[int] = set()
        retry_gated = monitor_lane(lane).retry_gated
        for task in round_robin(lane_tasks, rotation.get(lane)):
            if budget_left <= 0:
                break
            if task.tenant_id in tenants_out:
                continue
            if retry_gated and not retry_allowed(task.tenant_id, cluster_high_backlog=cluster_high_backlog,
                                                 tenant_normal_backlog=normal_backlog,
                                                 watermark=limits.retry_low_watermark):
                result.rejections["retry_waits_for_low_water"] += 1
                tenants_out.add(task.tenant_id)
                continue
            chosen, reason = evaluate(task, ledger, limits, by_scope.get((task.tenant_id, task.workspace_id), ()),
                                      by_id, normal_has_work=normal_has_work)
            if reason is not None:
                result.rejections[reason] += 1
                if reason == "cluster_budget":
                    result.cluster_exhausted = True
                    break
                if reason in ("tenant_budget", "lane_paused", "auto_slowdown"):
                    tenants_out.add(task.tenant_id)
                continue
            assert chosen is not None
            result.decisions.append(apply(task, chosen, ledger))
            result.last_served[lane] = task.tenant_id
            budget_left -= 1
    return result


def window_start(epoch_seconds: float, window_seconds: int) -> float:
    """Start of the fixed budget window containing `epoch_seconds` (minute windows by default)."""
    window = max(1, window_seconds)
    return math.floor(epoch_seconds / window) * window


def pair_fetch_limit(room: int, tenant_room: int, *, lane: str, cap: int, client_room: int | None = None) -> int:
    """How many ready tasks of one (tenant, platform, lane) a pass should look at.

    Platform room bounds what can go; a couple more let a pass look past a bound task whose client
    is busy. High ignores the tenant budget. `client_room`: how much non-high work the tenant's clients
    can still take (`normal_client_room`); none means no non-high task of the tenant can go this pass.
    """
    if room <= 0:
        return 0
    spec = monitor_lane(lane)
    usable = room if spec.budget_exempt else min(room, tenant_room)
    if not spec.preempts and client_room is not None:
        usable = min(usable, client_room)
    return 0 if usable <= 0 else min(cap, usable + 2)


_NORMAL_PROBE = Candidate(id=0, tenant_id=0, workspace_id=0, ai_platform_id=0, lane=SCHEDULED_LANE.name, priority=0,
                          enqueued_at=0.0)


def normal_client_room(clients: Sequence[ClientState]) -> tuple[dict[int, int], dict[int, RejectReason]]:
    """Per tenant: how many more non-high tasks its eligible clients can take this pass (tree steps 3 and 4),
    and for a tenant whose clients take none, the reason its least-loaded client gives (rejection count).
    A pass need not read candidates that no client could take."""
    room: dict[int, int] = {}
    refused: dict[int, RejectReason] = {}
    for client in sorted(clients, key=lambda c: (c.load, c.in_progress, str(c.id))):
        reason = client_reject_reason(_NORMAL_PROBE, client)
        if reason is None:
            room[client.tenant_id] = room.get(client.tenant_id, 0) + client.max_queue_depth - client.queued
        elif client.tenant_id not in refused:
            refused[client.tenant_id] = reason
    return room, {tenant: reason for tenant, reason in refused.items() if tenant not in room}


# A full pass reads at most this many candidates per task it may dispatch (see `pair_read_window`).
CANDIDATE_ROWS_PER_DISPATCH = 2


def pair_window_share(budget_rows: int, n_pairs: int) -> int:
    """The most rows a window of `pair_read_window` reads of one pair: a fair share of the rows over the pairs, plus two
    to look past a bound task whose client is busy."""
    return math.ceil(budget_rows / max(1, n_pairs)) + 2


def pairs_after(pairs: Sequence[tuple[int, int]], after: tuple[int, int] | None, n: int) -> list[tuple[int, int]]:
    """The next `n` (at most all) of the sorted `pairs` after the pair `after`, wrapping around: the pairs the next
    `n` visits of `pair_read_window` would visit."""
    if not pairs:
        return []
    start = bisect_right(pairs, after) if after is not None else 0
    return [pairs[(start + i) % len(pairs)] for i in range(min(n, len(pairs)))]


@dataclass(frozen=True, slots=True)
class PairRead:
    """How many ready tasks of one (tenant, platform) in one lane a pass reads."""

    tenant_id: int
    ai_platform_id: int
    k: int


def pair_read_window(pairs: Sequence[tuple[int, int]], after: tuple[int, int] | None, budget_rows: int,
                     k_of: Callable[[int, int], int], *, max_visits: int | None = None,
                     share: int | None = None) -> tuple[list[PairRead], tuple[int, int] | None, int]:
    """Which pairs of one lane a full pass reads, so that its candidate reads follow what it can dispatch, not how many
    pairs have work: at most about `budget_rows` rows, each pair's k (`k_of`: how many it could use, 0 when none) cut
    to a fair share of them (the rows over the pairs, plus two to look past a bound task whose client is busy),
    starting after the pair `after` (the last one the previous window read, in (tenant, platform) order) and wrapping
    around: a round-robin over the pairs with room, a window of them per pass. `pairs` sorted; `k_of` is asked only
    for the pairs the window visits, at most `max_visits` (default: every pair once), so the cost follows the window,
    not the number of pairs. Returns the window, the cursor for the next window and how many pairs it visited.

    A few pairs (a small system) are all read, up to their k, every pass; thousands (10,000 tenants) are read a window
    per pass, every pair in turn.

    One window may be walked in stretches (the full pass reads the clients of a stretch's tenants before it walks it):
    each call continues from the cursor the previous one returned, with the rows still wanted as `budget_rows`, the
    visits still allowed as `max_visits` and the first call's `share` (`pair_window_share`); the stretches then pick
    exactly the pairs, and the k, one call would have."""
    if not pairs or budget_rows <= 0:
        return [], after, 0
    if share is None:
        share = pair_window_share(budget_rows, len(pairs))
    start = bisect_right(pairs, after) if after is not None else 0
    limit = len(pairs) if max_visits is None else min(len(pairs), max_visits)
    window: list[PairRead] = []
    rows = visited = 0
    cursor = after
    while visited < limit and rows < budget_rows:
        tenant_id, platform_id = cursor = pairs[(start + visited) % len(pairs)]
        visited += 1
        k = min(k_of(tenant_id, platform_id), share)
        if k > 0:
            window.append(PairRead(tenant_id, platform_id, k))
            rows += k
    return window, cursor, visited
