"""A full pass's candidate reads follow its budget, not the number of pairs with work: a window of the pairs per pass,
each pair's read cut to a fair share, the window moving on round-robin from pass to pass, and only the pairs it visits
asked how much they could use."""

from __future__ import annotations

from collections import Counter

from libs.domain.dispatch import PairRead, pair_read_window


def _pairs(tenants: int, platforms: int = 3) -> list[tuple[int, int]]:
    return [(t, p) for t in range(1, tenants + 1) for p in range(1, platforms + 1)]


def _fifty(tenant_id: int, platform_id: int) -> int:
    return 50


def test_a_few_pairs_are_all_read_every_pass_up_to_their_k() -> None:
    ks = {(1, 1): 5, (1, 2): 3, (2, 1): 12}
    window, cursor, visited = pair_read_window(sorted(ks), None, 1_000, lambda t, p: ks[(t, p)])
    assert window == [PairRead(1, 1, 5), PairRead(1, 2, 3), PairRead(2, 1, 12)]
    assert (cursor, visited) == ((2, 1), 3)
    again, _, _ = pair_read_window(sorted(ks), cursor, 1_000, lambda t, p: ks[(t, p)])
    assert sorted(again, key=lambda r: (r.tenant_id, r.ai_platform_id)) == window


def test_the_rows_read_and_the_pairs_asked_stay_near_the_budget_whatever_the_number_of_pairs() -> None:
    for tenants in (10, 100, 1_000, 10_000):
        asked: list[tuple[int, int]] = []

        def k_of(tenant_id: int, platform_id: int, asked: list[tuple[int, int]] = asked) -> int:
            asked.append((tenant_id, platform_id))
            return 50

        window, _, visited = pair_read_window(_pairs(tenants), None, 1_000, k_of)
        rows = sum(r.k for r in window)
        assert 1_000 <= rows <= 1_000 + 52, (tenants, rows)
        assert len(asked) == visited <= 1_000, (tenants, visited)  # never every one of 30,000 pairs


def test_pairs_without_room_are_skipped_and_the_visits_are_bounded() -> None:
    window, cursor, visited = pair_read_window(_pairs(1_000), None, 100, lambda t, p: 0 if t % 2 else 50,
                                               max_visits=400)
    assert all(r.tenant_id % 2 == 0 for r in window) and sum(r.k for r in window) >= 100
    nothing, cursor, visited = pair_read_window(_pairs(1_000), None, 100, lambda t, p: 0, max_visits=400)
    assert nothing == [] and visited == 400 and cursor == _pairs(1_000)[399]


def test_the_window_goes_round_robin_over_every_pair() -> None:
    pairs = _pairs(1_000)
    cursor = None
    seen: Counter[tuple[int, int]] = Counter()
    passes = 0
    while len(seen) < len(pairs):
        window, cursor, _ = pair_read_window(pairs, cursor, 1_000, _fifty)
        seen.update((r.tenant_id, r.ai_platform_id) for r in window)
        passes += 1
    assert passes == 9  # 3,000 pairs, 334 a pass (1,000 rows, 3 each)
    assert max(seen.values()) - min(seen.values()) <= 1  # nobody read twice before everyone once
    window, _, _ = pair_read_window(pairs, pairs[-1], 1_000, _fifty)  # after the last pair: the first again
    assert window[0] == PairRead(1, 1, 3)


def test_no_budget_reads_nothing_and_keeps_the_cursor() -> None:
    assert pair_read_window(_pairs(5), (2, 1), 0, _fifty) == ([], (2, 1), 0)
    assert pair_read_window([], (2, 1), 100, _fifty) == ([], (2, 1), 0)
