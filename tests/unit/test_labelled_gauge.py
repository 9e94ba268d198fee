"""The maintenance tick's per-label gauges (maintenance.LabelledGauge): a tick writes only the labels whose value
changed and removes those that disappeared, so its cost follows what changed, not how many tenants or clients there
are, and no label is left at a stale value."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge

from services.dispatch_coordinator.maintenance import LabelledGauge


class _Counted:
    """The gauge's `labels` and `remove`, counted (what a tick writes)."""

    def __init__(self, gauge: Gauge, monkeypatch: pytest.MonkeyPatch) -> None:
        self.labelled: list[str] = []
        self.removed: list[str] = []
        labels, remove = gauge.labels, gauge.remove

        def counted_labels(**kwargs: Any) -> Any:
            self.labelled.extend(kwargs.values())
            return labels(**kwargs)

        def counted_remove(*values: str) -> None:
            self.removed.extend(values)
            remove(*values)

        monkeypatch.setattr(gauge, "labels", counted_labels)
        monkeypatch.setattr(gauge, "remove", counted_remove)

    def reset(self) -> None:
        self.labelled.clear()
        self.removed.clear()


def _exposed(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["tenant_id"]: s.value for m in registry.collect() for s in m.samples}


def test_only_changed_labels_are_written_and_vanished_ones_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    gauge = Gauge("tenant_backlog_test", "test", ["tenant_id"], registry=registry)
    counted = _Counted(gauge, monkeypatch)
    published: LabelledGauge[int] = LabelledGauge(gauge, "tenant_id")
    many = {tenant: tenant % 7 for tenant in range(1, 10_001)}

    assert published.publish(many) == 10_000
    assert len(counted.labelled) == 10_000 and not counted.removed
    assert _exposed(registry)["10"] == 3.0 and _exposed(registry)["7"] == 0.0  # a zero is published as zero

    counted.reset()
    assert published.publish(dict(many)) == 0  # the same values: nothing written
    assert counted.labelled == [] and counted.removed == []

    counted.reset()
    changed = dict(many)
    changed[5] = 40  # changed
    del changed[6]  # vanished
    changed[20_000] = 1  # appeared
    changed[8] = 0  # became zero, still there
    assert published.publish(changed) == 4
    assert sorted(counted.labelled) == ["20000", "5", "8"] and counted.removed == ["6"]
    exposed = _exposed(registry)
    assert "6" not in exposed and (exposed["5"], exposed["20000"], exposed["8"]) == (40.0, 1.0, 0.0)
    assert len(exposed) == 10_000

    counted.reset()
    assert published.publish({}) == 10_000  # every label gone: every one removed, none left stale
    assert _exposed(registry) == {} and counted.labelled == []


def test_the_published_values_are_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller changing its dict afterwards does not make the next tick believe the gauge already shows it."""
    registry = CollectorRegistry()
    gauge = Gauge("client_depth_test", "test", ["tenant_id"], registry=registry)
    published: LabelledGauge[str] = LabelledGauge(gauge, "tenant_id")
    values = {"a": 1}
    published.publish(values)
    values["a"] = 2
    assert published.publish(values) == 1
    assert _exposed(registry) == {"a": 2.0}


def test_when_most_labels_go_the_gauge_is_cleared_and_the_rest_written_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet gone offline: one clear instead of a `remove` per label, and what stays is still shown right."""
    registry = CollectorRegistry()
    gauge = Gauge("client_depth_mass_test", "test", ["tenant_id"], registry=registry)
    published: LabelledGauge[int] = LabelledGauge(gauge, "tenant_id")
    published.publish({n: 1 for n in range(1, 10_001)})
    counted = _Counted(gauge, monkeypatch)
    assert published.publish({3: 1, 4: 9}) == 9_998 + 2
    assert counted.removed == [] and sorted(counted.labelled) == ["3", "4"]
    assert _exposed(registry) == {"3": 1.0, "4": 9.0}
    counted.reset()
    assert published.publish({3: 1, 4: 9}) == 0 and counted.labelled == []
