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


@dataclass
class _SlicesConn:
    """The pending pairs' statement answered as Postgres answers it (dispatch_reads._PENDING_PAIRS): the (pair, lane)
    entries from the pair `start` on, in order, at most `limit`; `rows` may change between reads."""

    rows: set[tuple[int, int, str]]
    limits: list[int] = field(default_factory=list)
    answered: list[dict[str, object]] = field(default_factory=list)
    during: list[object] = field(default_factory=list)  # called while the read is in flight

    async def execute(self, query: str, params: dict[str, int]) -> _SlicesConn:
        start = (params["tenant"], params["platform"])
        self.limits.append(params["limit"])
        entries = sorted(e for e in self.rows if (e[0], e[1]) >= start)[:params["limit"]]
        lanes: dict[str, list[tuple[int, int]]] = {}
        for t, p, lane in entries:
            lanes.setdefault(lane, []).append((t, p))
        self.answered = [{"lane": lane, "tenants": [t for t, _ in pairs], "platforms": [p for _, p in pairs]}
                         for lane, pairs in lanes.items()]
        return self

    async def fetchall(self) -> list[dict[str, object]]:
        for call in self.during:
            call()  # type: ignore[operator]
        return self.answered


def _truth(rows: set[tuple[int, int, str]]) -> dict[str, set[tuple[int, int]]]:
    lanes: dict[str, set[tuple[int, int]]] = {}
    for t, p, lane in rows:
        lanes.setdefault(lane, set()).add((t, p))
    return lanes


async def test_background_slices_sweep_every_pair_and_a_sweep_finds_what_changed_anywhere(monkeypatch: object) -> None:
    from services.dispatch_coordinator import pending_pairs as module

    monkeypatch.setattr(module, "SLICE_MIN_ENTRIES", 50)  # type: ignore[attr-defined]
    rows = {(t, p, NORMAL) for t in range(1, 201) for p in (1, 2, 3)} | {(t, 2, RETRY) for t in range(1, 201, 7)}
    conn = _SlicesConn(set(rows))
    pending = _pending()
    await pending.refresh(conn)  # type: ignore[arg-type]
    assert pending.by_lane == _truth(rows) and conn.limits == [2**31 - 1]
    held = pending.sorted_lane_pairs(NORMAL)
    before = list(held)
    read_at = pending.read_at
    # The work of tenant 150 goes out, tenant 20 gets retry work, tenant 201 new work: none of it the scanner's.
    conn.rows = {e for e in rows if e[0] != 150} | {(20, 1, RETRY), (201, 3, NORMAL)}
    slices = 0
    while pending.read_at == read_at:
        pending._clock.advance(2.0)  # type: ignore[attr-defined]
        assert pending.stale
        await pending.refresh_slice(conn)  # type: ignore[arg-type]
        slices += 1
        assert slices <= 20
        assert not pending.stale
    assert pending.read_at > read_at
    # 629 entries at max(50, 629/10) a slice, each cut before the pair its limit fell in: a sweep of 11 slices.
    assert conn.limits[1:] == [63] * slices and slices == 11
    assert pending.by_lane == {lane: _truth(conn.rows).get(lane, set()) for lane in pending.by_lane}
    assert all(pending.sorted_lane_pairs(lane) == sorted(pending.by_lane[lane]) for lane in pending.by_lane)
    assert pending.pairs == {(t, p) for t, p, _ in conn.rows}
    assert not pending.has_pending(150) and pending.has_pending(201)
    assert held == before  # a pass walking the list it was given across the re-reads saw it unchanged


async def test_a_slice_keeps_what_the_scanner_added_while_it_was_in_flight_and_small_sets_are_read_whole() -> None:
    conn = _SlicesConn({(1, 1, RETRY), (5, 1, NORMAL)})
    pending = _pending()
    await pending.refresh(conn)  # type: ignore[arg-type]
    conn.during = [lambda: pending.add([(3, 2)])]  # committed after the slice's snapshot: the slice does not see it
    pending._clock.advance(2.0)  # type: ignore[attr-defined]
    read_at = pending.read_at
    await pending.refresh_slice(conn)  # type: ignore[arg-type]
    assert pending.read_at > read_at  # below SLICE_MIN_ENTRIES a slice is a whole read
    assert pending.sorted_lane_pairs(NORMAL) == [(3, 2), (5, 1)] and pending.has_pending(3)
