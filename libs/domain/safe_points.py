"""Interrupt timeouts from measured safe points (the adaptive timeout policy of docs/architecture.md §10.5).

A desktop may only yield at safe points (before opening the page, before typing, before submitting, after the
raw answer, at the end), so how long an interrupt takes depends on how far apart a platform's safe points are.
Every hub replica records the intervals clients report (`safe_point_interval_ms` on extend and cancel) as hourly
histograms per platform (`safe_point_histogram`, buckets below). The reconciler's `safe_point_tuning` job reads
the last `safe_point_window_days` of them, stores each platform's P95, and for platforms marked dynamic
(`platform_settings.timeouts_dynamic`) sets, at most every `interrupt_tuning_interval_seconds` (a week by
default) and only with at least `safe_point_min_samples` samples:

    soft = max(P95 x 1.5, 15 s)        hard = soft x 3

The coordinator (no new normal past soft) and the reconciler (force-cancel past hard) read platform_settings on
every pass and tick: the new values are in effect within seconds, without a restart.

Dynamic is the default for a platform without fixed values (migration 062). The P95 that tunes a platform is robust
to any one client: the hubs record each client's intervals apart, each client with at least
`safe_point_min_client_samples` samples gets its own P95, and the platform's is the median of those (`robust_p95`),
taken only from `safe_point_min_clients` clients or more. A client reporting absurd intervals (broken, or hostile)
moves the median at most to the next client's P95, however many samples it sends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# Upper bounds of the histogram buckets (ms); the last catches everything longer.
BUCKETS_MS: tuple[int, ...] = (250, 500, 1000, 2000, 3000, 5000, 8000, 10_000, 15_000, 20_000, 30_000, 45_000,
                               60_000, 90_000, 120_000, 180_000, 300_000, 2_147_483_647)
MIN_SOFT_TIMEOUT_MS = 15_000
SOFT_FACTOR = 1.5
HARD_FACTOR = 3


def bucket_of(interval_ms: float) -> int:
    """The upper bound of the bucket an interval falls in (the last bucket's for anything longer: a client may
    report any interval up to 2**63 - 1 ms)."""
    return next((le for le in BUCKETS_MS if interval_ms <= le), BUCKETS_MS[-1])


def p95_from_histogram(buckets: Iterable[tuple[int, int]]) -> float | None:
    """P95 of (upper bound, count) buckets, interpolated linearly inside the bucket it falls in; None when
    empty. The open last bucket counts as its lower bound (the longest bounded one)."""
    rows = sorted((le, n) for le, n in buckets if n > 0)
    total = sum(n for _, n in rows)
    if total == 0:
        return None
    target = 0.95 * total
    seen = 0
    for le, n in rows:
        lower = _lower_bound(le)
        if seen + n >= target:
            if le == BUCKETS_MS[-1]:
                return float(lower)
            return lower + (le - lower) * (target - seen) / n
        seen += n
    return float(_lower_bound(rows[-1][0]))


def robust_p95(per_client: dict[object, list[tuple[int, int]]], *, min_client_samples: int,
               min_clients: int) -> tuple[float, int, int] | None:
    """(P95, samples, clients) from per-client histograms: the median of the P95s of the clients with at least
    `min_client_samples` samples (the lower median for an even count: a timeout errs short, the hard timeout
    still backs it), over at least `min_clients` such clients; None with fewer."""
    p95s: list[float] = []
    samples = 0
    for buckets in per_client.values():
        n = sum(count for _, count in buckets)
        if n >= max(1, min_client_samples):
            p95 = p95_from_histogram(buckets)
            if p95 is not None:
                p95s.append(p95)
                samples += n
    if len(p95s) < max(1, min_clients):
        return None
    p95s.sort()
    return p95s[(len(p95s) - 1) // 2], samples, len(p95s)


def _lower_bound(le: int) -> int:
    index = BUCKETS_MS.index(le) if le in BUCKETS_MS else next(i for i, b in enumerate(BUCKETS_MS) if b >= le)
    return BUCKETS_MS[index - 1] if index > 0 else 0


def tuned_timeouts(p95_ms: float) -> tuple[int, int]:
    """(soft, hard) interrupt timeouts for a platform whose safe points are `p95_ms` apart at P95."""
    soft = max(MIN_SOFT_TIMEOUT_MS, math.ceil(p95_ms * SOFT_FACTOR))
    return soft, soft * HARD_FACTOR
