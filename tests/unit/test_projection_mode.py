"""Projection rebuild mode (§12.4): merge while the coordinator's published slow-down is active and fresh."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import REGISTRY

from libs.coordinator_state import SLOWDOWN_MAX_AGE_S, slowdown_from_state
from libs.mq.topology import Topology
from services.projection_worker.consumer import ProjectionWorker
from services.projection_worker.mode import RebuildMode, rebuild_mode


def published(active: bool, reasons: list[str], age_s: float = 2.0) -> dict[str, Any]:
    """dispatch_coordinator_state as read_coordinator_state returns it."""
    return {"slowdown": {"value": {"active": active, "reasons": reasons, "since": 1.0, "signals": {}},
                         "age_s": age_s},
            "leader": {"value": {"instance_id": "c1"}, "age_s": age_s}}


def test_fresh_active_slowdown_means_merge_with_its_reasons() -> None:
    mode = rebuild_mode(published(True, ["projection_lag", "db_write_latency"]))
    assert mode == RebuildMode(merge=True, reasons=("projection_lag", "db_write_latency"))


def test_inactive_slowdown_means_per_event() -> None:
    mode = rebuild_mode(published(False, []))
    assert not mode.merge and mode.reasons == ()


@pytest.mark.parametrize("age_s", [SLOWDOWN_MAX_AGE_S + 0.1, 120.0])
def test_stale_state_is_not_active(age_s: float) -> None:
    """A coordinator that stopped publishing (dead, no leader) does not keep the worker merging."""
    mode = rebuild_mode(published(True, ["ingest_lag"], age_s=age_s))
    assert not mode.merge and mode.reasons == () and mode.note
    assert slowdown_from_state(published(True, ["ingest_lag"], age_s=age_s))[0] is False
    assert rebuild_mode(published(True, ["ingest_lag"], age_s=SLOWDOWN_MAX_AGE_S)).merge


def test_no_state_at_all_is_not_active() -> None:
    assert rebuild_mode({}) == RebuildMode(merge=False, note="no fresh state from an active coordinator")
    assert slowdown_from_state({}) == (False, {"active": None, "note": "no fresh state from an active coordinator"})


def test_each_switch_is_logged_with_its_reasons_and_sets_the_gauge(caplog: pytest.LogCaptureFixture) -> None:
    worker = ProjectionWorker(None, Topology("unit.", 4), None, merge_window_s=0.5, merge_batch=7)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="projection.consumer")
    worker.set_mode(rebuild_mode(published(True, ["projection_lag"])))
    assert worker.mode.merge and REGISTRY.get_sample_value("projection_merge_mode_active") == 1
    worker.set_mode(rebuild_mode(published(True, ["projection_lag"])))  # no switch, no log
    worker.set_mode(rebuild_mode(published(False, [])))
    assert not worker.mode.merge and REGISTRY.get_sample_value("projection_merge_mode_active") == 0
    records = [r for r in caplog.records if r.name == "projection.consumer"]
    assert [r.getMessage().split(":")[0] for r in records] == ["projection merge mode on",
                                                               "projection merge mode off"]
    on, off = records
    assert on.reasons == ["projection_lag"] and on.merge_batch == 7 and on.merge_window_ms == 500  # type: ignore[attr-defined]
    assert off.reasons == ["projection_lag"] and off.note == "auto slow-down over"  # type: ignore[attr-defined]
