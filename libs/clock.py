"""The clock seam: what orchestration code asks for the time, and for its timed waits.

Loops that decide by monotonic time (the coordinator's pass spacing, the pending pairs' age) take a `Clock`
in their constructor, `SYSTEM_CLOCK` by default; tests pass a clock they advance by hand
(tests/support/clock.py), so timing is driven, not slept for. Latency measurements (`time.perf_counter`
for metrics) are not behaviour and stay on the system clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""
        ...

    def now(self) -> datetime:
        """The wall-clock time, timezone-aware, in UTC."""
        ...

    async def wait(self, events: Sequence[asyncio.Event], timeout: float) -> None:
        """Return once any of `events` is set or `timeout` seconds of this clock have passed (<= 0: at once,
        after one turn of the event loop)."""
        ...


class SystemClock:
    """The process's clocks and the event loop's timers."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def wait(self, events: Sequence[asyncio.Event], timeout: float) -> None:
        if not events:
            await asyncio.sleep(max(0.0, timeout))
            return
        waiters = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waiters, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


SYSTEM_CLOCK: Clock = SystemClock()
