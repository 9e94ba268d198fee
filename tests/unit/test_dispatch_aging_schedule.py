"""Aging (§9.4), schedule occurrences (§9.1), rollout (§16.2.2) and auto slow-down (§12.4), with a fake clock."""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, timedelta

import pytest

from libs.domain.aging import age_task, aging_boost, aging_increment, oldest_share, percentile
from libs.domain.lanes import lane_spec
from libs.domain.schedule import execution_owner_for, plan_occurrence
from libs.domain.slowdown import Signals, Thresholds, WriteStats, slowdown_reasons


class FakeClock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def advance(self, **kw: float) -> datetime:
        self.now += timedelta(**kw)
        return self.now


@pytest.mark.parametrize(("minutes", "boost"), [(0, 0), (5, 50), (10, 79), (30, 140), (60, 185), (120, 232)])
def test_aging_boost_formula(minutes: float, boost: int) -> None:
    assert aging_boost(minutes) == boost == (int(50 * math.log2(1 + minutes / 5)) if minutes else 0)


def test_aging_accumulates_over_rounds_but_never_beyond_the_cap() -> None:
    enqueued = datetime(2026, 1, 1, 8, 0, tzinfo=UTC)
    clock = FakeClock(enqueued)
    lane, priority, boosted = "normal", 100, 0
    history = []
    for _ in range(40):  # 40 rounds of 30 s
        wait = (clock.advance(seconds=30) - enqueued).total_seconds() / 60
        aged = age_task(lane, priority, boosted, wait)
        if aged is None:
            break
        lane, priority, boosted = aged.lane, aged.priority, aged.aging_boost
        history.append(boosted)
    assert lane == "normal_boosted"
    assert boosted == 900 and history == sorted(history)
    assert aging_increment(1_000, 900) == 0
    assert age_task(lane, priority, boosted, 1_000) is None
    # The first round moves the task into the boosted range with the boost on top.
    first = age_task("normal", 100, 0, 10)
    assert first is not None and first.priority == 1000 + 79 and first.aging_boost == 79
    high = lane_spec("monitor", "high")
    assert age_task("normal", 999, 0, 1e9, cap=900) is not None
    worst = age_task("normal_boosted", 999 + 900 + 800, 800, 1e9)
    assert worst is not None and worst.priority < high.min_priority and worst.aging_boost == 900


def test_aging_touches_the_oldest_ten_percent() -> None:
    assert oldest_share(0, 0.1) == 0
    assert oldest_share(5, 0.1) == 1
    assert oldest_share(1000, 0.1) == 100
    assert oldest_share(1001, 0.1) == 101
    assert percentile([5, 1, 3, 2, 4], 0.99) == 5
    assert percentile([], 0.99) == 0


def test_plan_occurrence_uses_tenant_time_zone_for_the_business_date() -> None:
    # 23:30 UTC on Jan 1 is already Jan 2 in Shanghai (UTC+8).
    slot = datetime(2026, 1, 1, 23, 30, tzinfo=UTC)
    clock = FakeClock(slot)
    occ = plan_occurrence(slot, 86400, clock.advance(seconds=5), "Asia/Shanghai")
    assert occ.business_date == date(2026, 1, 2)
    assert plan_occurrence(slot, 86400, clock.now, "UTC").business_date == date(2026, 1, 1)
    assert occ.next_run_at == slot + timedelta(days=1) and occ.skipped == 0
    assert plan_occurrence(slot, 86400, clock.now, "No/Such_Zone").business_date == date(2026, 1, 1)


def test_plan_occurrence_after_downtime_takes_the_latest_due_slot_only() -> None:
    slot = datetime(2026, 1, 1, 6, 0, tzinfo=UTC)
    clock = FakeClock(slot)
    occ = plan_occurrence(slot, 86400, clock.advance(days=3, hours=1), "UTC")
    assert occ.slot == datetime(2026, 1, 4, 6, 0, tzinfo=UTC) and occ.skipped == 3
    assert occ.business_date == date(2026, 1, 4)
    assert occ.next_run_at == datetime(2026, 1, 5, 6, 0, tzinfo=UTC) and occ.next_run_at > clock.now


def test_rollout_by_tenant_modulo() -> None:
    assert execution_owner_for(7, 100) == "desktop_tasks"
    assert execution_owner_for(7, 0) == "legacy"
    assert execution_owner_for(104, 5) == "desktop_tasks"
    assert execution_owner_for(105, 5) == "legacy"


def test_slowdown_reasons_per_threshold() -> None:
    th = Thresholds()
    assert slowdown_reasons(Signals(), th) == []
    assert slowdown_reasons(Signals(ingest_lag_ms=30_001), th) == ["ingest_lag"]
    assert slowdown_reasons(Signals(projection_lag_ms=60_001), th) == ["projection_lag"]
    assert slowdown_reasons(Signals(write_p95_ms=501, conflict_rate=0.06), th) == ["db_write_latency",
                                                                                   "conflict_rate"]
    assert slowdown_reasons(Signals(ingest_lag_ms=30_000, conflict_rate=0.05), th) == []


def test_write_stats_rolling_window_with_fake_clock() -> None:
    stats = WriteStats(window_s=60, min_samples=20)
    t = 1000.0
    for i in range(19):
        stats.record(t + i, 900.0, True)
    assert stats.p95_ms(t + 19) == 0 and stats.conflict_rate(t + 19) == 0  # too few samples to judge
    for i in range(81):
        stats.record(t + 19 + i * 0.1, 10.0, False)
    assert stats.conflict_rate(t + 30) == pytest.approx(0.19)
    assert stats.p95_ms(t + 30) == 900.0
    # A minute later the slow, conflicting transactions have left the window.
    for i in range(30):
        stats.record(t + 90 + i * 0.1, 20.0, False)
    assert stats.conflict_rate(t + 95) == 0 and stats.p95_ms(t + 95) == 20.0
