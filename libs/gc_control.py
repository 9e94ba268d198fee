"""The garbage collector in a service whose event loop is everything: a collection runs on it, so every socket's
events and every request wait while it walks. What startup allocated is frozen (`freeze_after_startup`), every
collection is timed (`watch_gc_pauses`), and a process that holds many long-lived objects (the hub's sockets)
freezes them as they settle and sweeps the frozen set only when it is calm (`LongLivedFreezer`);
docs/benchmarks.md, "Clicks on another hub during a reconnect storm"."""

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
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        generation = info.get("generation", -1)
        metrics.python_gc_pause_seconds.labels(generation=str(generation)).observe(took)
        if took > GC_PAUSE_LOG_S:
            log.warning("garbage collection held the event loop",
                        extra={"generation": generation, "pause_ms": round(took * 1000, 1),
                               "collected": info.get("collected", 0)})

    gc.callbacks.append(on_gc)
    return on_gc


class LongLivedFreezer:
    """Keeps objects that live for minutes out of the automatic collections, which otherwise walk them all.

    A hub's sockets are a few hundred objects each, allocated after startup's freeze. CPython's full collection
    walks every tracked object and runs whenever the survivors grew by a quarter since the last one: in a
    reconnect storm, while thousands of sockets attach, that is a collection after every few hundred sockets,
    each walking all of them (0.8-1.7 s on the benchmark's loaded box, every socket's events and every click
    waiting). `freeze()` (every `freeze_s`; `gc.freeze` is a constant-time list splice) moves whatever survived
    so far out of their reach, so an automatic collection walks only what the last interval allocated.

    What the frozen set holds and later drops is freed by reference counting as usual; only reference cycles
    among frozen objects wait for `sweep()`: unfreeze, one full collection, freeze again. It runs every `sweep_s`
    when `calm()` says the process is not in a storm (the hub: a handshake slot is free), and no later than twice that
    whatever the load, so memory held by dead cycles stays bounded. The sweep is the one long pause, at a
    moment of the process's choosing; it is logged with what it freed."""

    def __init__(self, *, freeze_s: float, sweep_s: float, calm: Callable[[], bool] = lambda: True) -> None:
        self.freeze_s = freeze_s
        self.sweep_s = sweep_s
        self._calm = calm
        self._last_sweep = time.monotonic()
        self.sweeps = 0

    def freeze(self) -> None:
        gc.freeze()

    def sweep(self) -> int:
        """One full collection over everything, frozen included, then freeze the survivors; returns the objects
        it freed (the dead cycles the frozen set held)."""
        started = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect()
        gc.freeze()
        took = time.perf_counter() - started
        self._last_sweep = time.monotonic()
        self.sweeps += 1
        log.info("swept the frozen objects", extra={"freed": freed, "pause_ms": round(took * 1000, 1)})
        return freed

    def due(self, now: float | None = None) -> bool:
        """A sweep is due once `sweep_s` passed and the process is calm, or once twice that passed regardless."""
        waited = (time.monotonic() if now is None else now) - self._last_sweep
        return waited >= 2 * self.sweep_s or (waited >= self.sweep_s and self._calm())

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.freeze_s)
            if stop.is_set():
                return
            if self.due():
                self.sweep()
            else:
                self.freeze()
