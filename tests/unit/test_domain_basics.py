"""Shard keys, lane ranges and settings validation."""

from __future__ import annotations

from datetime import date

import pytest

from libs.dispatch_settings import DispatchSettings, SettingError, coerce, from_rows
from libs.domain.lanes import AGING_CAP, LANE_SPECS, clamp_priority, dispatch_sort_key, lane_weight
from libs.domain.shard import ingest_shard_key, shard_for, shard_for_key


def test_shard_is_stable_and_known() -> None:
    # Fixed expectations: a change of hash would re-route live shards, so it must be deliberate.
    assert ingest_shard_key(1, 2, date(2026, 4, 20)) == "1:2:2026-04-20"
    assert shard_for(1, 2, date(2026, 4, 20), 16) == shard_for_key("1:2:2026-04-20", 16)
    values = {shard_for(t, b, date(2026, 4, 20), 16) for t in range(1, 20) for b in range(1, 20)}
    assert values == set(range(16)), "361 keys should cover all 16 shards"
    with pytest.raises(ValueError):
        shard_for_key("x", 0)


def test_monitor_high_never_outranks_publish_normal() -> None:
    assert lane_weight("monitor", "high") < lane_weight("publish", "normal")
    highest_monitor = max(s.max_priority for s in LANE_SPECS if s.kind == "monitor")
    lowest_publish = min(s.min_priority for s in LANE_SPECS if s.kind == "publish")
    assert highest_monitor < lowest_publish


def test_aged_normal_stays_below_high() -> None:
    assert clamp_priority("monitor", "normal_boosted", 100 + AGING_CAP + 10_000) == 4999
    assert 100 + AGING_CAP < 5000


def test_dispatch_sort_key_matches_sql_order() -> None:
    rows = [(40, 100, 5.0), (70, 5000, 9.0), (40, 100, 1.0), (50, 300, 0.0), (20, 50, 0.0)]
    ordered = sorted(rows, key=lambda r: dispatch_sort_key(*r))
    assert ordered == [(70, 5000, 9.0), (50, 300, 0.0), (40, 100, 1.0), (40, 100, 5.0), (20, 50, 0.0)]


def test_settings_coercion_and_defaults() -> None:
    assert coerce("cluster_dispatch_per_minute", "500") == 500
    assert coerce("paused_lanes", "normal,retry") == ("normal", "retry")
    with pytest.raises(SettingError, match="unknown setting"):
        coerce("cluster_budget", 1)
    with pytest.raises(SettingError, match="unknown lane"):
        coerce("paused_lanes", "fast")
    with pytest.raises(SettingError, match="between 0 and 100"):
        coerce("rollout_percentage", 150)
    loaded = from_rows({"tenant_dispatch_per_minute": 5, "normal_background_share": "oops"})
    assert loaded.tenant_dispatch_per_minute == 5
    assert loaded.normal_background_share == DispatchSettings().normal_background_share
