"""Metrics that tell the truth: leader-owned gauges only from the leader; RED metrics per route template."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge

from libs.telemetry import metrics


def test_leader_owned_gauges_are_exported_only_while_leading() -> None:
    registry = CollectorRegistry()
    backlog = Gauge("monitor_dispatch_high_backlog", "leader-owned", registry=registry)
    Gauge("desktop_websocket_connections", "every replica's own", registry=registry).set(3)
    backlog.set(7)
    try:
        metrics.set_leading("dispatch-coordinator", False)
        standby = metrics.exposition(registry).decode()
        assert "monitor_dispatch_high_backlog" not in standby
        assert "desktop_websocket_connections 3.0" in standby
        metrics.set_leading("dispatch-coordinator", True)
        assert "monitor_dispatch_high_backlog 7.0" in metrics.exposition(registry).decode()
        metrics.set_leading("reconciler", True)  # leading another role does not matter
        metrics.set_leading("dispatch-coordinator", False)
        assert "monitor_dispatch_high_backlog" not in metrics.exposition(registry).decode()
    finally:
        metrics.set_leading("dispatch-coordinator", False)
        metrics.set_leading("reconciler", False)


def test_every_leader_owned_name_is_a_registered_metric() -> None:
    registered = {m.name for m in metrics.REGISTRY.collect()}
    assert set(metrics.LEADER_OWNED) <= registered


def test_an_exact_counter_refuses_wrong_labels_and_negative_amounts_bound_or_not() -> None:
    registry = CollectorRegistry()
    sent = metrics.ExactCounter("frames_sent", "Frames.", ["direction"], registry=registry)
    plain = metrics.ExactCounter("plain_events", "Events.", registry=registry)
    for wrong in ({}, {"kind": "text"}, {"direction": "out", "kind": "text"}):
        with pytest.raises(ValueError, match="takes labels"):
            sent.inc(1.0, **wrong)
        with pytest.raises(ValueError, match="takes labels"):
            sent.bound(**wrong)
    with pytest.raises(ValueError, match="takes labels"):
        plain.inc(direction="out")
    out = sent.bound(direction="out")
    with pytest.raises(ValueError, match="only go up"):
        out.inc(-1)
    with pytest.raises(ValueError, match="only go up"):
        sent.inc(-1, direction="out")
    out.inc()
    sent.inc(2, direction="out")
    sent.inc(direction="in")
    plain.inc()
    assert (sent.value(direction="out"), sent.value(direction="in"), plain.value()) == (3.0, 1.0, 1.0)
    text = metrics.exposition(registry).decode()
    assert 'frames_sent{direction="out"} 3.0' in text and "plain_events 1.0" in text
