"""Lanes, weights and priority ranges (§7.3): ORDER BY lane_weight DESC, priority DESC, enqueued_at ASC."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MonitorLane = Literal["high", "normal", "normal_boosted", "retry"]


@dataclass(frozen=True, slots=True)
class LaneSpec:
    kind: Literal["monitor", "publish"]
    lane: str
    min_priority: int
    max_priority: int
    weight: int
    default_priority: int


LANE_SPECS: tuple[LaneSpec, ...] = (
    LaneSpec("publish", "urgent", 20000, 29999, 100, 25000),
    LaneSpec("publish", "high", 15000, 19999, 90, 18000),
    LaneSpec("publish", "normal", 10000, 14999, 80, 12000),
    LaneSpec("monitor", "high", 5000, 5999, 70, 5000),
    LaneSpec("monitor", "normal_boosted", 1000, 4999, 50, 1000),
    LaneSpec("monitor", "normal", 100, 999, 40, 100),
    LaneSpec("monitor", "retry", 10, 99, 20, 50),
)
_BY_KEY: dict[tuple[str, str], LaneSpec] = {(s.kind, s.lane): s for s in LANE_SPECS}

MONITOR_LANE_WEIGHT: dict[str, int] = {s.lane: s.weight for s in LANE_SPECS if s.kind == "monitor"}
HIGH_PRIORITY = 5000
NORMAL_PRIORITY = 100
RETRY_PRIORITY = 50
# Aging never lifts a normal task past this (§9.4: +900 cap keeps it below the high range).
AGING_CAP = 900


def lane_spec(kind: str, lane: str) -> LaneSpec:
    try:
        return _BY_KEY[(kind, lane)]
    except KeyError:
        raise ValueError(f"no lane {lane!r} for kind {kind!r}") from None


def lane_weight(kind: str, lane: str) -> int:
    return lane_spec(kind, lane).weight


def clamp_priority(kind: str, lane: str, priority: int) -> int:
    """Keep a priority inside its lane's range, so priorities can never jump a lane."""
    spec = lane_spec(kind, lane)
    return max(spec.min_priority, min(spec.max_priority, priority))


def dispatch_sort_key(lane_weight_value: int, priority: int, enqueued_at_epoch: float) -> tuple[int, int, float]:
    """Python twin of ORDER BY lane_weight DESC, priority DESC, enqueued_at ASC (ascending sort)."""
    return (-lane_weight_value, -priority, enqueued_at_epoch)
