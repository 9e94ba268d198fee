"""Reconciler decisions and wiring without I/O."""

from __future__ import annotations

import pytest

from libs.dispatch_settings import DispatchSettings
from libs.tasks.requests import request_final_status
from services.reconciler.config import DEFAULT_INTERVALS, ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.rules import UnknownEvidence, converge_unknown, parse_intervals


@pytest.mark.parametrize(("run_status", "lease_alive", "verdict"), [
    ("succeeded", False, "succeeded"),
    ("succeeded", True, "succeeded"),
    ("failed", True, "failed"),
    ("failed", False, "failed"),
    (None, False, "aborted"),
    (None, True, "queued"),
])
def test_converge_unknown(run_status: str | None, lease_alive: bool, verdict: str) -> None:
    assert converge_unknown(UnknownEvidence(run_status=run_status, lease_alive=lease_alive)) == verdict


@pytest.mark.parametrize(("requested", "completed", "failed", "final"), [
    (3, 3, 0, "succeeded"),
    (3, 0, 3, "failed"),
    (3, 2, 1, "partial"),
    (3, 2, 0, None),
    (0, 0, 0, None),
    (2, 3, 0, "succeeded"),
])
def test_request_final_status(requested: int, completed: int, failed: int, final: str | None) -> None:
    assert request_final_status(requested, completed, failed) == final


def test_parse_intervals() -> None:
    assert parse_intervals("expired_leases=1, offline_clients=0.5,") == {"expired_leases": 1.0,
                                                                         "offline_clients": 0.5}
    assert parse_intervals("") == {}
    with pytest.raises(ValueError):
        parse_intervals("expired_leases")
    with pytest.raises(ValueError):
        parse_intervals("expired_leases=0")


def test_config_from_env_overrides_only_named_jobs() -> None:
    config = ReconcilerConfig.from_env({"RECONCILER_INTERVALS": "request_ttl=0.5", "RECONCILER_BATCH_SIZE": "7"})
    assert config.intervals["request_ttl"] == 0.5
    assert config.intervals["expired_leases"] == DEFAULT_INTERVALS["expired_leases"]
    assert config.batch_size == 7
    with pytest.raises(ValueError):
        ReconcilerConfig.from_env({"RECONCILER_BATCH_SIZE": "0"})


def test_registry_has_every_job_with_its_interval() -> None:
    assert list(JOBS) == ["expired_leases", "request_ttl", "offline_clients", "interrupt_timeouts",
                          "unknown_executions", "business_day_expiry", "migration_reconcile", "safe_point_tuning",
                          "history_retention"]
    config = ReconcilerConfig()
    settings = DispatchSettings(reconcile_interval_seconds=300)
    for name, job in JOBS.items():
        assert job.name == name and job.description
        expected = 300.0 if name == "migration_reconcile" else DEFAULT_INTERVALS[name]
        assert job.interval(config, settings) == expected
    # §16.2.4 interval is hot-reloaded from dispatch_settings.
    assert JOBS["migration_reconcile"].interval(config, DispatchSettings(reconcile_interval_seconds=5)) == 5.0


def test_retention_settings_come_from_the_environment_and_keep_a_week_of_attempts() -> None:
    config = ReconcilerConfig.from_env({"HISTORY_RETENTION_DAYS": "90", "REQUEST_RETENTION_DAYS": "7",
                                        "RETENTION_BATCH_ROWS": "100", "RETENTION_BATCHES_PER_RUN": "3"})
    assert (config.history_retention_days, config.request_retention_days, config.retention_batch_rows,
            config.retention_batches_per_run) == (90, 7, 100, 3)
    assert ReconcilerConfig.from_env({}).history_retention_days == 35
    with pytest.raises(ValueError, match="HISTORY_RETENTION_DAYS"):
        ReconcilerConfig.from_env({"HISTORY_RETENTION_DAYS": "3"})  # the safe-point tuning reads 7 days of attempts


def test_business_task_retention_keeps_a_year_and_outlives_the_executions() -> None:
    assert ReconcilerConfig.from_env({}).business_task_retention_days == 400
    assert ReconcilerConfig.from_env({"BUSINESS_TASK_RETENTION_DAYS": "90"}).business_task_retention_days == 90
    # Refused at start, never clamped: shorter than the executions' (whose foreign keys keep the task anyway), zero,
    # negative, not a number.
    for bad in ("34", "0", "-1", "a year"):
        with pytest.raises(ValueError, match="BUSINESS_TASK_RETENTION_DAYS"):
            ReconcilerConfig.from_env({"BUSINESS_TASK_RETENTION_DAYS": bad})
    with pytest.raises(ValueError, match="BUSINESS_TASK_RETENTION_DAYS"):
        ReconcilerConfig.from_env({"HISTORY_RETENTION_DAYS": "90", "BUSINESS_TASK_RETENTION_DAYS": "60"})
