"""`RecordedResults.final_status` (libs/tasks/requests.py, what ingest finishes a request with) agrees with the rule
it stands for, `request_status_after`: a request moves exactly when that rule moves it, and to the same status."""

from __future__ import annotations

import itertools

from libs.tasks.requests import RecordedResults, request_status_after

STATUSES = ("accepted", "dispatching", "running", "partial", "succeeded", "failed", "timed_out", "superseded")


def _recorded(status: str, requested: int, completed: int, failed: int) -> RecordedResults:
    return RecordedResults(status=status, requested_task_count=requested,  # type: ignore[arg-type]
                           completed_task_count=completed, failed_task_count=failed, first_result=False,
                           since_created_ms=0.0)


def test_final_status_is_request_status_after_when_it_moves() -> None:
    moved = 0
    for status, requested, completed, failed in itertools.product(STATUSES, range(4), range(4), range(4)):
        after = request_status_after(status, requested=requested, completed=completed, failed=failed)
        final = _recorded(status, requested, completed, failed).final_status()
        assert final == (after if after != status else None), (status, requested, completed, failed)
        moved += final is not None
    assert moved > 0  # the grid has requests that finish, so a final_status that never moves would fail


def test_an_open_request_with_every_task_terminal_finishes() -> None:
    assert _recorded("running", 2, 1, 1).final_status() == "partial"
    assert _recorded("accepted", 2, 2, 0).final_status() == "succeeded"
    assert _recorded("dispatching", 1, 0, 1).final_status() == "failed"
    assert _recorded("running", 2, 1, 0).final_status() is None
    assert _recorded("timed_out", 1, 1, 0).final_status() is None  # final already
