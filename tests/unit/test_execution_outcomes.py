"""The `Executions` interface without a database (libs/tasks/execution_paths.py, libs/tasks/outcomes.py): both
implementations answer the whole protocol with the same signatures, each task's path is chosen once by its owner, the
typed outcomes are distinct tagged values, and the operations over both paths merge and route as the callers rely
on."""

from __future__ import annotations

import inspect
import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

import msgspec
import pytest

from libs.tasks import execution_paths
from libs.tasks.execution_paths import DESKTOP_TASKS, LEGACY, PATHS, Executions, best_first, executions_for
from libs.tasks.executions import DesktopTaskExecutions
from libs.tasks.legacy import LegacyExecutions
from libs.tasks.outcomes import Fenced, NotFound, Stale
from libs.tasks.queued import Queued
from libs.tasks.records import Extended, Offer

PROTOCOL_METHODS = sorted(name for name, _ in inspect.getmembers(Executions, inspect.isfunction)
                          if not name.startswith("_"))


def drift(implementation: type) -> list[str]:
    """The operations of the protocol `implementation` lacks, or answers with other parameters or another type."""
    found = []
    for name in PROTOCOL_METHODS:
        if not hasattr(implementation, name):
            found.append(f"{name}: missing")
            continue
        wanted = inspect.signature(getattr(Executions, name))
        got = inspect.signature(getattr(implementation, name))
        if list(got.parameters) != list(wanted.parameters) or got.return_annotation != wanted.return_annotation:
            found.append(f"{name}: {got} is not {wanted}")
    return found


def test_both_implementations_answer_every_operation_of_the_protocol_with_its_signature() -> None:
    assert len(PROTOCOL_METHODS) > 20
    for implementation in (DesktopTaskExecutions, LegacyExecutions):
        assert isinstance(implementation(), Executions)
        assert drift(implementation) == [], implementation.__name__


def test_the_signature_check_catches_an_implementation_that_drifted() -> None:
    class Drifted(DesktopTaskExecutions):
        async def extend(self, conn: Any, task_id: uuid.UUID, *,  # type: ignore[override]
                         tenant_id: int) -> Extended | Fenced:
            return Fenced()

    assert [d.split(":")[0] for d in drift(Drifted)] == ["extend"]


def test_the_path_is_chosen_once_by_the_execution_owner() -> None:
    assert executions_for("desktop_tasks") is DESKTOP_TASKS and executions_for("legacy") is LEGACY
    assert [p.owner for p in PATHS] == ["desktop_tasks", "legacy"]
    with pytest.raises(KeyError):
        executions_for("carrier_pigeon")


def test_the_outcomes_are_distinct_tagged_values() -> None:
    task = uuid.uuid4()
    assert Stale(task_id=task) != NotFound(task_id=task) != Fenced(task_id=task)
    union = msgspec.json.Decoder(Stale | NotFound | Fenced)
    for outcome in (Stale(task_id=task, status="aborted"), NotFound(task_id=task), Fenced(task_id=task)):
        assert union.decode(msgspec.json.encode(outcome)) == outcome
    assert b'"type":"Stale"' in msgspec.json.encode(Stale())


def _offer(owner: str, *, weight: int, priority: int, age_s: int) -> Offer:
    return Offer(id=uuid.uuid4(), monitor_task_id=1, lane="normal", lane_weight=weight, priority=priority,
                 lease_epoch=0, interrupt_generation=0, business_date=date(2026, 1, 1), tenant_id=1, ai_platform_id=1,
                 collect_request_id=None, control_flags={}, enqueued_at=datetime(2026, 1, 1, tzinfo=UTC)
                 - timedelta(seconds=age_s), brand_id=1, brand_name="b", question_id=1, question_text="q",
                 platform_code="p", platform_mode=None, execution_owner=owner)  # type: ignore[arg-type]


def test_a_lease_takes_both_paths_work_in_dispatch_order_up_to_its_free_slots() -> None:
    high_legacy = _offer("legacy", weight=100, priority=1, age_s=0)
    older = _offer("desktop_tasks", weight=10, priority=5, age_s=60)
    newer = _offer("legacy", weight=10, priority=5, age_s=1)
    low = _offer("desktop_tasks", weight=10, priority=1, age_s=600)
    assert best_first([low, newer, older, high_legacy], 3) == [high_legacy, older, newer]
    assert best_first([low, high_legacy], 0) == []


async def test_a_pending_answer_is_read_only_when_asked() -> None:
    reads = []

    async def read() -> int:
        reads.append(1)
        return 42

    pending = Queued(read)
    assert reads == []
    assert await pending.result() == 42 and reads == [1]


class _RecordingConn:
    """Records the statements a dispatch queues (no database: what goes where)."""

    def __init__(self) -> None:
        self.executed: list[tuple[str, dict[str, Any]]] = []

    async def execute(self, sql: str, params: dict[str, Any]) -> None:
        self.executed.append((sql, params))


async def test_dispatch_puts_each_row_on_its_owners_path() -> None:
    conn = _RecordingConn()
    row = {"id": uuid.uuid4(), "monitor_task_id": 1, "tenant_id": 1, "workspace_id": 1,
           "target_client_id": uuid.uuid4(), "ai_platform_id": 1, "brand_id": 1, "question_id": 1,
           "business_date": date(2026, 1, 1), "lane": "normal", "lane_weight": 10, "priority": 100,
           "interrupt_generation": 0, "collect_request_id": None, "enqueued_at": datetime(2026, 1, 1, tzinfo=UTC),
           "source": "daily_schedule", "scheduler_group_key": "qid:1"}
    rows = [{**row, "execution_owner": "desktop_tasks"}, {**row, "execution_owner": "legacy"},
            {**row, "execution_owner": None}]
    await execution_paths.dispatch(conn, rows, ts=datetime.now(UTC))  # type: ignore[arg-type]
    (desktop_sql, desktop), (legacy_sql, legacy) = conn.executed
    assert "INSERT INTO desktop_tasks" in desktop_sql and "INSERT INTO legacy_leases" in legacy_sql
    assert len(msgspec.json.decode(desktop["rows"])) == 2  # the owner-less row is the new path's
    assert len(msgspec.json.decode(legacy["rows"])) == 1
    conn.executed.clear()
    await execution_paths.dispatch(conn, rows[:1], ts=datetime.now(UTC))  # type: ignore[arg-type]
    assert len(conn.executed) == 1  # no statement for a path with nothing to create
