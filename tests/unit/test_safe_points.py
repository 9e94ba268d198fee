"""The adaptive interrupt timeouts' arithmetic: buckets, the P95 of a histogram, soft/hard from it."""

from __future__ import annotations

import pytest

from libs.domain.safe_points import BUCKETS_MS, bucket_of, p95_from_histogram, tuned_timeouts


def test_intervals_fall_in_the_bucket_of_their_upper_bound() -> None:
    assert bucket_of(0) == 250 and bucket_of(250) == 250 and bucket_of(251) == 500
    assert bucket_of(10_000_000) == BUCKETS_MS[-1]
    # past the last bound too: the open last bucket (an interval the contract allows, up to 2**63 - 1 ms)
    assert bucket_of(BUCKETS_MS[-1] + 1) == bucket_of(2**63 - 1) == BUCKETS_MS[-1]


def test_p95_interpolates_inside_its_bucket() -> None:
    assert p95_from_histogram([]) is None and p95_from_histogram([(1000, 0)]) is None
    # 100 samples: 90 in (5000, 8000], 10 in (8000, 10000]: the 95th falls half way into the second bucket.
    assert p95_from_histogram([(8000, 90), (10_000, 10)]) == pytest.approx(9000)
    assert p95_from_histogram([(8000, 100)]) == pytest.approx(5000 + 3000 * 0.95)
    # the open last bucket counts as its lower bound (no made-up length)
    assert p95_from_histogram([(1000, 1), (BUCKETS_MS[-1], 99)]) == 300_000


def test_soft_is_one_and_a_half_p95_at_least_15_s_and_hard_three_times_soft() -> None:
    assert tuned_timeouts(8_000) == (15_000, 45_000)
    assert tuned_timeouts(40_000) == (60_000, 180_000)
    assert tuned_timeouts(20_001) == (30_002, 90_006)


def test_the_robust_p95_is_the_median_of_the_clients_p95s() -> None:
    from libs.domain.safe_points import robust_p95

    honest = [(8000, 19), (10_000, 1)]  # each honest client: P95 8000
    flood = [(300_000, 100_000)]  # one client, a hundred thousand absurd reports
    per_client: dict[object, list[tuple[int, int]]] = {"a": honest, "b": honest, "c": honest, "x": flood}
    result = robust_p95(per_client, min_client_samples=20, min_clients=3)
    assert result is not None
    p95, samples, clients = result
    assert p95 == 8000 and clients == 4 and samples == 100_060  # the flood is one vote among four
    # ... while pooling the samples would let it set the timeout for everyone
    assert (p95_from_histogram([b for bs in per_client.values() for b in bs]) or 0) > 180_000
    assert robust_p95({"x": flood, "a": honest}, min_client_samples=20, min_clients=3) is None  # too few clients
    assert robust_p95({"a": honest, "b": honest, "c": [(8000, 5)]}, min_client_samples=20, min_clients=3) is None
