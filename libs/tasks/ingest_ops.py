"""Result ingest's reads of the task tables (services/ingest_shard_workers, docs/architecture.md §12): the business
tasks of a batch, locked in the batch's lock order; the other live executions of a task a success completed; and the
age of the oldest result accepted but not applied yet (libs/ingest/lag.py). Ending executions and settling business
tasks are libs/tasks/transitions.py's; the request counters, libs/tasks/requests.py's.

The SQL is module-private `_NAME` constants (docs/architecture.md "The task store: the click's and ingest's
operations").
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import date

import msgspec

from libs.db.pool import Conn
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, BusinessStatus

# The business tasks of a batch, locked in id order (the lock order of every ingest transaction).
_LOCK_BUSINESS_TASKS = """
SELECT id, tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode, business_date,
       status, collect_request_id, execution_owner
FROM monitoring_collect_tasks
WHERE id = ANY(%(ids)s::bigint[])
ORDER BY id
FOR UPDATE
"""

# Another active execution of a business task a success just completed (the result came from an
# execution that was already ended, e.g. expired and re-dispatched): it is no longer needed.
_OTHER_ACTIVE_EXECUTIONS = f"""
SELECT id, tenant_id, target_client_id, monitor_task_id, ai_platform_id, lane, interrupt_generation,
       collect_request_id
FROM desktop_tasks
WHERE kind = 'monitor' AND monitor_task_id = ANY(%(monitor_task_ids)s::bigint[])
  AND status IN {ACTIVE_EXECUTION_SQL} AND NOT (id = ANY(%(task_ids)s::uuid[]))
UNION ALL
-- and live legacy leases (libs/tasks/legacy.py)
SELECT id, tenant_id, target_client_id, monitor_task_id, ai_platform_id, lane, interrupt_generation,
       collect_request_id
FROM legacy_leases
WHERE monitor_task_id = ANY(%(monitor_task_ids)s::bigint[])
  AND status IN ('queued', 'in_progress') AND NOT (id = ANY(%(task_ids)s::uuid[]))
ORDER BY id
"""

# Results the hub accepted (published, then stamped result_received_at) that ingest has not applied yet, on both
# execution paths: an execution still in progress (or unknown) with its result received, and a legacy lease still in
# progress with its result received (ingest ends the lease when it applies the result: docs/legacy-path.md). The
# oldest of the two; least() skips a path with none.
_INGEST_LAG_SQL = """
SELECT coalesce(extract(epoch FROM now() - least(
           (SELECT min(result_received_at) FROM desktop_tasks
            WHERE status IN ('in_progress', 'unknown') AND result_received_at IS NOT NULL),
           (SELECT min(result_received_at) FROM legacy_leases
            WHERE status = 'in_progress' AND result_received_at IS NOT NULL))) * 1000, 0)::float8 AS lag_ms
"""


class BusinessTaskOfResult(msgspec.Struct, frozen=True):
    """A business task a result of the batch is for, as locked: its business key, status, request and path."""

    id: int
    tenant_id: int
    brand_id: int
    question_id: int
    ai_platform_id: int
    collector_type: str
    run_mode: str
    business_date: date
    status: BusinessStatus
    collect_request_id: uuid.UUID | None
    execution_owner: str

    def run_key(self) -> tuple[int, int, int, int, str, str, date]:
        """The business key a result must carry to apply to this task."""
        return (self.tenant_id, self.brand_id, self.question_id, self.ai_platform_id, self.collector_type,
                self.run_mode, self.business_date)


class LiveExecution(msgspec.Struct, frozen=True):
    """A live execution (or legacy lease) of a business task, with what its client is told when it is ended."""

    id: uuid.UUID
    tenant_id: int
    target_client_id: uuid.UUID
    monitor_task_id: int
    ai_platform_id: int | None
    lane: str
    interrupt_generation: int
    collect_request_id: uuid.UUID | None


async def lock_business_tasks(conn: Conn, ids: Sequence[int]) -> dict[int, BusinessTaskOfResult]:
    """The business tasks `ids`, locked FOR UPDATE in id order (pass them sorted: every ingest transaction locks in
    that order), by id; an id without a task is missing from the answer."""
    cur = await conn.execute(_LOCK_BUSINESS_TASKS, {"ids": list(ids)})
    return {int(row["id"]): BusinessTaskOfResult(
        id=int(row["id"]), tenant_id=int(row["tenant_id"]), brand_id=int(row["brand_id"]),
        question_id=int(row["question_id"]), ai_platform_id=int(row["ai_platform_id"]),
        collector_type=row["collector_type"], run_mode=row["run_mode"], business_date=row["business_date"],
        status=row["status"], collect_request_id=row["collect_request_id"], execution_owner=row["execution_owner"])
        for row in await cur.fetchall()}


async def other_live_executions(conn: Conn, monitor_task_ids: Sequence[int],
                                except_task_ids: Sequence[uuid.UUID]) -> list[LiveExecution]:
    """The live executions and legacy leases of these business tasks other than `except_task_ids` (the ones whose
    results are being applied), in id order."""
    cur = await conn.execute(_OTHER_ACTIVE_EXECUTIONS, {"monitor_task_ids": list(monitor_task_ids),
                                                        "task_ids": list(except_task_ids)})
    return [LiveExecution(id=row["id"], tenant_id=int(row["tenant_id"]), target_client_id=row["target_client_id"],
                          monitor_task_id=int(row["monitor_task_id"]), ai_platform_id=row["ai_platform_id"],
                          lane=row["lane"], interrupt_generation=int(row["interrupt_generation"]),
                          collect_request_id=row["collect_request_id"]) for row in await cur.fetchall()]


async def oldest_unapplied_result_age_ms(conn: Conn) -> float:
    """Age (ms) of the oldest result the hub accepted that ingest has not applied yet, on either path; 0 for none."""
    cur = await conn.execute(_INGEST_LAG_SQL)
    row = await cur.fetchone()
    return max(0.0, float(row["lag_ms"])) if row else 0.0
