"""The pending pairs per lane (services/dispatch_coordinator/pending_pairs.py): a full pass walks, in each lane, the
pairs with work in that lane only, so one lane's many pairs do not hide another's few; the scanner's new work is
scheduled work; every lane's pairs still answer "has this tenant pending work"."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.domain.dispatch import pair_read_window
from libs.domain.lanes import CLICK_LANE, RETRY_LANE, SCHEDULED_LANE, monitor_lane
from services.dispatch_coordinator.pending_pairs import PendingPairs
from tests.support.clock import FakeClock

NORMAL, RETRY = SCHEDULED_LANE.name, RETRY_LANE.name


@dataclass
class _LanePairsConn:
    """The one statement PendingPairs.refresh runs, answered as it answers: a row per lane, its (tenant, platform)
    pairs as two arrays."""

    rows: list[tuple[int, int, str]]
    answered: list[dict[str, object]] = field(default_factory=list)

    async def execute(self, query: str, params: object = None) -> _LanePairsConn:
        lanes: dict[str, list[tuple[int, int]]] = {}
        for t, p, lane in self.rows:
            lanes.setdefault(lane, []).append((t, p))
        self.answered = [{"lane": lane, "tenants": [t for t, _ in pairs], "platforms": [p for _, p in pairs]}
                         for lane, pairs in lanes.items()]
        return self

    async def fetchall(self) -> list[dict[str, object]]:
        return self.answered


def _pending() -> PendingPairs:
    return PendingPairs(None, clock=FakeClock())  # type: ignore[arg-type]  # no pool: refresh is given its conn


async def test_each_lane_lists_the_pairs_with_work_in_it() -> None:
    pending = _pending()
    rows = [(t, p, NORMAL) for t in range(1, 1_001) for p in (1, 2, 3)] + [(1_000, 2, RETRY), (7, 1, CLICK_LANE.name)]
    await pending.refresh(_LanePairsConn(rows))  # type: ignore[arg-type]
    assert pending.sorted_lane_pairs(RETRY) == [(1_000, 2)]
    assert pending.sorted_lane_pairs(CLICK_LANE.name) == [(7, 1)]
    assert len(pending.sorted_lane_pairs(NORMAL)) == 3_000
    assert pending.sorted_lane_pairs(monitor_lane(NORMAL).ages_into or NORMAL) == []  # no boosted work
    assert len(pending.pairs) == 3_000 and pending.has_pending(1_000) and not pending.has_pending(1_001)


async def test_a_lane_with_one_pair_is_read_in_the_first_window_whatever_the_other_lanes_hold() -> None:
    pending = _pending()
    rows = [(t, p, NORMAL) for t in range(1, 10_001) for p in (1, 2, 3)] + [(10_000, 3, RETRY)]
    await pending.refresh(_LanePairsConn(rows))  # type: ignore[arg-type]
    window, _, visited = pair_read_window(pending.sorted_lane_pairs(RETRY), None, 10, lambda t, p: 5)
    assert [(r.tenant_id, r.ai_platform_id) for r in window] == [(10_000, 3)] and visited == 1
    # Over the pairs of every lane (as before), the same window visits the first pairs of the scheduled work: the
    # retry pair is 29,999 visits away.
    every = sorted(pending.pairs)
    window, _, _ = pair_read_window(every, None, 10, lambda t, p: 5)
    assert (10_000, 3) not in [(r.tenant_id, r.ai_platform_id) for r in window]


async def test_the_scanners_new_work_is_scheduled_work_and_outlives_a_refresh_in_flight() -> None:
    pending = _pending()
    await pending.refresh(_LanePairsConn([(1, 1, RETRY)]))  # type: ignore[arg-type]
    pending.add([(2, 1)])
    assert pending.sorted_lane_pairs(NORMAL) == [(2, 1)] and pending.sorted_lane_pairs(RETRY) == [(1, 1)]
    assert pending.has_pending(2)

    class _AddsWhileReading(_LanePairsConn):
        async def fetchall(self) -> list[dict[str, object]]:
            pending.add([(3, 2)])  # the scanner created work while the re-read was in flight
            return self.answered

    await pending.refresh(_AddsWhileReading([(1, 1, RETRY)]))  # type: ignore[arg-type]
    assert pending.sorted_lane_pairs(NORMAL) == [(3, 2)]  # (2, 1) was not found again: its work went out
    assert pending.pairs == {(1, 1), (3, 2)}
