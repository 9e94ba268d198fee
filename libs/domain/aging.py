"""Aging of ready normal work (docs/architecture.md §9.4): percentile trigger plus logarithmic boost, capped at +900.

Every `aging_interval_seconds` the oldest `aging_fraction` (10%) of ready normal / normal_boosted
tasks by enqueued_at get `int(50 * log2(1 + wait_min / 5))` more priority and move to normal_boosted.
The boost accumulates over rounds in `aging_boost`, never beyond the cap, so a boosted normal task
always stays below the high range (priority < 5000). A round changes at most what `AgingPace` gives: twice what the
dispatcher took between rounds, not a share of the backlog.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from libs.domain.lanes import AGING_CAP, clamp_priority, monitor_lane


def aging_boost(wait_minutes: float) -> int:
    """The agingBoost formula of §9.4: 5 min +50, 10 min +79, 30 min +140, 60 min +185, 120 min +232.

    (The specification's example lists smaller figures; the formula is what is specified and implemented.)
    """
    if wait_minutes <= 0:
        return 0
    return int(50 * math.log2(1 + wait_minutes / 5))


def aging_increment(wait_minutes: float, already_boosted: int, cap: int = AGING_CAP) -> int:
    """What one aging round adds to a task, keeping the total boost within `cap`."""
    return max(0, min(cap - already_boosted, aging_boost(wait_minutes)))


def oldest_share(ready_count: int, fraction: float) -> int:
    """How many of the oldest ready tasks one round touches (at least one when any is ready)."""
    if ready_count <= 0 or fraction <= 0:
        return 0
    return min(ready_count, max(1, math.ceil(ready_count * fraction)))


# The pace: a round boosts twice what the dispatcher took since the last one (or than its recent average, kept as an
# exponentially weighted moving average with this weight for the newest round), so a burst is still covered a few
# rounds after it.
PACE_FACTOR = 2
PACE_ALPHA = 0.3


@dataclass(slots=True)
class AgingPace:
    """How many tasks an aging round changes (docs/architecture.md §9.4): PACE_FACTOR times the larger of the
    dispatches since the last round and their moving average, at least `floor` (one batch), at most the round's
    `ceiling` (what the cluster budget lets dispatch before the next round, twice). A boost stays, and only the tasks
    the dispatcher takes before the next round profit from being boosted now: boosting more rewrites rows (index
    maintenance, ~0.1-0.2 ms a row) whose order cannot matter yet, which grew with the backlog, not with dispatch
    (docs/benchmarks.md "Aging at the dispatch pace")."""

    floor: int
    alpha: float = PACE_ALPHA
    factor: int = PACE_FACTOR
    average: float | None = None  # dispatches per round; None before the first round

    def limit(self, dispatched: int, ceiling: int) -> int:
        """Record `dispatched` (since the last round) and give this round's limit."""
        dispatched = max(0, dispatched)
        self.average = (float(dispatched) if self.average is None
                        else self.alpha * dispatched + (1 - self.alpha) * self.average)
        wanted = math.ceil(self.factor * max(dispatched, self.average))
        return min(max(self.floor, wanted), max(self.floor, ceiling))


@dataclass(frozen=True, slots=True)
class Aged:
    lane: str
    priority: int
    aging_boost: int


def age_task(lane: str, priority: int, already_boosted: int, wait_minutes: float, cap: int = AGING_CAP) -> Aged | None:
    """The task's new lane (its lane's `ages_into`), priority and total boost after one round; None when nothing
    changes (or the lane does not age)."""
    spec = monitor_lane(lane)
    increment = aging_increment(wait_minutes, already_boosted, cap)
    if increment <= 0 or not spec.ages:
        return None
    into = monitor_lane(spec.ages_into)
    # Moving a task into another lane's range (normal 100..999 to normal_boosted 1000..4999) shifts its priority by
    # the distance between the ranges' floors, so relative order inside the lane it leaves survives.
    base = priority + into.min_priority - spec.min_priority if into.name != spec.name else priority
    return Aged(lane=into.name, priority=clamp_priority("monitor", into.name, base + increment),
                aging_boost=already_boosted + increment)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of `values`; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]
