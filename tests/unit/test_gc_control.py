"""libs.gc_control: collections are timed, and a process can take its full collections over, running them when it is
calm and no less often than twice its interval."""

from __future__ import annotations

import asyncio
import gc
import weakref

from libs import gc_control
from libs.gc_control import AUTOMATIC_FULL_THRESHOLD, CalmFullCollections, watch_gc_pauses
from libs.telemetry import metrics
from tests.support.wait import eventually


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def _count(generation: str) -> float:
    return metrics.REGISTRY.get_sample_value("python_gc_pause_seconds_count", {"generation": generation}) or 0.0


def test_every_collection_is_timed_by_generation() -> None:
    callback = watch_gc_pauses()
    gc.disable()  # only the two collections below: no automatic one in between
    try:
        before = _count("2"), _count("0")
        gc.collect()
        gc.collect(0)
        assert _count("2") == before[0] + 1
        assert _count("0") == before[1] + 1
    finally:
        gc.enable()
        gc.callbacks.remove(callback)


def test_a_collection_frees_a_dead_cycle_of_old_objects() -> None:
    collections = CalmFullCollections(every_s=60)
    gc.disable()  # no automatic collection before the one asked for
    try:
        holder = [Node(), Node()]
        holder[0].peer, holder[1].peer = holder[1], holder[0]
        gc.collect(1)
        gc.collect(1)  # in the oldest generation, where only a full collection looks
        ref = weakref.ref(holder[0])
        holder.clear()
        assert ref() is not None
        assert collections.collect() >= 2
        assert ref() is None
    finally:
        gc.enable()
    assert collections.collections == 1


def test_the_collection_waits_for_calm_but_not_forever() -> None:
    collections = CalmFullCollections(every_s=100.0)
    start = collections._last
    assert not collections.due(start + 50, calm=True)
    assert not collections.due(start + 150, calm=False)  # due, but a storm is on
    assert collections.due(start + 150, calm=True)
    assert collections.due(start + 201, calm=False)  # twice the interval: collected whatever the load


async def test_the_loop_takes_full_collections_over_asks_for_calm_every_tick_and_gives_them_back() -> None:
    thresholds = gc.get_threshold()
    asked = [0]

    def calm() -> bool:
        asked[0] += 1
        return True

    collections = CalmFullCollections(every_s=0.05, check_s=0.01, calm=calm)
    stop = asyncio.Event()
    task = asyncio.create_task(collections.run(stop))
    try:
        await eventually(lambda: collections.collections >= 4, timeout=5, interval=0.01, message="four collections")
        assert gc.get_threshold() == (thresholds[0], thresholds[1], AUTOMATIC_FULL_THRESHOLD)
        assert asked[0] > collections.collections
    finally:
        stop.set()
        async with asyncio.timeout(5):
            await task
    assert gc.get_threshold() == thresholds


async def test_two_loops_in_one_process_give_the_thresholds_back_once_both_stopped() -> None:
    thresholds = gc.get_threshold()
    first, second = CalmFullCollections(every_s=60, check_s=0.01), CalmFullCollections(every_s=60, check_s=0.01)
    stops = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(c.run(stop)) for c, stop in zip((first, second), stops, strict=True)]
    await eventually(lambda: len(gc_control._holders) == 2, timeout=5, interval=0.01, message="both taking over")
    assert gc.get_threshold()[2] == AUTOMATIC_FULL_THRESHOLD
    stops[0].set()
    async with asyncio.timeout(5):
        await tasks[0]
    assert gc.get_threshold()[2] == AUTOMATIC_FULL_THRESHOLD, "the first to stop gave them back under the second"
    stops[1].set()
    async with asyncio.timeout(5):
        await tasks[1]
    assert gc.get_threshold() == thresholds
