"""Reconciler-only configuration from the environment (12-factor); thresholds are hot-reloaded
from `dispatch_settings` / `platform_settings`, these only shape how often the jobs run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.reconciler.rules import parse_intervals

# Seconds between runs of each short job (docs/architecture.md §8.2, §10.5, §10.6: "every few seconds").
# `migration_reconcile` follows dispatch_settings.reconcile_interval_seconds (§16.2.4) instead.
DEFAULT_INTERVALS: dict[str, float] = {
    "expired_leases": 5.0,
    "request_ttl": 5.0,
    "offline_clients": 5.0,
    "interrupt_timeouts": 2.0,
    "unknown_executions": 10.0,
    "business_day_expiry": 60.0,
    "safe_point_tuning": 60.0,
    "history_retention": 300.0,
}


@dataclass(frozen=True, slots=True)
class ReconcilerConfig:
    intervals: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_INTERVALS))
    # Rows handled per run of one job (each row in its own short transaction).
    batch_size: int = 500
    # History retention (jobs/history_retention.py): finished executions, their attempts and finished legacy leases
    # older than `history_retention_days`, finished collect-now requests older than `request_retention_days`, deleted
    # `retention_batch_rows` per table and transaction, at most `retention_batches_per_run` transactions a run; finished
    # business tasks of a business date older than `business_task_retention_days` (a year and a margin: a
    # year-over-year look at a task stays possible) once no execution or legacy lease refers to them.
    history_retention_days: int = 35
    request_retention_days: int = 35
    business_task_retention_days: int = 400
    retention_batch_rows: int = 2_000
    retention_batches_per_run: int = 50

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ReconcilerConfig:
        """`RECONCILER_INTERVALS="expired_leases=1,offline_clients=1"`, `RECONCILER_BATCH_SIZE`, and the retention's
        `HISTORY_RETENTION_DAYS`, `REQUEST_RETENTION_DAYS`, `BUSINESS_TASK_RETENTION_DAYS`, `RETENTION_BATCH_ROWS`,
        `RETENTION_BATCHES_PER_RUN`. A value out of range (or not a number) is refused: the service does not start."""
        source = os.environ if env is None else env
        intervals = dict(DEFAULT_INTERVALS)
        intervals.update(parse_intervals(source.get("RECONCILER_INTERVALS", "")))
        batch = int(source.get("RECONCILER_BATCH_SIZE", "500"))
        if batch <= 0:
            raise ValueError("RECONCILER_BATCH_SIZE must be positive")
        defaults = cls()
        retention: dict[str, int] = {}
        for name in ("history_retention_days", "request_retention_days", "business_task_retention_days",
                     "retention_batch_rows", "retention_batches_per_run"):
            raw = source.get(name.upper(), str(getattr(defaults, name)))
            try:
                retention[name] = int(raw)
            except ValueError:
                raise ValueError(f"{name.upper()} must be a whole number, not {raw!r}") from None
        # The safe-point tuning looks back a week over attempts (safe_point_window_days' default): keep more.
        for name, least in (("history_retention_days", 8), ("request_retention_days", 1), ("retention_batch_rows", 1),
                            ("retention_batches_per_run", 1)):
            if retention[name] < least:
                raise ValueError(f"{name.upper()} must be at least {least}")
        # A business task outlives its executions and legacy leases (their foreign keys): with a shorter retention it
        # would wait for theirs anyway, and the docs' figures would not hold.
        if retention["business_task_retention_days"] < retention["history_retention_days"]:
            raise ValueError("BUSINESS_TASK_RETENTION_DAYS must be at least HISTORY_RETENTION_DAYS "
                             f"({retention['history_retention_days']})")
        return cls(intervals=intervals, batch_size=batch, **retention)
