"""Which lifecycle events wake which dispatch pass (no I/O: the coordinator's event handler alone)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import msgspec
import pytest

from libs.contracts.amqp import LifecycleEvent
from libs.mq.topology import Topology
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig
from tests.support.wait import eventually


class _Message:
    def __init__(self, event: str) -> None:
        self.body = msgspec.json.encode(LifecycleEvent(event=event, tenant_id=1,  # type: ignore[arg-type]
                                                       occurred_at=datetime.now(UTC)))
        self.acked = False

    async def ack(self) -> None:
        self.acked = True


def _coordinator() -> Coordinator:
    config = CoordinatorConfig(database_url="postgresql://unused", topology=Topology("t.", 4), instance_id="c")
    return Coordinator(None, config)  # type: ignore[arg-type]  # the handler touches no database


@pytest.mark.parametrize("listening", [True, False])
async def test_collect_now_accepted_wakes_the_high_pass_only_when_its_notify_could_have_been_lost(
        listening: bool) -> None:
    coordinator = _coordinator()
    if listening:
        coordinator.listening.set()
    message = _Message("collect_now.accepted")
    await coordinator._on_lifecycle("dlq", message)
    assert message.acked
    assert coordinator._high_wake.is_set() is (not listening)


async def test_a_completion_wakes_a_full_pass_but_not_the_high_pass() -> None:
    coordinator = _coordinator()
    message = _Message("task.completed")
    await coordinator._on_lifecycle("dlq", message)
    assert coordinator._wake.is_set() and not coordinator._high_wake.is_set()


class _FakeDispatcher:
    """Counts passes; the high pass dispatches `high_dispatched` of `high_considered` candidates."""

    def __init__(self, high_considered: int, high_dispatched: int) -> None:
        from services.dispatch_coordinator.dispatcher import PassOutcome

        self.outcome = PassOutcome
        self.high = (high_considered, high_dispatched)
        self.high_passes = 0
        self.full_passes = 0
        self.full_batch_passes = 0  # how many full passes (the first ones) report a full batch

    async def run_high_pass(self, settings: object) -> object:
        self.high_passes += 1
        return self.outcome(considered=self.high[0], dispatched=self.high[1], high_dispatched=self.high[1])

    async def run_pass(self, settings: object) -> object:
        self.full_passes += 1
        return self.outcome(seconds_to_next_window=60.0, full_batch=self.full_passes <= self.full_batch_passes)


async def _run_loop(fake: _FakeDispatcher, *, min_interval_ms: int = 0) -> (
        tuple[Coordinator, asyncio.Task[None], asyncio.Event]):
    from libs.dispatch_settings import DispatchSettings

    coordinator = _coordinator()
    coordinator.dispatcher = fake  # type: ignore[assignment]

    async def settings(stop: asyncio.Event) -> DispatchSettings:
        return DispatchSettings(dispatch_tick_ms=60_000, dispatch_min_interval_ms=min_interval_ms)

    coordinator._guarded_settings = settings  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(coordinator._dispatch_loop(stop))
    await eventually(lambda: fake.full_passes >= 1, message="the first full pass")
    return coordinator, task, stop


async def test_a_click_whose_high_work_all_went_runs_no_full_pass_until_something_else_asks() -> None:
    fake = _FakeDispatcher(high_considered=1, high_dispatched=1)
    coordinator, task, stop = await _run_loop(fake)
    for n in range(1, 4):
        coordinator.wake_high()
        await eventually(lambda n=n: fake.high_passes == n, message=f"high pass {n}")  # type: ignore[misc]
    assert fake.full_passes == 1
    coordinator.wake()  # a completion
    await eventually(lambda: fake.full_passes == 2, message="the full pass after a completion")
    stop.set()
    coordinator.wake()
    await asyncio.wait_for(task, 5)


async def test_a_high_pass_that_leaves_work_behind_is_followed_by_a_full_pass() -> None:
    fake = _FakeDispatcher(high_considered=3, high_dispatched=1)
    coordinator, task, stop = await _run_loop(fake)
    coordinator.wake_high()
    await eventually(lambda: fake.high_passes == 1 and fake.full_passes == 2, message="high then full pass")
    stop.set()
    coordinator.wake()
    await asyncio.wait_for(task, 5)


async def test_wake_ups_soon_after_a_full_pass_share_the_next_one_but_a_click_does_not_wait() -> None:
    fake = _FakeDispatcher(high_considered=1, high_dispatched=1)
    coordinator, task, stop = await _run_loop(fake, min_interval_ms=60_000)
    for _ in range(5):  # a burst of completions right after the first pass
        coordinator.wake()
    coordinator.wake_high()  # a click is not held back by the spacing
    await eventually(lambda: fake.high_passes == 1, message="the high pass")
    assert fake.full_passes == 1  # the completions wait for the interval, together
    stop.set()
    coordinator.wake()
    await asyncio.wait_for(task, 5)


async def test_a_full_pass_that_asks_for_another_gets_it_at_once_despite_the_spacing() -> None:
    fake = _FakeDispatcher(high_considered=1, high_dispatched=1)
    fake.full_batch_passes = 2  # a backlog: the first two passes dispatch full batches
    coordinator, task, stop = await _run_loop(fake, min_interval_ms=60_000)
    await eventually(lambda: fake.full_passes == 3, message="back-to-back passes while batches are full")
    stop.set()
    coordinator.wake()
    await asyncio.wait_for(task, 5)


async def test_a_full_pass_due_right_after_a_click_waits_the_spacing_unless_the_click_left_work() -> None:
    for considered, full_passes in ((1, 1), (3, 3)):  # the clicks' work all went / some was left behind (each)
        fake = _FakeDispatcher(high_considered=considered, high_dispatched=1)
        coordinator, task, stop = await _run_loop(fake, min_interval_ms=250)
        await asyncio.sleep(0.3)  # the spacing after the first full pass has run out (time itself is the subject)
        coordinator.wake()  # a completion: a full pass is due
        coordinator.wake_high()  # ... and a click arrives with it
        await eventually(lambda f=fake: f.high_passes == 1, message="the high pass")  # type: ignore[misc]
        coordinator.wake_high()  # a second click: the loop has gone round once more after the first
        await eventually(lambda f=fake: f.high_passes == 2, message="the second high pass")  # type: ignore[misc]
        assert fake.full_passes == full_passes
        stop.set()
        coordinator.wake()
        await asyncio.wait_for(task, 5)


async def test_a_completion_wakes_no_pass_when_its_tenant_has_nothing_pending() -> None:
    coordinator = _coordinator()
    dispatcher = coordinator.dispatcher

    async def woken(tenant_id: int) -> bool:
        coordinator._wake.clear()
        message = _Message("task.completed")
        message.body = msgspec.json.encode(LifecycleEvent(event="task.completed", tenant_id=tenant_id,
                                                          occurred_at=datetime.now(UTC)))
        await coordinator._on_lifecycle("dlq", message)
        return coordinator._wake.is_set()

    assert await woken(1)  # the pending pairs were never read: wake
    dispatcher.pairs = {(2, 7)}
    dispatcher.pending.read_at = time.monotonic()
    assert not await woken(1)  # tenant 1 has nothing pending
    assert await woken(2)  # tenant 2 has work the freed slot may serve
    dispatcher.add_pairs([(1, 7)])  # the scanner created tasks for tenant 1
    assert await woken(1)
    dispatcher.pairs = {(2, 7)}
    coordinator.wake_high()  # a click after the read: its high work may wait for the slot being freed
    assert await woken(1)
    dispatcher.pending.read_at = time.monotonic()  # the next read (which would list that high work)
    assert not await woken(1)
