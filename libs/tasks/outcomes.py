"""What an operation of the task store answers when its move matches nothing (docs/architecture.md "The task store:
Executions"): a typed outcome the caller must handle, never a silent `None`.

- `NotFound`: no such row (on either execution path, for this tenant).
- `Stale`: the row exists but is not in a state this move may leave (ended, already leased, requeued, ...).
- `Fenced`: the lease's fence refused the move: the caller's token or epoch is not the lease's (it expired, ended or
  was re-leased since). A deposed *leader* is refused by the database itself (trigger `leader_fence`, SQLSTATE
  MLF01, `libs.leader.is_fenced`): its transaction is aborted already, so that one stays an exception.

Each is a tagged msgspec Struct: `match outcome: case Stale(): ...` in the caller, and `assert_never` on the rest.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from psycopg import AsyncCursor

from libs.tasks.queued import Queued


class NotFound(msgspec.Struct, frozen=True, tag=True):
    """No such execution or lease."""

    task_id: uuid.UUID | None = None


class Stale(msgspec.Struct, frozen=True, tag=True):
    """The row is not in a state this move leaves; `status` is the one found, when read."""

    task_id: uuid.UUID | None = None
    status: str | None = None


class Fenced(msgspec.Struct, frozen=True, tag=True):
    """The lease's fence (token hash, epoch, holder) refused the move."""

    task_id: uuid.UUID | None = None


Refused = NotFound | Stale | Fenced

T = TypeVar("T")


def queued_rows(cursors: list[AsyncCursor[dict[str, Any]]],
                convert: Callable[[list[list[dict[str, Any]]]], T]) -> Queued[T]:
    """An answer read from the rows of statements queued on the caller's pipeline (libs/tasks/queued.py), one list
    per cursor, converted."""
    async def read() -> T:
        return convert([await cur.fetchall() for cur in cursors])
    return Queued(read)
