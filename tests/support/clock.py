"""A clock the test moves by hand (libs/clock.py's `Clock`): time passes only in `advance`, and a timed wait
ends only when an event it waits for is set or the clock is advanced past its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta


@dataclass(slots=True)
class _Wait:
    events: Sequence[asyncio.Event]
    deadline: float
    timer: asyncio.Future[None]


class FakeClock:
    def __init__(self, *, monotonic: float = 1000.0, now: datetime = datetime(2024, 1, 1, 12, tzinfo=UTC)) -> None:
        self._monotonic = monotonic
        self._start = monotonic
        self._start_now = now
        self._waits: list[_Wait] = []

    def monotonic(self) -> float:
        return self._monotonic

    def now(self) -> datetime:
        return self._start_now + timedelta(seconds=self._monotonic - self._start)

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass: every wait whose deadline is reached returns (when its task next runs)."""
        assert seconds >= 0, "time does not go back"
        self._monotonic += seconds
        for wait in self._waits:
            if wait.deadline <= self._monotonic and not wait.timer.done():
                wait.timer.set_result(None)

    async def wait(self, events: Sequence[asyncio.Event], timeout: float) -> None:
        timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wait = _Wait(events, self._monotonic + max(0.0, timeout), timer)
        if wait.deadline <= self._monotonic:
            timer.set_result(None)
        waiters = [asyncio.ensure_future(event.wait()) for event in events]
        self._waits.append(wait)
        try:
            await asyncio.wait([timer, *waiters], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waits.remove(wait)
            timer.cancel()
            for waiter in waiters:
                waiter.cancel()

    def blocked(self) -> int:
        """How many tasks are in a wait that only `advance` or a new event can end (none of its events is set,
        its deadline is ahead): a loop that is idle, not one about to go round."""
        return sum(1 for wait in self._waits
                   if not wait.timer.done() and not any(event.is_set() for event in wait.events))
