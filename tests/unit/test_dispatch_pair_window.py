"""A full pass's candidate reads follow its budget, not the number of pairs with work: a window of the pairs per pass,
each pair's read cut to a fair share, the window moving on round-robin from pass to pass."""

from __future__ import annotations

from collections import Counter

from libs.domain.dispatch import PairRead, pair_read_window


def _reads(tenants: int, platforms: int = 3, k: int = 50) -> list[PairRead]:
    return [PairRead(t, p, k) for t in range(1, tenants + 1) for p in range(1, platforms + 1)]


def test_a_few_pairs_are_all_read_every_pass_up_to_their_k() -> None:
    reads = [PairRead(1, 1, 5), PairRead(1, 2, 3), PairRead(2, 1, 12)]
    window, cursor = pair_read_window(reads, None, 1_000)
    assert window == reads and cursor == (2, 1)
    again, _ = pair_read_window(reads, cursor, 1_000)
    assert sorted(again, key=lambda r: r.pair) == reads


def test_the_rows_read_stay_near_the_budget_whatever_the_number_of_pairs() -> None:
    for tenants in (10, 100, 1_000, 10_000):
        window, _ = pair_read_window(_reads(tenants), None, 1_000)
        rows = sum(r.k for r in window)
        assert 1_000 <= rows <= 1_000 + 50, (tenants, rows)
        assert len(window) <= 3 * tenants


def test_the_window_goes_round_robin_over_every_pair() -> None:
    reads = _reads(1_000)
    cursor = None
    seen: Counter[tuple[int, int]] = Counter()
    passes = 0
    while len(seen) < len(reads):
        window, cursor = pair_read_window(reads, cursor, 1_000)
        seen.update(r.pair for r in window)
        passes += 1
    assert passes == 9  # 3,000 pairs, 333 a pass (1,000 rows, 3 each)
    assert max(seen.values()) - min(seen.values()) <= 1  # nobody read twice before everyone once
    # it wraps around: the pass after the last pair starts again at the first
    window, _ = pair_read_window(reads, reads[-1].pair, 1_000)
    assert window[0] == PairRead(1, 1, 3)


def test_no_budget_reads_nothing_and_keeps_the_cursor() -> None:
    assert pair_read_window(_reads(5), (2, 1), 0) == ([], (2, 1))
    assert pair_read_window([], (2, 1), 100) == ([], (2, 1))
