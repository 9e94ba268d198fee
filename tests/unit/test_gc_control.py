"""libs.gc_control: collections are timed, long-lived objects leave the automatic collections' walk, and the sweep
frees the dead cycles the frozen set held."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from libs.gc_control import LongLivedFreezer, watch_gc_pauses
from libs.telemetry import metrics
from tests.support.wait import eventually


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def _cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def _count(generation: str) -> float:
    return metrics.REGISTRY.get_sample_value("python_gc_pause_seconds_count", {"generation": generation}) or 0.0


def test_every_collection_is_timed_by_generation() -> None:
    callback = watch_gc_pauses()
    try:
        before = _count("2"), _count("0")
        gc.collect()
        gc.collect(0)
        assert _count("2") == before[0] + 1
        assert _count("0") == before[1] + 1
    finally:
        gc.callbacks.remove(callback)


def test_a_frozen_cycle_outlives_the_automatic_collections_and_the_sweep_frees_it() -> None:
    freezer = LongLivedFreezer(freeze_s=1.0, sweep_s=600.0)
    holder = [_cycle()]
    node = holder[0]()
    assert node is not None
    freezer.freeze()
    assert not any(o is node for o in gc.get_objects())  # out of every generation the collector walks
    ref = holder.pop()
    del node  # the cycle is now garbage, frozen
    gc.collect()
    assert ref() is not None, "a full collection walked the frozen set"
    assert freezer.sweep() >= 2
    assert ref() is None
    assert gc.get_freeze_count() > 0  # the survivors are frozen again


def test_the_sweep_waits_for_calm_but_not_forever() -> None:
    calm = [False]
    freezer = LongLivedFreezer(freeze_s=1.0, sweep_s=100.0, calm=lambda: calm[0])
    start = freezer._last_sweep
    assert not freezer.due(start + 50)
    assert not freezer.due(start + 150)  # due, but a storm is on
    calm[0] = True
    assert freezer.due(start + 150)
    calm[0] = False
    assert freezer.due(start + 201)  # twice the interval: swept whatever the load


async def test_the_loop_freezes_each_interval_and_stops_on_request() -> None:
    freezer = LongLivedFreezer(freeze_s=0.01, sweep_s=600.0)
    stop = asyncio.Event()
    task = asyncio.create_task(freezer.run(stop))
    kept = [Node() for _ in range(10)]
    await eventually(gc.get_freeze_count, timeout=5, interval=0.01, message="the loop's first freeze")
    assert not any(o is kept[0] for o in gc.get_objects())
    stop.set()
    async with asyncio.timeout(5):
        await task
    assert freezer.sweeps == 0
