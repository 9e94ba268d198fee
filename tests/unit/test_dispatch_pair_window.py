"""A full pass's candidate reads follow its budget, not the number of pairs with work: a window of the pairs per pass,
each pair's read cut to a fair share, the window moving on round-robin from pass to pass, and only the pairs it visits
asked how much they could use; walked in stretches (the pass reads a stretch's clients first), the same window."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

from libs.domain.dispatch import PairRead, pair_read_window, pair_window_share, pairs_after


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


def _walk_in_stretches(pairs: list[tuple[int, int]], after: tuple[int, int] | None, budget_rows: int,
                       k_of: Callable[[int, int], int], max_visits: int, stretch: int,
                       share: int | None) -> tuple[list[PairRead], tuple[int, int] | None, int]:
    """A window walked as the full pass walks it (services/dispatch_coordinator/dispatcher.py `_pair_window`):
    `stretch` pairs at a time, with `share` (None: each stretch its own, the mistake)."""
    window: list[PairRead] = []
    visited = rows = 0
    while visited < max_visits and rows < budget_rows:
        part, after, n = pair_read_window(pairs, after, budget_rows - rows, k_of,
                                          max_visits=min(stretch, max_visits - visited), share=share)
        window.extend(part)
        rows += sum(r.k for r in part)
        visited += n
    return window, after, visited


def test_a_window_walked_in_stretches_picks_what_one_walk_picks() -> None:
    rng = random.Random(7)
    for _ in range(300):
        pairs = _pairs(rng.randint(1, 400), rng.randint(1, 3))
        ks = {p: rng.choice((0, 0, 1, 3, 5, 50)) for p in pairs}
        after = rng.choice([None, *pairs, (10_000, 1)])
        budget = rng.randint(1, 400)
        visits = min(len(pairs), rng.randint(1, 4 * budget))  # as the pass asks: each pair at most once
        def k_of(tenant_id: int, platform_id: int, ks: dict[tuple[int, int], int] = ks) -> int:
            return ks[(tenant_id, platform_id)]

        whole = pair_read_window(pairs, after, budget, k_of, max_visits=visits)
        share = pair_window_share(budget, len(pairs))
        stretch = rng.randint(1, 40)
        assert _walk_in_stretches(pairs, after, budget, k_of, visits, stretch, share) == whole


def test_stretches_each_with_their_own_share_pick_another_window() -> None:
    """The checker above catches the mistake: each stretch recomputing the share from the rows still wanted."""
    pairs = _pairs(4)
    whole = pair_read_window(pairs, None, 24, _fifty)
    assert _walk_in_stretches(pairs, None, 24, _fifty, len(pairs), 2, None) != whole


def test_pairs_after_are_the_next_ones_wrapping_around() -> None:
    pairs = _pairs(3, 1)
    assert pairs_after(pairs, None, 2) == [(1, 1), (2, 1)]
    assert pairs_after(pairs, (2, 1), 2) == [(3, 1), (1, 1)]
    assert pairs_after(pairs, (2, 5), 9) == [(3, 1), (1, 1), (2, 1)]  # a cursor no longer among them; at most all
    assert pairs_after([], None, 3) == []
