"""The success-priority rule of docs/architecture.md §12.3 for `question_monitor_runs`, as plain functions.

The SQL upsert applies the same rule (`... DO UPDATE ... WHERE question_monitor_runs.status = 'failed'
OR EXCLUDED.status = 'succeeded'`); folding a batch with `fold_latest_effective` first gives the same
final row as applying its results one by one in delivery order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Literal, Protocol, TypeVar

RunStatus = Literal["succeeded", "failed"]


class HasStatus(Protocol):
    @property
    def status(self) -> RunStatus: ...


T = TypeVar("T", bound=HasStatus)
K = TypeVar("K", bound=Hashable)


def incoming_wins(existing: RunStatus | None, incoming: RunStatus) -> bool:
    """A new succeeded always wins (last success is effective); a new failed wins only over failed."""
    return existing is None or existing == "failed" or incoming == "succeeded"


def fold_latest_effective(results: Iterable[T], key: Callable[[T], K]) -> dict[K, T]:
    """Per business key, the result that is effective after applying `results` in order."""
    effective: dict[K, T] = {}
    for result in results:
        k = key(result)
        current = effective.get(k)
        if incoming_wins(None if current is None else current.status, result.status):
            effective[k] = result
    return effective
