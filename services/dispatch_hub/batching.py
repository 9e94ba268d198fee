"""Group commit for the hub's per-socket database work (token lookups, online, replay, offline).

A reconnect storm brings thousands of handshakes at once; one statement each on a pool of 6 connections queued
them behind each other until the clients' handshake timeouts, and the pool's waiter bookkeeping alone took a
sixth of the hub's CPU. A `Batcher` runs one call for everything submitted while its previous call ran: a quiet
hub answers one request at once, as before, and 10,000 handshakes cost tens of statements.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

log = logging.getLogger("hub.batching")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Batcher(Generic[K, V]):
    """`await batcher.submit(key)` -> the value `run` answered for that key (`default` when it left it out).

    Keys submitted while `concurrency` calls are running wait for the next call, at most `max_batch` keys in
    each; a key submitted twice before its call starts is looked up once. The calls run in their own tasks, so
    a caller that gives up (cancelled) does not cancel a statement other callers wait for. When `run` raises,
    every caller of that call gets the exception.
    """

    def __init__(self, run: Callable[[list[K]], Awaitable[Mapping[K, V]]], *, default: V, name: str,
                 max_batch: int = 1000, concurrency: int = 1) -> None:
        if max_batch < 1 or concurrency < 1:
            raise ValueError("a batcher needs max_batch >= 1 and concurrency >= 1")
        self._run = run
        self._default = default
        self.name = name
        self.max_batch = max_batch
        self.concurrency = concurrency
        self._pending: dict[K, list[asyncio.Future[V]]] = {}  # in submission order
        self._running: set[asyncio.Task[None]] = set()
        self.calls = 0
        self.largest = 0

    async def submit(self, key: K) -> V:
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append(future)
        if len(self._running) < self.concurrency:
            task = asyncio.create_task(self._drain(), name=f"batch-{self.name}")
            self._running.add(task)
        return await future

    async def _drain(self) -> None:
        try:
            await self._drain_pending()
        finally:
            # Off the running set in the same step that found nothing pending, not in a done callback: the callers
            # it answered resume before such a callback runs, and a key one of them submits in between would find
            # the slot taken by a call that has ended, and wait for good (or until another key came along).
            task = asyncio.current_task()
            if task is not None:
                self._running.discard(task)

    async def _drain_pending(self) -> None:
        while self._pending:
            keys = list(self._pending)[:self.max_batch]
            waiters = {key: self._pending.pop(key) for key in keys}
            self.calls += 1
            self.largest = max(self.largest, len(keys))
            try:
                found = await self._run(keys)
            except BaseException as exc:
                log.warning("batched call failed", extra={"batch": self.name, "size": len(keys),
                                                          "error": type(exc).__name__})
                _settle(waiters, error=exc)
                if not isinstance(exc, Exception):
                    raise  # cancelled (shutdown): its callers were told
            else:
                for key, futures in waiters.items():
                    value = found.get(key, self._default)
                    for future in futures:
                        if not future.done():
                            future.set_result(value)

    async def wait_idle(self) -> None:
        """Until every submitted key was answered (shutdown)."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)


def _settle(waiters: Mapping[Any, list[asyncio.Future[Any]]], *, error: BaseException) -> None:
    for futures in waiters.values():
        for future in futures:
            if future.done():
                continue
            if isinstance(error, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(error)
