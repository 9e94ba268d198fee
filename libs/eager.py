"""Start a coroutine eagerly: run it at once, in the caller's turn of the event loop, and make a task only of what is
left when it first has to wait.

The hub writes each event to its socket in a writer coroutine. As a task per write (`asyncio.create_task`), a fan-out
to 10,000 sockets created and scheduled 10,000 tasks, each of which ran one `send_str` that did not wait (the frame
fits the socket's send buffer): the tasks' creation and scheduling were ~40 % of the hub's CPU an event
(docs/benchmarks.md, "Fan-out without a task a socket"). Python 3.12 has this built in (`asyncio.Task(...,
eager_start=True)`, which `start_eagerly` uses there); on 3.11 it is done here by stepping the coroutine once by
hand, as `Task.__step` would, and handing what is left to a task that awaits the future it stopped on first.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Coroutine
from inspect import CORO_SUSPENDED
from typing import Any


def start_eagerly(coro: Coroutine[Any, Any, None], *, name: str | None = None) -> asyncio.Task[None] | None:
    """Run `coro` now until it completes (None) or has to wait (the task that carries it on from there). Like a task,
    an exception it raises is not raised here: it ends the task returned (logged as "never retrieved" if nobody
    awaits it)."""
    if sys.version_info >= (3, 12):
        task = asyncio.Task(coro, loop=asyncio.get_running_loop(), name=name, eager_start=True)
        return None if task.done() and not task.cancelled() and task.exception() is None else task
    loop = asyncio.get_running_loop()
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    except BaseException as exc:  # handed to a task, as a task's first step would have
        return loop.create_task(_raise(exc), name=name)
    task = loop.create_task(_carry_on(coro, waiting), name=name)
    # A task cancelled before its first step never enters `_carry_on`: the coroutine, suspended where it first
    # waited, is closed then (its `finally` blocks run) rather than left to the garbage collector.
    task.add_done_callback(lambda _: coro.close() if inspect.getcoroutinestate(coro) == CORO_SUSPENDED else None)
    return task


async def _raise(exc: BaseException) -> None:
    raise exc


async def _carry_on(coro: Coroutine[Any, Any, None], waiting: object) -> None:
    """Drive `coro`, which stopped yielding `waiting` (a future, or None for a bare yield), to its end: await what it
    waits for, then resume it, which takes the future's outcome itself. This task's own cancellation reaches `coro`
    as a task's would: through the future it waits on, or thrown into it when that future cannot be cancelled."""
    while True:
        thrown: BaseException | None = None
        try:
            if waiting is None:
                await asyncio.sleep(0)
            elif isinstance(waiting, asyncio.Future):
                # Taken up as `Task.__step` takes up a yielded future (the flag its `__await__` set when it yielded).
                waiting._asyncio_future_blocking = False
                await waiting
            else:
                thrown = RuntimeError(f"eagerly started coroutine yielded {waiting!r}, not a future")
        except asyncio.CancelledError as cancelled:
            if not (isinstance(waiting, asyncio.Future) and waiting.cancelled()):
                thrown = cancelled  # this task was cancelled, not the future the coroutine waits on
        except BaseException:  # the future's exception: the coroutine reads it itself
            pass
        try:
            waiting = coro.throw(thrown) if thrown is not None else coro.send(None)
        except StopIteration:
            return
