"""Auto slow-down of the write path (docs/architecture.md §12.4): pause normal dispatch, keep high, resume when healthy.

Signals: ingest lag (age of the oldest result received but not applied), projection lag (age of the
oldest pending projection rebuild), p95 latency of the coordinator's own write transactions and the
share of them that failed on a conflict (unique violation, serialization failure, deadlock, lock timeout).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Signals:
    ingest_lag_ms: float = 0.0
    projection_lag_ms: float = 0.0
    write_p95_ms: float = 0.0
    conflict_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class Thresholds:
    ingest_lag_ms: float = 30_000
    projection_lag_ms: float = 60_000
    write_p95_ms: float = 500
    conflict_rate: float = 0.05


def slowdown_reasons(signals: Signals, thresholds: Thresholds) -> list[str]:
    """Which signals are over their threshold (empty = healthy)."""
    reasons = []
    if signals.ingest_lag_ms > thresholds.ingest_lag_ms:
        reasons.append("ingest_lag")
    if signals.projection_lag_ms > thresholds.projection_lag_ms:
        reasons.append("projection_lag")
    if signals.write_p95_ms > thresholds.write_p95_ms:
        reasons.append("db_write_latency")
    if signals.conflict_rate > thresholds.conflict_rate:
        reasons.append("conflict_rate")
    return reasons


class WriteStats:
    """Rolling window of write transactions: latency p95 and conflict rate over the last `window_s`.

    Fewer than `min_samples` transactions in the window report zero (a single slow commit after an
    idle period must not pause dispatch).
    """

    def __init__(self, window_s: float = 60.0, min_samples: int = 20, max_samples: int = 5000) -> None:
        self._window = window_s
        self._min = min_samples
        self._samples: deque[tuple[float, float, bool]] = deque(maxlen=max_samples)

    def record(self, at: float, duration_ms: float, conflicted: bool) -> None:
        self._samples.append((at, duration_ms, conflicted))

    def _recent(self, now: float) -> list[tuple[float, float, bool]]:
        while self._samples and self._samples[0][0] < now - self._window:
            self._samples.popleft()
        return list(self._samples)

    def p95_ms(self, now: float) -> float:
        recent = [d for _, d, _ in self._recent(now)]
        if len(recent) < self._min:
            return 0.0
        recent.sort()
        return recent[max(0, math.ceil(0.95 * len(recent)) - 1)]

    def counts(self, now: float) -> tuple[int, int]:
        """(transactions, conflicted ones) in the window, reported whatever their number."""
        recent = self._recent(now)
        return len(recent), sum(1 for _, _, c in recent if c)

    def conflict_rate(self, now: float) -> float:
        recent = self._recent(now)
        if len(recent) < self._min:
            return 0.0
        return sum(1 for _, _, c in recent if c) / len(recent)
