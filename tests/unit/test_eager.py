"""libs/eager.py: a coroutine started eagerly runs at once, and what is left after its first wait carries on as a task
with a task's semantics (the waited future's result or exception, cancellation, bare yields)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from libs.eager import start_eagerly


async def test_a_coroutine_that_does_not_wait_runs_to_its_end_at_once_without_a_task() -> None:
    done: list[str] = []

    async def write() -> None:
        done.append("sent")

    assert start_eagerly(write()) is None
    assert done == ["sent"]


@pytest.mark.parametrize("task_waits_first", [False, True])
async def test_what_follows_a_wait_carries_on_as_a_task_with_the_futures_result(task_waits_first: bool) -> None:
    loop = asyncio.get_running_loop()
    drained: asyncio.Future[int] = loop.create_future()
    seen: list[object] = []

    async def write() -> None:
        seen.append("first frame")
        seen.append(await drained)
        await asyncio.sleep(0)  # a bare yield on the way
        seen.append("second frame")

    task = start_eagerly(write(), name="writer")
    assert task is not None and task.get_name() == "writer"
    assert seen == ["first frame"]  # ran up to its wait before start_eagerly returned
    if task_waits_first:
        await asyncio.sleep(0)  # the task's first step: it now waits on the future itself
    drained.set_result(7)
    await asyncio.wait_for(task, 5)
    assert seen == ["first frame", 7, "second frame"]


async def test_the_waited_futures_exception_reaches_the_coroutine() -> None:
    drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    caught: list[BaseException] = []

    async def write() -> None:
        try:
            await drained
        except ConnectionResetError as exc:
            caught.append(exc)

    task = start_eagerly(write())
    assert task is not None
    drained.set_exception(ConnectionResetError("peer gone"))
    await asyncio.wait_for(task, 5)
    assert [str(e) for e in caught] == ["peer gone"]


@pytest.mark.parametrize("shielded", [False, True])
async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits(shielded: bool) -> None:
    drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cleaned: list[str] = []

    async def write() -> None:
        try:
            await (asyncio.shield(drained) if shielded else drained)
        finally:
            cleaned.append("finally")

    task = start_eagerly(write())
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and cleaned == ["finally"]


async def test_a_task_cancelled_before_its_first_step_closes_the_coroutine() -> None:
    cleaned: list[str] = []

    async def write() -> None:
        try:
            await asyncio.sleep(0)
            cleaned.append("resumed")
        finally:
            cleaned.append("finally")

    task = start_eagerly(write())
    assert task is not None and cleaned == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["finally"]


async def test_an_exception_ends_the_task_not_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    async def write() -> None:
        raise ValueError("bad frame")

    task = start_eagerly(write())
    assert task is not None
    with pytest.raises(ValueError, match="bad frame"):
        await task

    later: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def fails_after_a_wait() -> None:
        await later
        raise ValueError("after the wait")

    with caplog.at_level(logging.ERROR):
        task = start_eagerly(fails_after_a_wait())
        assert task is not None
        later.set_result(None)
        with pytest.raises(ValueError, match="after the wait"):
            await task
