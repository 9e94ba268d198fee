"""The aging round's limit at the dispatch pace (libs/domain/aging.py AgingPace, docs/architecture.md §9.4)."""

from __future__ import annotations

import itertools

import pytest

from libs.domain.aging import AgingPace

FLOOR, CEILING = 500, 20_000


def test_the_limit_is_twice_the_dispatches_and_grows_with_them() -> None:
    limits = [AgingPace(floor=FLOOR).limit(dispatched, CEILING) for dispatched in (200, 1_000, 4_000, 8_000)]
    assert limits == [500, 2_000, 8_000, 16_000]  # 200 * 2 is below the floor
    pace = AgingPace(floor=FLOOR)
    steady = [pace.limit(2_500, CEILING) for _ in range(5)]
    assert steady == [5_000] * 5  # a steady rate: the average is the rate


@pytest.mark.parametrize("dispatched", [0, -3, 1, 249, 250])
def test_never_below_the_floor(dispatched: int) -> None:
    pace = AgingPace(floor=FLOOR)
    assert [pace.limit(dispatched, CEILING) for _ in range(3)] == [FLOOR] * 3


def test_never_above_the_ceiling_nor_below_the_floor_when_the_ceiling_is() -> None:
    pace = AgingPace(floor=FLOOR)
    assert pace.limit(1_000_000, CEILING) == CEILING
    assert pace.limit(1_000_000, 3_000) == 3_000  # the ceiling follows the budget of the moment
    assert AgingPace(floor=FLOOR).limit(1_000_000, 100) == FLOOR  # a round always covers one batch


def test_the_average_remembers_a_burst() -> None:
    pace = AgingPace(floor=FLOOR)
    assert pace.limit(500, CEILING) == 1_000
    assert pace.limit(10_000, CEILING) == 20_000  # the burst itself: its own count
    after = [pace.limit(500, CEILING) for _ in range(4)]
    # the average: 0.3 * 10,000 + 0.7 * 500 = 3,350 after the burst, then 0.3 * 500 + 0.7 * 3,350 = 2,495, ...:
    # twice that, decaying
    assert after == [4_990, 3_793, 2_956, 2_369]
    assert all(a > b for a, b in itertools.pairwise(after))
    for _ in range(40):
        last = pace.limit(500, CEILING)
    assert 1_000 <= last <= 1_001  # and forgets it once the rate stays low (the average only tends to 500)
