"""Waiting by polling with a deadline (never a bare sleep)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(probe: Callable[[], Awaitable[T] | T], *, timeout: float = 10.0, interval: float = 0.05,
                     message: str = "condition") -> T:
    """Call `probe` (a coroutine function, or a plain one for a check of in-process state) until it returns
    a truthy value; fail with `message` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        result = probe()
        last = await result if inspect.isawaitable(result) else result
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last value: {last!r}")
        await asyncio.sleep(interval)
