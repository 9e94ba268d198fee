"""bench/hub_hops.py: the per-hop breakdown of a probe click that `bench hub_scale` prints (a wrong subtraction or
a mark in the wrong hop would print plausible but wrong figures, so the arithmetic is pinned here)."""

from __future__ import annotations

import math

import pytest

from bench import hub_hops
from bench.hub_hops import HOPS, MARKS


def _click(start: float, gaps_ms: list[float]) -> dict[str, float | None]:
    """Marks in MARKS order, each gap (ms) after the previous one."""
    marks: dict[str, float | None] = {}
    t = start
    for name, gap in zip(MARKS, [0.0, *gaps_ms], strict=True):
        t += gap / 1000
        marks[name] = t
    return marks


def test_the_hops_chain_the_marks_in_order() -> None:
    # Each hop starts where the previous one ended: the table adds up to the click's whole time.
    assert [start for _, start, _ in HOPS] == list(MARKS[:-1])
    assert [end for _, _, end in HOPS] == list(MARKS[1:])


def test_each_hop_is_the_later_mark_minus_the_earlier_in_ms() -> None:
    gaps = [3.0, -1.0, 40.0, 8.0, 2.0, 0.5, 1.5, 5.0]
    spans = hub_hops.hop_spans([_click(1_700_000_000.0, gaps)])
    assert [v[0] for v in spans.values()] == pytest.approx(gaps, abs=1e-3)  # epoch seconds: µs of float error
    assert hub_hops.total_ms(_click(1_700_000_000.0, gaps)) == pytest.approx(sum(gaps))


def test_a_missing_mark_leaves_the_click_out_of_its_two_hops_only() -> None:
    full = _click(100.0, [1, 2, 3, 4, 5, 6, 7, 8])
    by_full_pass = {**_click(200.0, [10, 20, 30, 40, 50, 60, 70, 80]), "pass_started": None, "committed": None}
    spans = hub_hops.hop_spans([full, by_full_pass])
    counts = {label: len(v) for label, v in spans.items()}
    assert counts == {"click -> 202 (collect-now request)": 2, "202 -> coordinator woken (NOTIFY)": 2,
                      "woken -> high pass started (the dispatch loop busy)": 1,
                      "high pass started -> committed": 1, "committed -> relay published (broker confirm)": 1,
                      "published -> at the broker's tap queue": 2,
                      "at the broker -> task_available on the socket (hub)": 2, "on the socket -> lease in hand": 2}
    assert spans["woken -> high pass started (the dispatch loop busy)"] == [pytest.approx(3.0)]


def test_rows_give_p50_and_p99_per_hop_and_the_whole() -> None:
    # 100 clicks: the hub hop takes 1..100 ms, everything else 1 ms.
    clicks = [_click(float(i), [1, 0, 1, 1, 1, 1, float(i), 1]) for i in range(1, 101)]
    rows = {label: (n, p50, p99) for label, n, p50, p99 in hub_hops.hop_rows(clicks)}
    n, p50, p99 = rows["at the broker -> task_available on the socket (hub)"]
    assert n == 100 and p50 == pytest.approx(51.0) and p99 == pytest.approx(99.0)
    assert rows["click -> 202 (collect-now request)"][1:] == (pytest.approx(1.0), pytest.approx(1.0))
    n, p50, p99 = rows["click -> lease in hand (all hops)"]
    assert n == 100 and p50 == pytest.approx(57.0) and p99 == pytest.approx(105.0)


def test_shares_rank_the_hops_by_their_part_of_the_time_and_sum_to_one() -> None:
    clicks = [_click(0.0, [1, 0, 60, 4, 5, 0, 20, 10]), _click(10.0, [1, 0, 140, 4, 5, 0, 20, 10])]
    parts = hub_hops.shares(clicks)
    assert parts[0] == ("woken -> high pass started (the dispatch loop busy)", pytest.approx(200 / 280))
    assert parts[1] == ("at the broker -> task_available on the socket (hub)", pytest.approx(40 / 280))
    assert math.fsum(share for _, share in parts) == pytest.approx(1.0)


def test_shares_count_only_complete_clicks() -> None:
    incomplete = {**_click(0.0, [1, 1, 1000, 1, 1, 1, 1, 1]), "at_broker": None}
    assert hub_hops.shares([incomplete]) == []
    parts = dict(hub_hops.shares([incomplete, _click(5.0, [1, 0, 1, 1, 1, 1, 1, 4])]))
    assert parts["on the socket -> lease in hand"] == pytest.approx(0.4)


def test_slowest_ranks_by_the_whole_click_and_marks_missing_hops() -> None:
    fast, slow = _click(0.0, [1] * 8), {**_click(5.0, [1, 1, 300, 1, 1, 1, 1, 1]), "committed": None}
    (first_total, first_hops), (second_total, _) = hub_hops.slowest([fast, slow], 3)
    assert first_total == pytest.approx(307.0) and second_total == pytest.approx(8.0)
    assert first_hops[2] == pytest.approx(300.0) and first_hops[3] is None and first_hops[4] is None


def test_lag_summary() -> None:
    lag = hub_hops.lag_summary([float(i) for i in range(1, 101)])
    assert lag == {"n": 100.0, "p50": 51.0, "p99": 99.0, "max": 100.0}
    assert math.isnan(hub_hops.lag_summary([])["p99"])
