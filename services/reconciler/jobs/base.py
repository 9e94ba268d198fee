"""What every reconcile job shares: its context, its result, and helpers over shared tables."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, assert_never

import psycopg

from libs.contracts.wire import ControlKind
from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings
from libs.tasks import controls, execution_paths
from libs.tasks.outcomes import NotFound, Stale
from libs.tasks.records import EndedExecution, ExecutionEnd
from libs.tasks.requests import refresh_progress
from libs.tasks.statuses import EndReason
from libs.tasks.transitions import emit_lifecycle, retry_business_task
from services.reconciler.config import ReconcilerConfig

log = logging.getLogger("reconciler")

# Lost races with another writer: the row is left for the next run.
RETRYABLE_ERRORS = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure,
                    psycopg.errors.LockNotAvailable)


@dataclass(slots=True)
class JobContext:
    conn: Conn
    settings: DispatchSettings
    config: ReconcilerConfig


@dataclass(slots=True)
class JobResult:
    """`fixed` = rows this run changed; `details` = named counts for logs, metrics and the CLI."""

    fixed: int = 0
    details: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, amount: int = 1) -> None:
        self.details[key] = self.details.get(key, 0) + amount


JobRun = Callable[[JobContext], Awaitable[JobResult]]
IntervalOf = Callable[[ReconcilerConfig, DispatchSettings], float]


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    description: str
    run: JobRun
    interval: IntervalOf
    # Counted in `phase2_reconcile_fixed_count` (§15.1/§15.2: the §16.2.4 dual-path consistency
    # reconcile; its alert fires when 3 runs in a row fixed something). Routine repairs (a crashed
    # client's lease, a stale heartbeat) are not inconsistencies and only count per job.
    phase2_consistency: bool = False


def configured_job(name: str, description: str, run: JobRun) -> Job:
    """A job run every `config.intervals[name]` (its entry in RECONCILER_INTERVALS, or its default)."""

    def interval(config: ReconcilerConfig, _: DispatchSettings) -> float:
        return config.intervals[name]

    return Job(name, description, run, interval)


FixOne = Callable[[JobContext, uuid.UUID, JobResult], Awaitable[None]]


async def fix_candidates(ctx: JobContext, result: JobResult, fix_one: FixOne, *queries: str, what: str,
                         params: dict[str, object] | None = None, id_field: str = "task_id") -> None:
    """The ids each of `queries` selects (read without locks, at most `batch_size` a query), then fixed one by one,
    each in its own transaction, `fix_one` re-checking its row under a row lock before it changes it. One that lost
    a race with another writer (lock or serialisation conflict) is counted, logged and left for the next run."""
    ids: list[uuid.UUID] = []
    for query in queries:
        cur = await ctx.conn.execute(query, {**(params or {}), "limit": ctx.config.batch_size})
        ids += [row["id"] for row in await cur.fetchall()]
    for item in ids:
        try:
            await fix_one(ctx, item, result)
        except RETRYABLE_ERRORS as exc:
            result.add("skipped_conflict")
            log.warning(f"{what} lost a race; retried next run", extra={id_field: str(item), "error": str(exc)})


async def fix_each(ctx: JobContext, result: JobResult, fix_one: FixOne, ids: list[uuid.UUID], *, what: str,
                   id_field: str = "task_id") -> None:
    """`fix_candidates` for ids a store operation read (libs/tasks/execution_paths.py): each fixed in its own
    transaction; one that lost a race with another writer is counted, logged and left for the next run."""
    for item in ids:
        try:
            await fix_one(ctx, item, result)
        except RETRYABLE_ERRORS as exc:
            result.add("skipped_conflict")
            log.warning(f"{what} lost a race; retried next run", extra={id_field: str(item), "error": str(exc)})


async def send_control(conn: Conn, *, task_id: uuid.UUID, client_id: uuid.UUID, control: ControlKind, reason: str,
                       interrupt_generation: int, collect_request_id: uuid.UUID | None = None,
                       tenant_id: int | None = None) -> None:
    """A TaskControl to the client (libs/tasks/controls.py), the pumps woken at commit."""
    await controls.send_control(conn, task_id=task_id, client_id=client_id, control=control, reason=reason,
                                interrupt_generation=interrupt_generation, tenant_id=tenant_id,
                                collect_request_id=collect_request_id, notify=True)


@dataclass(frozen=True, slots=True)
class Expired:
    """`expire_and_retry`'s outcome: whether the lease was still live (and so ended here), and the business task's
    status after the retry (pending again in the retry lane, or failed at its last attempt; None: not pending)."""

    ended: bool
    business_status: str | None = None


async def expire_and_retry(ctx: JobContext, row: dict[str, Any], *, reason: EndReason, error: str,
                           retry_error: str | None = None, phase: str | None = None) -> Expired:
    """A lease (an execution's, or a legacy lease) that will not bring its result: it ends `expired`, its business
    task is retried (or failed), `task.aborted` is emitted, and a request whose last task failed is finished. `row`
    has the lease's id, monitor_task_id, tenant_id, target_client_id, ai_platform_id, lane, lease_epoch and
    collect_request_id. In the caller's transaction."""
    conn = ctx.conn
    match await execution_paths.end(conn, ExecutionEnd(task_id=row["id"], outcome="expired",
                                                       lease_epoch=row["lease_epoch"], reason=reason, error=error,
                                                       phase=phase)):
        case EndedExecution() as ended:
            pass
        case Stale() | NotFound():  # ended (or re-leased) by another writer since it was read
            return Expired(ended=False)
        case unhandled:
            assert_never(unhandled)
    retried = await retry_business_task(conn, ended.monitor_task_id, max_attempts=ctx.settings.max_dispatch_attempts,
                                        error=retry_error or error)
    status = None if isinstance(retried, Stale) else retried  # Stale: finished meanwhile (a late result applied)
    request = row["collect_request_id"]
    await emit_lifecycle(conn, "task.aborted", tenant_id=ended.tenant_id, client_id=ended.client_id,
                         task_id=ended.task_id, monitor_task_id=ended.monitor_task_id,
                         ai_platform_id=ended.ai_platform_id, lane=ended.lane, reason=reason,
                         collect_request_id=request)
    if status == "failed":
        await refresh_progress(conn, request)
    return Expired(ended=True, business_status=status)
