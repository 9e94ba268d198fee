"""An operation's answer on a pipelined transaction (libs/db/tx.py): the operation queues its statements on the
caller's pipeline and returns at once; the caller's next `pipe.sync()` (or the COMMIT) sends them, and `result()`
reads the answer after that. So a store operation adds no round trip to a transaction that batches its statements
(the click's, the dispatcher's pass)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Queued(Generic[T]):
    """`await queued.result()`: the operation's typed answer, once its statements were sent."""

    __slots__ = ("_read",)

    def __init__(self, read: Callable[[], Awaitable[T]]) -> None:
        self._read = read

    async def result(self) -> T:
        return await self._read()

    @classmethod
    def of(cls, value: T) -> Queued[T]:
        """An answer known without a statement (nothing to send)."""

        async def read() -> T:
            return value

        return cls(read)
