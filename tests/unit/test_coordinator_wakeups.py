"""Which lifecycle events wake which dispatch pass (no I/O: the coordinator's dispatch loop and event handler, with
a fake dispatcher, fixed settings and a clock the test moves)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from libs.contracts.amqp import LifecycleEvent
from libs.dispatch_settings import DispatchSettings
from libs.domain.lanes import SCHEDULED_LANE
from libs.domain.slowdown import WriteStats
from libs.mq.topology import Topology
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig
from services.dispatch_coordinator.dispatcher import PassOutcome
from services.dispatch_coordinator.pending_pairs import PendingPairs
from tests.support.clock import FakeClock
from tests.support.wait import eventually


class _Message:
    def __init__(self, event: str, tenant_id: int = 1) -> None:
        self.body = msgspec.json.encode(LifecycleEvent(event=event, tenant_id=tenant_id,  # type: ignore[arg-type]
                                                       occurred_at=datetime.now(UTC)))
        self.acked = False
        self.multiple = False

    async def ack(self, multiple: bool = False) -> None:
        self.acked, self.multiple = True, multiple


class _FakeDispatcher:
    """Counts passes; the high pass dispatches `high_dispatched` of `high_considered` candidates. The pending pairs
    are the real ones, read from rows the test gives (`read_pairs`)."""

    def __init__(self, clock: FakeClock, high_considered: int = 1, high_dispatched: int = 1) -> None:
        self.high = (high_considered, high_dispatched)
        self.high_passes = 0
        self.full_passes = 0
        self.full_batch_passes = 0  # how many full passes (the first ones) report a full batch
        self.full_dispatched = (0, 0)  # what each full pass dispatches: (tasks, of them high)
        self.pending = PendingPairs(None, clock=clock)  # type: ignore[arg-type]  # read by `read_pairs` only
        self.high_waiting: Any = None
        self.slowdown = False
        self.cluster_high_backlog = 0
        self.tenant_normal_backlog: dict[int, int] = {}
        self.write_stats = WriteStats()
        self.passes = 0

    async def run_high_pass(self, settings: DispatchSettings) -> PassOutcome:
        self.high_passes += 1
        return PassOutcome(considered=self.high[0], dispatched=self.high[1], high_dispatched=self.high[1])

    async def run_pass(self, settings: DispatchSettings) -> PassOutcome:
        self.full_passes += 1
        return PassOutcome(seconds_to_next_window=60.0, full_batch=self.full_passes <= self.full_batch_passes,
                           dispatched=self.full_dispatched[0], high_dispatched=self.full_dispatched[1])

    async def drain_relays(self, timeout: float) -> None:
        pass

    @property
    def pairs_read_at(self) -> float:
        return self.pending.read_at

    def has_pending(self, tenant_id: int) -> bool:
        return self.pending.has_pending(tenant_id)

    def add_pairs(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.pending.add(pairs)

    async def read_pairs(self, pairs: set[tuple[int, int]]) -> None:
        """A read of the pending pairs (PendingPairs.refresh) that finds `pairs`."""
        await self.pending.refresh(_PairsConn(pairs))  # type: ignore[arg-type]


@dataclass
class _PairsConn:
    """The one statement PendingPairs.refresh runs, answered with the given pairs."""

    pairs: set[tuple[int, int]]
    rows: list[dict[str, object]] = field(default_factory=list)

    async def execute(self, query: str, params: object = None) -> _PairsConn:
        pairs = sorted(self.pairs)  # a row per lane, its pairs as two arrays (dispatch_reads._PENDING_PAIRS)
        self.rows = [{"lane": SCHEDULED_LANE.name, "tenants": [t for t, _ in pairs], "platforms": [p for _, p in pairs]}
                     ] if pairs else []
        return self

    async def fetchall(self) -> list[dict[str, object]]:
        return self.rows


class _Settings:
    def __init__(self, min_interval_ms: int) -> None:
        self.value = DispatchSettings(dispatch_tick_ms=60_000, dispatch_min_interval_ms=min_interval_ms)

    async def get(self) -> DispatchSettings:
        return self.value


@dataclass
class _Loop:
    coordinator: Coordinator
    dispatcher: _FakeDispatcher
    clock: FakeClock

    async def idle(self) -> None:
        """Until the dispatch loop waits with nothing to wake it but the clock or a new wake-up."""
        await eventually(lambda: self.clock.blocked() == 1, message="the dispatch loop idle")

    async def handle(self, message: _Message) -> None:
        await self.coordinator.handle_lifecycle("dlq", message)  # type: ignore[arg-type]
        await self.idle()


@asynccontextmanager
async def _running(*, min_interval_ms: int = 0, high_considered: int = 1, high_dispatched: int = 1,
                   full_batch_passes: int = 0, listening: bool = False) -> AsyncIterator[_Loop]:
    """A coordinator whose dispatch loop runs (its first full pass done) on a fake dispatcher and a fake clock."""
    clock = FakeClock()
    fake = _FakeDispatcher(clock, high_considered, high_dispatched)
    fake.full_batch_passes = full_batch_passes
    config = CoordinatorConfig(database_url="postgresql://unused", topology=Topology("t.", 4), instance_id="c")
    coordinator = Coordinator(None, config, dispatcher=fake, settings=_Settings(min_interval_ms),  # type: ignore[arg-type]
                              clock=clock)  # the pool: nothing here touches a database
    if listening:
        coordinator.listening.set()
    stop = asyncio.Event()
    task = asyncio.create_task(coordinator.run_dispatch_loop(stop))
    loop = _Loop(coordinator, fake, clock)
    try:
        await eventually(lambda: fake.full_passes >= 1, message="the first full pass")
        yield loop
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


@pytest.mark.parametrize("listening", [True, False])
async def test_collect_now_accepted_wakes_the_high_pass_only_when_its_notify_could_have_been_lost(
        listening: bool) -> None:
    async with _running(listening=listening) as loop:
        await loop.idle()
        message = _Message("collect_now.accepted")
        await loop.handle(message)
        assert message.acked
        assert loop.dispatcher.high_passes == (0 if listening else 1)


async def test_a_completion_wakes_a_full_pass_but_not_the_high_pass() -> None:
    async with _running() as loop:
        await loop.idle()
        await loop.handle(_Message("task.completed"))
        assert loop.dispatcher.full_passes == 2 and loop.dispatcher.high_passes == 0


async def test_a_click_whose_high_work_all_went_runs_no_full_pass_until_something_else_asks() -> None:
    async with _running() as loop:
        fake, coordinator = loop.dispatcher, loop.coordinator
        for n in range(1, 4):
            coordinator.wake_high()
            await eventually(lambda n=n: fake.high_passes == n, message=f"high pass {n}")  # type: ignore[misc]
        await loop.idle()
        assert fake.full_passes == 1
        coordinator.wake()  # a completion
        await eventually(lambda: fake.full_passes == 2, message="the full pass after a completion")


async def test_a_high_pass_that_leaves_work_behind_is_followed_by_a_full_pass() -> None:
    async with _running(high_considered=3, high_dispatched=1) as loop:
        fake = loop.dispatcher
        loop.coordinator.wake_high()
        await eventually(lambda: fake.high_passes == 1 and fake.full_passes == 2, message="high then full pass")


async def test_wake_ups_soon_after_a_full_pass_share_the_next_one_but_a_click_does_not_wait() -> None:
    async with _running(min_interval_ms=60_000) as loop:
        fake, coordinator = loop.dispatcher, loop.coordinator
        for _ in range(5):  # a burst of completions right after the first pass
            coordinator.wake()
        coordinator.wake_high()  # a click is not held back by the spacing
        await eventually(lambda: fake.high_passes == 1, message="the high pass")
        await loop.idle()
        assert fake.full_passes == 1  # the completions wait for the interval, together
        loop.clock.advance(60)  # the spacing runs out: one full pass for the whole burst
        await eventually(lambda: fake.full_passes == 2, message="the full pass after the spacing")
        await loop.idle()
        assert fake.full_passes == 2


async def test_a_full_pass_that_asks_for_another_gets_it_at_once_despite_the_spacing() -> None:
    # A backlog: the first two passes dispatch full batches.
    async with _running(min_interval_ms=60_000, full_batch_passes=2) as loop:
        fake = loop.dispatcher
        await eventually(lambda: fake.full_passes == 3, message="back-to-back passes while batches are full")
        await loop.idle()
        assert fake.full_passes == 3  # then the spacing holds


async def test_a_full_pass_due_right_after_a_click_waits_the_spacing_unless_the_click_left_work() -> None:
    for considered, full_passes in ((1, 1), (3, 3)):  # the clicks' work all went / some was left behind (each)
        async with _running(min_interval_ms=250, high_considered=considered, high_dispatched=1) as loop:
            fake, coordinator = loop.dispatcher, loop.coordinator
            await loop.idle()
            loop.clock.advance(0.3)  # the spacing after the first full pass has run out
            coordinator.wake()  # a completion: a full pass is due
            coordinator.wake_high()  # ... and a click arrives with it
            await eventually(lambda f=fake: f.high_passes == 1, message="the high pass")  # type: ignore[misc]
            coordinator.wake_high()  # a second click: the loop has gone round once more after the first
            await eventually(lambda f=fake: f.high_passes == 2, message="the second high pass")  # type: ignore[misc]
            await loop.idle()
            assert fake.full_passes == full_passes


async def test_a_completion_wakes_no_pass_when_its_tenant_has_nothing_pending() -> None:
    async with _running() as loop:
        fake, coordinator = loop.dispatcher, loop.coordinator
        await loop.idle()

        async def woken(tenant_id: int) -> bool:
            before = fake.full_passes
            await loop.handle(_Message("task.completed", tenant_id))
            return fake.full_passes > before

        assert await woken(1)  # the pending pairs were never read: wake
        await fake.read_pairs({(2, 7)})
        assert not await woken(1)  # tenant 1 has nothing pending
        assert await woken(2)  # tenant 2 has work the freed slot may serve
        fake.add_pairs([(1, 7)])  # the scanner created tasks for tenant 1
        assert await woken(1)
        await fake.read_pairs({(2, 7)})
        coordinator.wake_high()  # a click after the read: its high work may wait for the slot being freed
        await loop.idle()
        assert await woken(1)
        loop.clock.advance(0.01)
        await fake.read_pairs({(2, 7)})  # the next read (which would list that high work)
        assert not await woken(1)


async def test_a_storm_of_client_online_events_is_one_wake_up_and_one_ack() -> None:
    async with _running() as loop:
        passes = loop.dispatcher.full_passes
        storm = [_Message("client.online", tenant_id=n % 7 + 1) for n in range(1000)]
        await loop.coordinator.handle_lifecycle_batch("dlq", storm)  # type: ignore[arg-type]
        await loop.idle()
        assert loop.dispatcher.full_passes == passes + 1
        acked = [m for m in storm if m.acked]
        assert acked == [storm[-1]] and storm[-1].multiple, "one ack settles the batch"


async def test_clients_coming_online_wake_no_pass_when_their_tenants_have_nothing_pending() -> None:
    async with _running() as loop:
        fake = loop.dispatcher
        await loop.idle()
        await fake.read_pairs({(2, 7)})
        passes = fake.full_passes
        storm = [_Message("client.online", tenant_id=1) for _ in range(500)]
        await loop.coordinator.handle_lifecycle_batch("dlq", storm)  # type: ignore[arg-type]
        await loop.idle()
        assert fake.full_passes == passes, "a storm of a tenant with nothing pending costs no pass"
        await loop.handle(_Message("client.online", tenant_id=2))
        assert fake.full_passes == passes + 1, "a client of a tenant with pending work may take it"


async def test_aging_goes_at_the_pace_of_what_the_full_passes_dispatched_below_high() -> None:
    async with _running() as loop:
        fake, coordinator = loop.dispatcher, loop.coordinator
        settings = DispatchSettings(cluster_dispatch_per_minute=20_000)  # the budget's limit: 20,000 a round
        await loop.idle()
        assert coordinator.aging_limit(settings) == 500  # nothing dispatched yet: one batch
        fake.full_dispatched = (2_100, 100)  # 2,000 of each pass's 2,100 below high
        for n in range(3):
            coordinator.wake()
            await eventually(lambda n=n: fake.full_passes == n + 2, message=f"full pass {n + 2}")  # type: ignore[misc]
        coordinator.wake_high()  # a click's high pass: not aging's business
        await eventually(lambda: fake.high_passes == 1, message="the high pass")
        await loop.idle()
        assert coordinator.aging_limit(settings) == 2 * 6_000
        # Nothing since: the moving average (0.7 * (0.3 * 6,000) after the first round's 0) still counts.
        assert coordinator.aging_limit(settings) == 2 * math.ceil(0.7 * 0.3 * 6_000) == 2_520
        assert coordinator.aging_limit(DispatchSettings(cluster_dispatch_per_minute=600)) == 600  # the ceiling
