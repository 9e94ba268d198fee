"""The garbage collector in a service whose event loop is everything: a collection runs on it, so every socket's
events and every request wait while it walks. What startup allocated is frozen (`freeze_after_startup`), every
collection is timed (`watch_gc_pauses`), and a process that holds many long-lived objects (the hub's sockets) runs
its full collections itself, rarely and when it is calm (`CalmFullCollections`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable

from aiohttp import web

from libs.telemetry import metrics

log = logging.getLogger("gc")

# A collection longer than this is logged: it held the service's event loop (every socket's events, every request).
GC_PAUSE_LOG_S = 0.1


def freeze_after_startup(app: web.Application) -> None:
    """Once the app has started (call it after every other startup hook is registered), move everything
    allocated so far, the imported modules, the app, its pools and clients, out of the garbage collector's
    reach (`gc.freeze`). A full collection then walks only what requests allocate: under the collect-now
    benchmark's load it took 29-41 ms in every service (once or twice a minute, stalling whatever request or
    click was in flight: the p99) and 1-3 ms frozen."""

    async def freeze(_: web.Application) -> None:
        gc.collect()
        gc.freeze()

    app.on_startup.append(freeze)


def watch_gc_pauses() -> Callable[[str, dict[str, int]], None]:
    """Time every garbage collection into `python_gc_pause_seconds{generation}` and log those over GC_PAUSE_LOG_S:
    a collection runs on the event loop, so its length is how long everything else waited. Returns the callback
    (installed in `gc.callbacks`)."""
    started: list[float] = [0.0, 0.0]
    # Bound once: the callback runs at every collection, a young one every few hundred allocations.
    by_generation = {g: metrics.python_gc_pause_seconds.labels(generation=str(g)) for g in range(3)}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = time.perf_counter(), time.thread_time()
            return
        took = time.perf_counter() - started[0]
        generation = info.get("generation", -1)
        (by_generation.get(generation) or metrics.python_gc_pause_seconds.labels(generation=str(generation))).observe(
            took)
        if took > GC_PAUSE_LOG_S:
            log.warning("garbage collection held the event loop",
                        extra={"generation": generation, "pause_ms": round(took * 1000, 1),
                               # the collector's own CPU: below the pause when the machine's other work took turns
                               "cpu_ms": round((time.thread_time() - started[1]) * 1000, 1),
                               "collected": info.get("collected", 0)})

    gc.callbacks.append(on_gc)
    return on_gc


# gen-1 collections between two automatic full ones while `CalmFullCollections` runs: about 7 * 10^9 allocations
# (the default is 10), so in practice only its own collections are full ones.
AUTOMATIC_FULL_THRESHOLD = 1_000_000


class CalmFullCollections:
    """A process that holds many long-lived objects (the hub's sockets, a few hundred objects each) runs its full
    garbage collections itself, rarely and when it is calm, instead of CPython deciding in the middle of a storm.

    CPython runs a full collection, which walks every tracked object the startup freeze did not take, each time the
    survivors grew by a quarter since the last one. In a reconnect storm that is while thousands of sockets attach:
    a collection after every few hundred sockets, each walking all of them and every pending handshake's coroutines,
    futures and contexts (38 collections of 0.8-1.7 s in four hubs during a 20,000-client storm on the benchmark's
    box, every socket's events and every click on the hub waiting; docs/benchmarks.md, "Clicks on another hub
    during a reconnect storm"). Here the young generations are collected as usual (short-lived cycles die there),
    automatic full collections are pushed out of reach (`AUTOMATIC_FULL_THRESHOLD`), and one runs every `every_s`
    once `calm()` (asked every `check_s`) says no storm is on, and after twice that whatever the load, freeing the
    dead cycles of old objects (a closed socket's), so the memory they hold stays bounded.

    Freezing what a collection kept would make the next one walk only what arrived since, but every collection would
    then have to unfreeze and walk it all anyway to find the frozen objects that died in a cycle; one walk every
    `every_s` is the same work. Each collection is logged with its pause and what it freed."""

    def __init__(self, *, every_s: float, calm: Callable[[], bool] = lambda: True, check_s: float = 1.0) -> None:
        self.every_s = every_s
        self.check_s = check_s
        self._calm = calm
        self._last = time.monotonic()
        self.collections = 0

    def collect(self) -> int:
        """One full collection; returns the objects it freed."""
        started = time.perf_counter()
        freed = gc.collect()
        took = time.perf_counter() - started
        self._last = time.monotonic()
        self.collections += 1
        log.info("full garbage collection while calm", extra={"freed": freed, "pause_ms": round(took * 1000, 1)})
        return freed

    def due(self, now: float, *, calm: bool) -> bool:
        """Due once `every_s` passed and the process is calm, or once twice that passed regardless."""
        waited = now - self._last
        return waited >= 2 * self.every_s or (waited >= self.every_s and calm)

    async def run(self, stop: asyncio.Event) -> None:
        """Take over full collections until `stop`; CPython's own thresholds come back once the last of the process's
        loops stops (tests run several hubs in one process)."""
        _take_over()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.check_s)
                calm = self._calm()  # every tick: a predicate may measure the churn since its last call
                if not stop.is_set() and self.due(time.monotonic(), calm=calm):
                    self.collect()
        finally:
            _give_back()


# The loops that took full collections over, and the thresholds from before the first of them.
_holders: list[tuple[int, int, int]] = []


def _take_over() -> None:
    thresholds = gc.get_threshold()
    _holders.append(_holders[0] if _holders else thresholds)
    gc.set_threshold(thresholds[0], thresholds[1], AUTOMATIC_FULL_THRESHOLD)


def _give_back() -> None:
    original = _holders.pop()
    if not _holders:
        gc.set_threshold(*original)
