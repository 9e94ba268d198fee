"""Applying a batch of MonitorResults of one shard in one transaction (contract #8, docs/architecture.md §12).

The batch is applied with set-based statements but with the outcome of applying its results one
by one in delivery order: redelivered result ids are skipped (ledger), the run of each business key
is folded with the success-priority rule before the upsert, an execution is ended by its first
result only, failures are applied before successes (a success in the same batch wins either way).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import assert_never

import msgspec
from psycopg import AsyncPipeline

from libs.contracts.amqp import LifecycleEvent, LifecycleKind, MonitorResult, ProjectionRebuild
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.dispatch_settings import SettingsCache
from libs.ingest.citations import ParsedCitation, parse_citations
from libs.ingest.runs import fold_latest_effective
from libs.mq.topology import LIFECYCLE, PROJECTION
from libs.outbox import OutboxEvent, enqueue_many
from libs.tasks import execution_paths, ingest_ops
from libs.tasks import requests as collect_requests
from libs.tasks.controls import send_control
from libs.tasks.ingest_ops import BusinessTaskOfResult
from libs.tasks.outcomes import NotFound, Stale
from libs.tasks.requests import CountDelta, request_count_delta
from libs.tasks.statuses import EndReason
from libs.tasks.transitions import (
    EndedExecution,
    ExecutionEnd,
    emit_lifecycle,
    finish_business_tasks,
    retry_business_tasks,
)
from services.ingest_shard_workers import queries as q

log = logging.getLogger("ingest.apply")

RunKey = tuple[int, int, int, int, str, str, date]
SUPERSEDED_BY_RESULT: EndReason = "superseded_by_result"



# The JSON records of the batch statements (services/ingest_shard_workers/queries.py names each field and its type):
# msgspec Structs, encoded by name in C, as cheap to build as the tuples they replace.
class _AppliedRow(msgspec.Struct):
    ord: int
    result_id: uuid.UUID
    tenant_id: int
    shard: int
    task_id: uuid.UUID
    monitor_task_id: int
    status: str
    routing_epoch: int


class _RunRow(msgspec.Struct):
    tenant_id: int
    workspace_id: int
    brand_id: int
    question_id: int
    ai_platform_id: int
    collector_type: str
    run_mode: str
    business_date: date
    status: str
    answer_text: str | None
    brand_mentioned: bool
    citation_count: int
    error: str | None
    desktop_task_id: uuid.UUID
    client_id: uuid.UUID
    result_id: uuid.UUID
    started_at: datetime | None
    finished_at: datetime | None


class _CiteRow(msgspec.Struct):
    run_id: int
    tenant_id: int
    brand_id: int
    question_id: int
    ai_platform_id: int
    business_date: date
    fingerprint: str
    url: str
    title: str | None
    position: int | None
    domain: str


def _json(rows: list[_AppliedRow] | list[_RunRow] | list[_CiteRow]) -> str:
    return msgspec.json.encode(rows).decode()


def run_key(r: MonitorResult) -> RunKey:
    return (r.tenant_id, r.brand_id, r.question_id, r.ai_platform_id, r.collector_type, r.run_mode,
            r.business_date)


@dataclass(slots=True)
class BatchOutcome:
    applied: list[MonitorResult] = field(default_factory=list)
    duplicates: int = 0
    # result_id -> reason: results refused as poison (the caller dead-letters them).
    rejected: dict[uuid.UUID, str] = field(default_factory=dict)
    rows_written: int = 0
    rebuilds_requested: int = 0
    # collect_now_first_result_latency_ms observations, recorded by the caller after commit.
    first_result_latencies_ms: list[float] = field(default_factory=list)


def _validate(result: MonitorResult, task: BusinessTaskOfResult | None) -> str | None:
    """Why a result cannot be applied to its business task (poison), or None."""
    if task is None:
        return "unknown_business_task"
    if run_key(result) != task.run_key():
        return "business_key_mismatch"
    return None


async def apply_batch(conn: Conn, results: list[MonitorResult], *, applied_by: str,
                      settings: SettingsCache) -> BatchOutcome:
    """Apply `results` (delivery order) in one transaction; poison results are returned, not applied."""
    outcome = BatchOutcome()
    unique: dict[uuid.UUID, MonitorResult] = {}
    for r in results:
        if r.result_id in unique:
            outcome.duplicates += 1
        else:
            unique[r.result_id] = r
    # Pipelined: BEGIN goes out with the first statement and COMMIT with the last (two round trips fewer per batch;
    # a statement's error still surfaces inside this block and rolls the whole batch back).
    async with pipelined_transaction(conn) as pipe:
        await _apply(conn, list(unique.values()), outcome, applied_by=applied_by, settings=settings, pipe=pipe)
    return outcome


async def _apply(conn: Conn, results: list[MonitorResult], outcome: BatchOutcome, *, applied_by: str,
                 settings: SettingsCache, pipe: AsyncPipeline) -> None:
    """The batch's statements, in this order: lock the business tasks, record the valid results in the ledger,
    upsert the runs, end the executions, retry or complete the business tasks, count request progress, write the
    outbox events. Every statement goes out on `apply_batch`'s pipelined transaction."""
    tasks = await _lock_business_tasks(conn, results)
    valid = _valid_results(results, tasks, outcome)
    if not valid:
        return
    fresh = await _record_applied(conn, valid, outcome, applied_by=applied_by)
    if not fresh:
        return
    outcome.applied = fresh
    written = len(fresh)

    won_keys = await _upsert_runs(conn, fresh, outcome)
    written += len(won_keys)

    enders, ended_rows = await _end_executions(conn, fresh)
    written += ended_rows

    business_before: dict[int, str] = {tid: task.status for tid, task in tasks.items()}
    business_after, settled_rows = await _settle_business_tasks(conn, fresh, enders, business_before, settings)
    written += settled_rows

    await _request_progress(conn, fresh, tasks, business_before, business_after, outcome)

    written += await _write_events(conn, pipe, won_keys, enders, outcome)
    outcome.rows_written += written


async def _lock_business_tasks(conn: Conn, results: list[MonitorResult]) -> dict[int, BusinessTaskOfResult]:
    """The business tasks of `results`, locked (in id order), by id."""
    return await ingest_ops.lock_business_tasks(conn, sorted({r.monitor_task_id for r in results}))


def _valid_results(results: list[MonitorResult], tasks: dict[int, BusinessTaskOfResult],
                   outcome: BatchOutcome) -> list[MonitorResult]:
    """The results that match their business task; the others are recorded in `outcome.rejected` (poison)."""
    valid: list[MonitorResult] = []
    for r in results:
        reason = _validate(r, tasks.get(r.monitor_task_id))
        if reason is None:
            valid.append(r)
        else:
            outcome.rejected[r.result_id] = reason
    return valid


async def _record_applied(conn: Conn, valid: list[MonitorResult], outcome: BatchOutcome, *,
                          applied_by: str) -> list[MonitorResult]:
    """Record `valid` in the applied-results ledger; the fresh ones are returned, those in it already
    (redeliveries) are counted as duplicates."""
    cur = await conn.execute(q.RECORD_APPLIED, {"applied_by": applied_by, "rows": _json([
        _AppliedRow(n, r.result_id, r.tenant_id, r.shard, r.task_id, r.monitor_task_id, r.status,
                    r.routing_epoch)
        for n, r in enumerate(valid)])})
    fresh_ids = {row["result_id"] for row in await cur.fetchall()}
    fresh = [r for r in valid if r.result_id in fresh_ids]
    outcome.duplicates += len(valid) - len(fresh)
    return fresh


async def _end_executions(conn: Conn, fresh: list[MonitorResult]) -> tuple[
        list[tuple[MonitorResult, EndedExecution]], int]:
    """End the executions of `fresh`: (each result that ended its execution with that execution, rows written).
    The first result of an execution ends it; later ones of the same execution only update facts."""
    ended = await execution_paths.end_many(conn, [
        ExecutionEnd(task_id=r.task_id, outcome=r.status, lease_epoch=r.lease_epoch, error=r.error) for r in fresh])
    ended_by_task = {e.task_id: e for e in ended}
    first_of_task: dict[uuid.UUID, uuid.UUID] = {}
    for r in fresh:
        first_of_task.setdefault(r.task_id, r.result_id)
    enders = [(r, ended_by_task[r.task_id]) for r in fresh
              if r.task_id in ended_by_task and first_of_task[r.task_id] == r.result_id]
    return enders, 2 * len(ended)


async def _settle_business_tasks(conn: Conn, fresh: list[MonitorResult],
                                 enders: list[tuple[MonitorResult, EndedExecution]], before: dict[int, str],
                                 settings: SettingsCache) -> tuple[dict[int, str], int]:
    """The business outcome: failed executions retry (or fail) their task, successes complete it and abort its
    other live executions. (the status of every business task after, rows written)"""
    after = dict(before)
    written = 0
    # Failures first: a success of the same business task later in the batch still completes it.
    failed_now = [r for r, _ in enders if r.status == "failed"]
    if failed_now:
        retried = await retry_business_tasks(conn, {r.monitor_task_id: r.error for r in failed_now},
                                             max_attempts=(await settings.get(conn)).max_dispatch_attempts)
        after.update(retried)
        written += len(retried)
    succeeded_ids = sorted({r.monitor_task_id for r in fresh if r.status == "succeeded"})
    completed = await finish_business_tasks(conn, succeeded_ids, status="completed")
    for tid in completed:
        after[tid] = "completed"
    written += len(completed)
    if succeeded_ids:
        written += await _abort_other_executions(conn, succeeded_ids, [r.task_id for r in fresh])
    return after, written


async def _write_events(conn: Conn, pipe: AsyncPipeline, won_keys: set[RunKey],
                        enders: list[tuple[MonitorResult, EndedExecution]], outcome: BatchOutcome) -> int:
    """Projection rebuilds of the changed runs, then the lifecycle event of each ended execution, into the outbox;
    returns how many events were written."""
    events = await _request_projections(conn, won_keys, outcome)
    events += [_result_lifecycle(r, execution) for r, execution in enders]
    if events and not conn.info.transaction_status:
        # Nothing was synced since the pipeline's BEGIN (no run row changed: a failed result for a key that had
        # succeeded already), so libpq still reports the connection idle and the outbox refuses to write.
        await pipe.sync()
    await enqueue_many(conn, events)
    return len(events)


async def _upsert_runs(conn: Conn, fresh: list[MonitorResult], outcome: BatchOutcome) -> set[RunKey]:
    """Upsert the effective result of each business key; write citations of the runs that changed."""
    winners = list(fold_latest_effective(fresh, run_key).values())
    parsed: dict[uuid.UUID, list[ParsedCitation]] = {
        r.result_id: parse_citations(r.citations) if r.status == "succeeded" else [] for r in winners}
    cur = await conn.execute(q.UPSERT_RUNS, {"rows": _json([
        _RunRow(r.tenant_id, r.workspace_id, r.brand_id, r.question_id, r.ai_platform_id, r.collector_type, r.run_mode,
                r.business_date, r.status, r.answer_text, r.brand_mentioned and r.status == "succeeded",
                len(parsed[r.result_id]), r.error, r.task_id, r.client_id, r.result_id, r.started_at, r.finished_at)
        for r in winners])})
    run_ids = {row["result_id"]: int(row["id"]) for row in await cur.fetchall()}
    if not run_ids:
        return set()
    won = [r for r in winners if r.result_id in run_ids]
    cites = [(run_ids[r.result_id], r, c) for r in won for c in parsed[r.result_id]]
    params = {"run_ids": sorted(run_ids.values()), "cites": _json([
        _CiteRow(rid, r.tenant_id, r.brand_id, r.question_id, r.ai_platform_id, r.business_date, c.fingerprint, c.url,
                 c.title, c.position, c.domain) for rid, r, c in cites])}
    async with conn.pipeline():
        await conn.execute(q.DELETE_STALE_PARSE_RESULTS, params)
        await conn.execute(q.DELETE_STALE_CITATION_FACTS, params)
        if cites:
            await conn.execute(q.UPSERT_PARSE_RESULTS, params)
            await conn.execute(q.UPSERT_CITATION_FACTS, params)
    outcome.rows_written += 2 * len(cites)
    return {run_key(r) for r in won}


async def _abort_other_executions(conn: Conn, monitor_task_ids: list[int], own_task_ids: list[uuid.UUID]) -> int:
    aborted = 0
    for other in await ingest_ops.other_live_executions(conn, monitor_task_ids, own_task_ids):
        match await execution_paths.end(conn, ExecutionEnd(task_id=other.id, outcome="aborted",
                                                           reason=SUPERSEDED_BY_RESULT)):
            case EndedExecution():
                pass
            case Stale() | NotFound():  # ended by another writer since it was read: nothing to abort
                continue
            case unhandled:
                assert_never(unhandled)
        aborted += 1
        client_id = other.target_client_id
        await send_control(conn, task_id=other.id, client_id=client_id, control="cancelled",
                           reason=SUPERSEDED_BY_RESULT, interrupt_generation=other.interrupt_generation,
                           tenant_id=other.tenant_id, collect_request_id=other.collect_request_id)
        await emit_lifecycle(conn, "task.aborted", tenant_id=other.tenant_id, client_id=client_id,
                             task_id=other.id, monitor_task_id=other.monitor_task_id,
                             ai_platform_id=other.ai_platform_id, lane=other.lane, reason=SUPERSEDED_BY_RESULT,
                             collect_request_id=other.collect_request_id)
        log.info("active execution aborted: business task already completed",
                 extra={"task_id": str(other.id), "monitor_task_id": other.monitor_task_id,
                        "tenant_id": other.tenant_id, "client_id": str(client_id)})
    return 3 * aborted


async def _request_progress(conn: Conn, fresh: list[MonitorResult], tasks: dict[int, BusinessTaskOfResult],
                            before: dict[int, str], after: dict[int, str], outcome: BatchOutcome) -> None:
    """first_result_at and terminal counters of the collect-now requests these results belong to."""
    deltas: dict[tuple[uuid.UUID, int], CountDelta] = {}
    counted: set[int] = set()
    for r in fresh:
        request_id = tasks[r.monitor_task_id].collect_request_id or r.collect_request_id
        if request_id is None:
            continue
        key = (request_id, r.tenant_id)
        delta = deltas.get(key, CountDelta())
        if r.monitor_task_id not in counted:
            counted.add(r.monitor_task_id)
            change = request_count_delta(before[r.monitor_task_id], after[r.monitor_task_id])
            delta = CountDelta(completed=delta.completed + change.completed, failed=delta.failed + change.failed)
        deltas[key] = delta
    for (request_id, tenant_id), delta in sorted(deltas.items(), key=lambda item: str(item[0][0])):
        recorded = await collect_requests.record_results(conn, request_id=request_id, tenant_id=tenant_id,
                                                         delta=delta)
        if recorded is None:
            continue
        if recorded.first_result:
            outcome.first_result_latencies_ms.append(max(0.0, recorded.since_created_ms))
        status = recorded.final_status()
        if status is not None:
            await collect_requests.finish(conn, request_id=request_id, status=status)
            log.info("collect request finished", extra={"collect_request_id": str(request_id),
                                                        "tenant_id": tenant_id, "status": status})
        outcome.rows_written += 1


async def _request_projections(conn: Conn, won_keys: set[RunKey], outcome: BatchOutcome) -> list[OutboxEvent]:
    """Coalesced rebuild requests; a ProjectionRebuild event only for keys whose row is new."""
    keys = sorted({(k[0], k[1], k[6]) for k in won_keys})
    if not keys:
        return []
    cur = await conn.execute(q.REQUEST_PROJECTION, {"tenant_ids": [k[0] for k in keys],
                                                    "brand_ids": [k[1] for k in keys],
                                                    "dates": [k[2] for k in keys]})
    rows = await cur.fetchall()
    outcome.rows_written += len(rows)
    now = datetime.now(UTC)
    events = [OutboxEvent(exchange=PROJECTION, routing_key="rebuild", tenant_id=int(row["tenant_id"]),
                          message=ProjectionRebuild(tenant_id=int(row["tenant_id"]), brand_id=int(row["brand_id"]),
                                                    business_date=row["business_date"], requested_at=now))
              for row in rows if row["inserted"]]
    outcome.rebuilds_requested += len(events)
    return events


def _result_lifecycle(r: MonitorResult, execution: EndedExecution) -> OutboxEvent:
    """The `task.completed` / `task.failed` event (the same message `emit_lifecycle` writes)."""
    event: LifecycleKind = "task.completed" if r.status == "succeeded" else "task.failed"
    message = LifecycleEvent(event=event, tenant_id=r.tenant_id, occurred_at=datetime.now(UTC), client_id=r.client_id,
                             task_id=r.task_id, monitor_task_id=r.monitor_task_id, ai_platform_id=r.ai_platform_id,
                             lane=execution.lane, reason=None if r.status == "succeeded" else "result_failed",
                             collect_request_id=r.collect_request_id)
    return OutboxEvent(exchange=LIFECYCLE, routing_key=event, message=message, tenant_id=r.tenant_id)
