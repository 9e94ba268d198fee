"""The lanes as one table of data (§7.3, §9.2-§9.4, §10, §12.4): what every lane is called, where its priorities
lie, how much it weighs, and how dispatch, aging, retries, the platform-health pause and the auto slow-down treat it.

Code and SQL derive from `LANE_SPECS` instead of comparing lane names: the `Lane` Literal of the contracts
(`libs/contracts/common.py`, held equal to the table by `tests/unit/test_lane_table.py`), the lane lists of the
settings and the planner, and the SQL lane lists (`sql_names`, `retry_lane_sql`, ...). The migrations' CHECK
constraints and partial indexes are held to it by `tests/integration/test_lane_schema.py`. Adding a lane:
docs/architecture.md, "How to change X".

Order everywhere: ORDER BY lane_weight DESC, priority DESC, enqueued_at ASC.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Kind = Literal["monitor", "publish"]
# How work gets into a monitor lane: a user's collect-now, the schedule scanner, aging, or a failure.
Entry = Literal["collect_now", "schedule", "aging", "failure", ""]
ExecutionSource = Literal["collect_now", "daily_schedule", "retry_recovery", "publish"]


@dataclass(frozen=True, slots=True)
class LaneSpec:
    """One lane of one task kind. The behaviour fields matter for monitor lanes; a publish lane has none of it."""

    kind: Kind
    # The lane's name in every lane column (`dispatch_lane`, `desktop_tasks.lane`, `legacy_leases.lane`) and on the
    # wire (`task_available.lane`, the ops status).
    name: str
    min_priority: int
    max_priority: int
    weight: int
    default_priority: int
    entry: Entry = ""
    # The lane word of its dispatch routing key `monitor.{word}.{client}` (docs/architecture.md, RabbitMQ topology);
    # empty: the name.
    route_as: str = ""
    # §9.2: not held by the tenant budget (tree step 2) and not spending it; counts against the cluster budget only,
    # may spend the window's `high_reserved_share` and leaves the normal lanes their background share.
    budget_exempt: bool = False
    # §9.3, §10: preempts scheduled work on its client. Its pending work keeps the other lanes off that client
    # (`client_has_high`), it is not held by the client's queue depth (tree step 4) nor by an overdue interrupt, its
    # executions carry the client's interrupt generation, and a click withdraws the client's work of the other lanes.
    preempts: bool = False
    # §10.1: a click on its client takes this lane's work back: queued work is cancelled, running work asked to
    # yield (scheduled work only: never the click's own lane, never retries).
    preemptible: bool = False
    # Outbox priority of its `task_available` (libs/outbox): above 0, claimed before older events, relayed by the
    # coordinator right after its commit and woken by NOTIFY (a click waits for it).
    outbox_priority: int = 0
    # §12.4: dispatched while the auto slow-down holds the other lanes.
    slowdown_exempt: bool = False
    # libs/domain/platform_health.py: held back on a client that reports a broken login on the task's platform, and
    # for a tenant whose platform is paused on health.
    held_for_broken_login: bool = False
    # §9.3 rule 4: enters only while the high backlog and the tenant's normal backlog are at or below
    # `retry_low_watermark`.
    retry_gated: bool = False
    # Counts in "the normal backlog" (the retry gate, `monitor_dispatch_normal_backlog`, the starvation age).
    normal_backlog: bool = False
    # §9.4: aging moves the oldest ready tasks of this lane into `ages_into` (empty: the lane does not age).
    ages_into: str = ""
    # Where a failure or an expired lease sends a task of this lane, at that lane's default priority; a lane that
    # retries into itself keeps the task's priority (high work stays high, `retry_business_task`).
    retries_into: str = ""
    # `desktop_tasks.source` of its executions (cross-service contract 2; see `execution_source`).
    source: ExecutionSource = "daily_schedule"

    @property
    def routing_word(self) -> str:
        return self.route_as or self.name

    @property
    def ages(self) -> bool:
        return bool(self.ages_into)


LANE_SPECS: tuple[LaneSpec, ...] = (
    LaneSpec("publish", "urgent", 20000, 29999, 100, 25000, source="publish"),
    LaneSpec("publish", "high", 15000, 19999, 90, 18000, source="publish"),
    LaneSpec("publish", "normal", 10000, 14999, 80, 12000, source="publish"),
    LaneSpec("monitor", "high", 5000, 5999, 70, 5000, entry="collect_now", budget_exempt=True, preempts=True,
             outbox_priority=1, slowdown_exempt=True, retries_into="high", source="collect_now"),
    LaneSpec("monitor", "normal_boosted", 1000, 4999, 50, 1000, entry="aging", route_as="normal", preemptible=True,
             held_for_broken_login=True, normal_backlog=True, ages_into="normal_boosted", retries_into="retry"),
    LaneSpec("monitor", "normal", 100, 999, 40, 100, entry="schedule", preemptible=True, held_for_broken_login=True,
             normal_backlog=True, ages_into="normal_boosted", retries_into="retry"),
    LaneSpec("monitor", "retry", 10, 99, 20, 50, entry="failure", held_for_broken_login=True, retry_gated=True,
             retries_into="retry", source="retry_recovery"),
)

_NAME = re.compile(r"^[a-z][a-z_]*$")


def table_problems(specs: tuple[LaneSpec, ...]) -> list[str]:
    """What is wrong with a lane table (empty: nothing). The derivations below rely on every one of these."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for s in specs:
        if not _NAME.match(s.name) or (s.route_as and not _NAME.match(s.route_as)):
            problems.append(f"{s.kind}/{s.name}: a lane name is lower-case letters and '_' (it is spliced into SQL)")
        if (s.kind, s.name) in seen:
            problems.append(f"{s.kind}/{s.name}: listed twice")
        seen.add((s.kind, s.name))
        if not s.min_priority <= s.default_priority <= s.max_priority:
            problems.append(f"{s.kind}/{s.name}: default priority outside its range")
    for kind in ("monitor", "publish"):
        ordered = sorted((s for s in specs if s.kind == kind), key=lambda s: -s.weight)
        for upper, lower in itertools.pairwise(ordered):
            if upper.weight == lower.weight or upper.min_priority <= lower.max_priority:
                problems.append(f"{kind}/{upper.name} and {lower.name}: weights and priority ranges must be "
                                "strictly ordered together (a priority never jumps a lane)")
    monitor = [s for s in specs if s.kind == "monitor"]
    names = {s.name for s in monitor}
    for s in monitor:
        for field_name in ("ages_into", "retries_into", "route_as"):
            target = getattr(s, field_name)
            if target and target not in names:
                problems.append(f"monitor/{s.name}: {field_name} {target!r} is not a monitor lane")
        if not s.retries_into:
            problems.append(f"monitor/{s.name}: says no lane to retry into")
        if s.preempts and s.preemptible:
            problems.append(f"monitor/{s.name}: a lane that preempts cannot be preempted by a click")
    for entry in ("collect_now", "schedule", "failure"):
        if sum(1 for s in monitor if s.entry == entry) != 1:
            problems.append(f"exactly one monitor lane must be entered by {entry!r}")
    return problems


if _problems := table_problems(LANE_SPECS):
    raise ValueError(f"libs/domain/lanes.py LANE_SPECS: {'; '.join(_problems)}")

_BY_KEY: dict[tuple[str, str], LaneSpec] = {(s.kind, s.name): s for s in LANE_SPECS}
# Monitor lanes in dispatch order (lane_weight DESC).
MONITOR_LANES: tuple[LaneSpec, ...] = tuple(sorted((s for s in LANE_SPECS if s.kind == "monitor"),
                                                   key=lambda s: -s.weight))
MONITOR_LANE_NAMES: tuple[str, ...] = tuple(s.name for s in MONITOR_LANES)
# Every name a lane column of any kind may hold (`desktop_tasks.lane`).
ALL_LANE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(s.name for s in sorted(LANE_SPECS, key=lambda s: -s.weight)))


def _entered_by(entry: Entry) -> LaneSpec:
    return next(s for s in MONITOR_LANES if s.entry == entry)


# The lanes with a role of their own: where collect-now promotes a scope to, where the scanner creates work and a
# timed-out request's work goes back to, where failures go.
CLICK_LANE: LaneSpec = _entered_by("collect_now")
SCHEDULED_LANE: LaneSpec = _entered_by("schedule")
RETRY_LANE: LaneSpec = _entered_by("failure")

MONITOR_LANE_WEIGHT: dict[str, int] = {s.name: s.weight for s in MONITOR_LANES}
HIGH_PRIORITY = CLICK_LANE.default_priority
NORMAL_PRIORITY = SCHEDULED_LANE.default_priority
RETRY_PRIORITY = RETRY_LANE.default_priority
# Aging never lifts a normal task past this (§9.4: +900 cap keeps it below the high range).
AGING_CAP = 900


def lane_spec(kind: str, lane: str) -> LaneSpec:
    try:
        return _BY_KEY[(kind, lane)]
    except KeyError:
        raise ValueError(f"no lane {lane!r} for kind {kind!r}") from None


def monitor_lane(lane: str) -> LaneSpec:
    return lane_spec("monitor", lane)


def lane_weight(kind: str, lane: str) -> int:
    return lane_spec(kind, lane).weight


def lane_names(where: Callable[[LaneSpec], bool] = lambda s: True) -> tuple[str, ...]:
    """The monitor lanes `where` holds for, in dispatch order."""
    return tuple(s.name for s in MONITOR_LANES if where(s))


def _quoted(names: tuple[str, ...]) -> str:
    if not names:
        raise ValueError("no lane matches: an empty SQL list is a syntax error")
    return "(" + ", ".join(f"'{n}'" for n in names) + ")"


def sql_names(where: Callable[[LaneSpec], bool] = lambda s: True) -> str:
    """The monitor lanes `where` holds for as an SQL list, `('normal', 'normal_boosted')`, for `lane IN {...}`.
    (Names are checked letters and '_', so quoting them is all it takes.) A one-lane list `('high')` is planned as
    `= 'high'`, so partial indexes on either spelling still match."""
    return _quoted(lane_names(where))


def sql_all_names() -> str:
    """Every lane name of any kind as an SQL list (what `desktop_tasks.lane` may hold)."""
    return _quoted(ALL_LANE_NAMES)


# The lane classes SQL statements filter on, as `lane IN {...}` / `lane NOT IN {...}` lists. The aging statements
# must spell AGING_LANES_SQL as ix_collect_tasks_aging does (tests/integration/test_lane_schema.py holds the index to
# the table), so that the planner can use that partial index.
BUDGET_EXEMPT_SQL = sql_names(lambda s: s.budget_exempt)
PREEMPTING_SQL = sql_names(lambda s: s.preempts)
PREEMPTIBLE_SQL = sql_names(lambda s: s.preemptible)
AGING_LANES_SQL = sql_names(lambda s: s.ages)
NORMAL_BACKLOG_SQL = sql_names(lambda s: s.normal_backlog)
HELD_FOR_BROKEN_LOGIN_SQL = sql_names(lambda s: s.held_for_broken_login)


def _case(column: str, value: Callable[[LaneSpec], str]) -> str:
    arms = " ".join(f"WHEN '{s.name}' THEN {value(s)}" for s in MONITOR_LANES)
    return f"CASE {column} {arms} END"


def retry_lane_sql(column: str) -> str:
    """The lane a failure sends a task to, given its lane `column` (an SQL expression): `retries_into` per lane."""
    return _case(column, lambda s: f"'{s.retries_into}'")


def retry_priority_sql(column: str, priority_column: str) -> str:
    """The priority a failure gives a task, given its lane and priority columns: kept by a lane retrying into
    itself, else the default priority of the lane it retries into."""
    return _case(column, lambda s: priority_column if s.retries_into == s.name
                 else str(monitor_lane(s.retries_into).default_priority))


def routing_word(lane: str) -> str:
    """The lane word of a monitor dispatch routing key (`normal_boosted` travels as `normal`)."""
    return monitor_lane(lane).routing_word


def execution_source(lane: str, *, from_click: bool) -> ExecutionSource:
    """`desktop_tasks.source` of a new execution of a monitor task in `lane` (cross-service contract 2); work of
    the click lane that no click asked for (not manual, no request) counts as scheduled."""
    source = monitor_lane(lane).source
    if source == "collect_now" and not from_click:
        return "daily_schedule"
    return source


def clamp_priority(kind: str, lane: str, priority: int) -> int:
    """Keep a priority inside its lane's range, so priorities can never jump a lane."""
    spec = lane_spec(kind, lane)
    return max(spec.min_priority, min(spec.max_priority, priority))


def dispatch_sort_key(lane_weight_value: int, priority: int, enqueued_at_epoch: float) -> tuple[int, int, float]:
    """Python twin of ORDER BY lane_weight DESC, priority DESC, enqueued_at ASC (ascending sort)."""
    return (-lane_weight_value, -priority, enqueued_at_epoch)
