"""Collect-now request progress (§7.4): counts move when a business task reaches a terminal state."""

from __future__ import annotations

from dataclasses import dataclass

TERMINAL_BUSINESS = frozenset({"completed", "failed", "skipped", "expired"})
# Request statuses a result may still move forward; the others are final.
OPEN_REQUEST = frozenset({"accepted", "dispatching", "running"})


@dataclass(frozen=True, slots=True)
class CountDelta:
    completed: int = 0
    failed: int = 0

    @property
    def empty(self) -> bool:
        return self.completed == 0 and self.failed == 0


def request_count_delta(previous: str, current: str) -> CountDelta:
    """How a business task's move from `previous` to `current` changes its request's counters.

    Counted once when the task first becomes completed or failed; a later success that turns a failed
    task into completed moves it from failed to completed. Nothing else counts.
    """
    if previous == current:
        return CountDelta()
    if current == "completed":
        return CountDelta(completed=1, failed=-1 if previous == "failed" else 0)
    if current == "failed" and previous not in TERMINAL_BUSINESS:
        return CountDelta(failed=1)
    return CountDelta()


def request_status_after(status: str, *, requested: int, completed: int, failed: int) -> str:
    """running -> succeeded | partial | failed once every requested task is terminal; otherwise unchanged."""
    if status not in OPEN_REQUEST or requested <= 0 or completed + failed < requested:
        return status
    if failed == 0:
        return "succeeded"
    if completed == 0:
        return "failed"
    return "partial"
