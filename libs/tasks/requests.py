"""Collect-now requests (`monitoring_collect_requests`): their statuses, the rules that move them, and every
transition another service makes on them, with its SQL (docs/architecture.md §7.4, §13.5).

    accepted --(coordinator: first task dispatched)--> dispatching --(hub: a task leased)--> running
    accepted | dispatching | running --(ingest or reconciler: every requested task terminal)--> succeeded | partial
        | failed
    accepted | dispatching | running --(collect-now: a newer click on the same client)--> superseded
    accepted | dispatching | running --(reconciler: past its TTL, nothing running)--> timed_out

Every statement that reads or writes the table is here, whoever runs it, each behind one typed operation: collect-now
creates the row (`create`, in its accept transaction) and supersedes older ones (`supersede`), the coordinator marks
dispatches (`mark_dispatched`), the hub marks leases and preemptions (`mark_running`, `mark_first_preempt`), ingest
records results and finishes requests (`record_results`, `finish`), the reconciler recounts (`refresh_progress`), times
out (`timed_out_candidates`, `time_out`) and warns (`warn_no_dispatch`).

The SQL is module-private `_NAME` constants, next to the operation that runs it (docs/architecture.md "The task store:
the click's and ingest's operations"). MARK_DISPATCHED, MARK_RUNNING and FIRST_PREEMPT are still public while the
coordinator and the hub run them themselves (tests/unit/test_task_store_boundary.py, STILL_OUTSIDE); their operations
are here already. The operations on the click's pipelined transaction return `Queued` answers (libs/tasks/queued.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import msgspec

from libs.db.pool import Conn
from libs.domain.lanes import NORMAL_PRIORITY
from libs.tasks.business import DEMOTE_TIMED_OUT as _DEMOTE_TIMED_OUT
from libs.tasks.queued import Queued
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, ACTIVE_LEASE_SQL, FINISHED_BUSINESS, sql_list

log = logging.getLogger("collect_requests")

RequestStatus = Literal["accepted", "dispatching", "running", "partial", "succeeded", "failed", "timed_out",
                        "superseded"]
RequestFinal = Literal["succeeded", "partial", "failed"]
# Statuses a request may still move out of; the others are final.
OPEN_REQUEST: tuple[RequestStatus, ...] = ("accepted", "dispatching", "running")
OPEN_REQUEST_SQL = sql_list(OPEN_REQUEST)
TERMINAL_BUSINESS = frozenset(FINISHED_BUSINESS)


# ---- rules (pure) ------------------------------------------------------------------------------------------------

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


def request_final_status(requested: int, completed: int, failed: int) -> RequestFinal | None:
    """Final status of a request once every requested task is terminal, else None."""
    if requested <= 0 or completed + failed < requested:
        return None
    if failed == 0:
        return "succeeded"
    if completed == 0:
        return "failed"
    return "partial"


def request_status_after(status: str, *, requested: int, completed: int, failed: int) -> str:
    """An open request's status after its counters moved: final once every requested task is terminal."""
    if status not in OPEN_REQUEST:
        return status
    return request_final_status(requested, completed, failed) or status


# ---- accepted: the click (services/collect_now_api, in its pipelined transaction) ---------------------------------

_CREATE = """
INSERT INTO monitoring_collect_requests
    (id, tenant_id, workspace_id, brand_id, keyword_id, requested_by_user_id, target_client_id, scope_hash,
     request_scope, status, preempt, interrupt_generation, requested_task_count, aborted_queued_count,
     interrupt_requested_count, ttl_expires_at, traceparent)
VALUES (%(id)s, %(tenant_id)s, %(workspace_id)s, %(brand_id)s, %(keyword_id)s, %(user_id)s, %(client_id)s,
        %(scope_hash)s, %(scope)s, 'accepted', %(preempt)s, %(generation)s, %(requested)s, %(aborted_queued)s,
        %(interrupt_requested)s, now() + make_interval(secs => %(ttl_s)s), %(traceparent)s)
RETURNING *
"""

_SUPERSEDE = f"""
UPDATE monitoring_collect_requests
SET status = 'superseded', superseded_by_request_id = %(request_id)s, finished_at = now(), updated_at = now()
WHERE id = ANY(%(old_ids)s::uuid[]) AND tenant_id = %(tenant_id)s AND status IN {OPEN_REQUEST_SQL}
RETURNING id
"""


class CreatedRequest(msgspec.Struct, frozen=True):
    id: uuid.UUID
    status: RequestStatus
    ttl_expires_at: datetime


async def create(conn: Conn, *, request_id: uuid.UUID, tenant_id: int, workspace_id: int, brand_id: int,
                 keyword_id: int | None, user_id: int, client_id: uuid.UUID | None, scope_hash: str,
                 scope: Mapping[str, Any], preempt: bool, generation: int, requested: int, aborted_queued: int,
                 interrupt_requested: int, ttl_s: int, traceparent: str | None) -> Queued[CreatedRequest]:
    """Collect-now accepted a click: the request row, `accepted`, its TTL running from now (docs/architecture.md
    §13.5). Queued on the click's transaction."""
    cur = await conn.execute(_CREATE, {
        "id": request_id, "tenant_id": tenant_id, "workspace_id": workspace_id, "brand_id": brand_id,
        "keyword_id": keyword_id, "user_id": user_id, "client_id": client_id, "scope_hash": scope_hash,
        "scope": msgspec.json.encode(scope).decode(), "preempt": preempt, "generation": generation,
        "requested": requested, "aborted_queued": aborted_queued, "interrupt_requested": interrupt_requested,
        "ttl_s": ttl_s, "traceparent": traceparent})

    async def read() -> CreatedRequest:
        row = await cur.fetchone()
        assert row is not None, "an INSERT ... RETURNING returns its row"
        return CreatedRequest(id=row["id"], status=row["status"], ttl_expires_at=row["ttl_expires_at"])

    return Queued(read)


async def supersede(conn: Conn, *, request_id: uuid.UUID, tenant_id: int,
                    old_ids: list[uuid.UUID]) -> Queued[list[uuid.UUID]]:
    """A newer click (`request_id`) on the same client replaces these open requests: the ids it superseded (a request
    that finished meanwhile is left alone). Queued on the click's transaction; nothing is sent without `old_ids`."""
    if not old_ids:
        return Queued.of([])
    cur = await conn.execute(_SUPERSEDE, {"request_id": request_id, "tenant_id": tenant_id, "old_ids": old_ids})

    async def read() -> list[uuid.UUID]:
        return [row["id"] for row in await cur.fetchall()]

    return Queued(read)


# ---- dispatching, running: the coordinator and the hub ------------------------------------------------------------

# The coordinator dispatched tasks of these requests (ids[i]: counts[i] tasks): counted, first dispatch stamped,
# accepted -> dispatching. Returns each request's id, whether this was its first dispatch, and its age.
MARK_DISPATCHED = """
WITH counts AS (
    SELECT * FROM unnest(%(ids)b::uuid[], %(counts)b::int[]) AS c(id, n)
), old AS (
    SELECT r.id, r.first_dispatched_at IS NULL AS first
    FROM monitoring_collect_requests r JOIN counts c ON c.id = r.id
    ORDER BY r.id
    FOR UPDATE OF r
)
UPDATE monitoring_collect_requests r
SET dispatched_task_count = r.dispatched_task_count + c.n,
    first_dispatched_at = coalesce(r.first_dispatched_at, now()),
    status = CASE WHEN r.status = 'accepted' THEN 'dispatching' ELSE r.status END,
    updated_at = now()
FROM counts c JOIN old o ON o.id = c.id
WHERE r.id = c.id
RETURNING r.id, o.first, extract(epoch FROM (clock_timestamp() - r.created_at)) * 1000 AS latency_ms
"""

# The hub leased a task of the request: accepted | dispatching -> running.
MARK_RUNNING = """
UPDATE monitoring_collect_requests SET status = 'running', updated_at = now()
WHERE id = %(request_id)s AND tenant_id = %(tenant_id)s AND status IN ('accepted', 'dispatching')
"""

# The hub: a preempted execution acknowledged the click's interrupt; the first one stamps the request (its age).
FIRST_PREEMPT = """
UPDATE monitoring_collect_requests
SET first_preempt_at = coalesce(first_preempt_at, now()), updated_at = now()
WHERE id = %(request_id)s AND tenant_id = %(tenant_id)s
RETURNING extract(epoch FROM (clock_timestamp() - created_at)) * 1000 AS age_ms
"""


class Dispatched(msgspec.Struct, frozen=True):
    """A request `mark_dispatched` counted: whether this was its first dispatch, and its age then (ms)."""

    id: uuid.UUID
    first: bool
    latency_ms: float


async def mark_dispatched(conn: Conn, counts: Mapping[uuid.UUID, int]) -> Queued[list[Dispatched]]:
    """The coordinator dispatched `counts[id]` tasks of each request: counted, the first dispatch stamped, accepted
    -> dispatching. Queued on the pass's transaction; nothing is sent for no request."""
    if not counts:
        return Queued.of([])
    cur = await conn.execute(MARK_DISPATCHED, {"ids": list(counts), "counts": list(counts.values())})

    async def read() -> list[Dispatched]:
        return [Dispatched(id=r["id"], first=bool(r["first"]), latency_ms=float(r["latency_ms"]))
                for r in await cur.fetchall()]

    return Queued(read)


async def mark_running(conn: Conn, *, request_id: uuid.UUID, tenant_id: int) -> None:
    """The hub leased a task of the request: accepted | dispatching -> running (a request already running, or
    finished, is left as it is)."""
    await conn.execute(MARK_RUNNING, {"request_id": request_id, "tenant_id": tenant_id})


async def mark_first_preempt(conn: Conn, *, request_id: uuid.UUID, tenant_id: int) -> float | None:
    """A preempted execution acknowledged the click's interrupt: the first one stamps the request. The request's age
    (ms), None when the tenant has no such request."""
    cur = await conn.execute(FIRST_PREEMPT, {"request_id": request_id, "tenant_id": tenant_id})
    row = await cur.fetchone()
    return float(row["age_ms"]) if row else None


# ---- results: ingest ----------------------------------------------------------------------------------------------

# First result stamped, terminal-task counters moved (the status follows in Python, request_status_after).
_RECORD_RESULTS = """
WITH prev AS (
    SELECT id, first_result_at AS previous_first_result_at
    FROM monitoring_collect_requests WHERE id = %(id)s AND tenant_id = %(tenant_id)s
    FOR UPDATE
)
UPDATE monitoring_collect_requests r
SET first_result_at = coalesce(r.first_result_at, now()),
    completed_task_count = greatest(r.completed_task_count + %(completed)s, 0),
    failed_task_count = greatest(r.failed_task_count + %(failed)s, 0),
    updated_at = now()
FROM prev
WHERE r.id = prev.id
RETURNING r.status, r.requested_task_count, r.completed_task_count, r.failed_task_count,
          prev.previous_first_result_at IS NULL AS first_result,
          extract(epoch FROM now() - r.created_at) * 1000 AS since_created_ms
"""

_FINISH = f"""
UPDATE monitoring_collect_requests
SET status = %(status)s, finished_at = coalesce(finished_at, now()), updated_at = now()
WHERE id = %(id)s AND status IN {OPEN_REQUEST_SQL}
"""


class RecordedResults(msgspec.Struct, frozen=True):
    """A request after `record_results`: its status and counters, whether these were its first results, and its
    age (ms)."""

    status: RequestStatus
    requested_task_count: int
    completed_task_count: int
    failed_task_count: int
    first_result: bool
    since_created_ms: float

    def final_status(self) -> RequestFinal | None:
        """The final status the request moves to now: it is open and every requested task is terminal
        (request_status_after). None: it stays as it is."""
        if self.status not in OPEN_REQUEST:
            return None
        return request_final_status(self.requested_task_count, self.completed_task_count, self.failed_task_count)


async def record_results(conn: Conn, *, request_id: uuid.UUID, tenant_id: int,
                         delta: CountDelta) -> RecordedResults | None:
    """Results of the request's tasks were applied: the first result stamped, its terminal-task counters moved by
    `delta` (never below 0). None: the tenant has no such request."""
    cur = await conn.execute(_RECORD_RESULTS, {"id": request_id, "tenant_id": tenant_id,
                                               "completed": delta.completed, "failed": delta.failed})
    row = await cur.fetchone()
    if row is None:
        return None
    return RecordedResults(status=row["status"], requested_task_count=int(row["requested_task_count"]),
                           completed_task_count=int(row["completed_task_count"]),
                           failed_task_count=int(row["failed_task_count"]), first_result=bool(row["first_result"]),
                           since_created_ms=float(row["since_created_ms"]))


async def finish(conn: Conn, *, request_id: uuid.UUID, status: RequestFinal) -> bool:
    """An open request whose every task is terminal gets its final status; False when it was no longer open."""
    cur = await conn.execute(_FINISH, {"id": request_id, "status": status})
    return cur.rowcount > 0


# ---- the reconciler: recount, time out, warn ----------------------------------------------------------------------

# A task of the request became terminal outside ingest: recount from the business tasks ...
_RECOUNT = """
SELECT r.requested_task_count, r.completed_task_count, r.failed_task_count, r.status,
       count(*) FILTER (WHERE t.status = 'completed') AS completed,
       count(*) FILTER (WHERE t.status IN ('failed', 'expired', 'skipped')) AS failed
FROM monitoring_collect_requests r
LEFT JOIN monitoring_collect_tasks t ON t.collect_request_id = r.id AND t.tenant_id = r.tenant_id
WHERE r.id = %(id)s
GROUP BY r.id
"""

# ... never lowering a count, and finish the request when every task is terminal.
_UPDATE_COUNTS = f"""
UPDATE monitoring_collect_requests
SET completed_task_count = greatest(completed_task_count, %(completed)s),
    failed_task_count = greatest(failed_task_count, %(failed)s),
    status = coalesce(%(final)s, status),
    finished_at = CASE WHEN %(final)s::text IS NULL THEN finished_at ELSE now() END,
    updated_at = now()
WHERE id = %(id)s AND status IN {OPEN_REQUEST_SQL}
"""

# A task of the request still running, on either path: an active execution, or a live legacy lease.
_ACTIVE_WORK_OF_REQUEST_SQL = f"""
(EXISTS (SELECT 1 FROM monitoring_collect_tasks t JOIN desktop_tasks d ON d.monitor_task_id = t.id
         WHERE t.collect_request_id = r.id AND t.tenant_id = r.tenant_id
           AND d.status IN {ACTIVE_EXECUTION_SQL})
 OR EXISTS (SELECT 1 FROM monitoring_collect_tasks t JOIN legacy_leases l ON l.monitor_task_id = t.id
            WHERE t.collect_request_id = r.id AND t.tenant_id = r.tenant_id AND l.status IN {ACTIVE_LEASE_SQL}))
"""

# Past its TTL, nothing running (read without locks; `time_out` re-checks under the row lock).
_TIME_OUT_CANDIDATES = f"""
SELECT r.id FROM monitoring_collect_requests r
WHERE r.status IN ('accepted', 'dispatching', 'running') AND r.ttl_expires_at < now()
  AND (r.status <> 'running' OR NOT {_ACTIVE_WORK_OF_REQUEST_SQL})
ORDER BY r.ttl_expires_at
LIMIT %(limit)s
"""

_TIME_OUT = f"""
UPDATE monitoring_collect_requests r
SET status = 'timed_out', finished_at = now(), updated_at = now()
WHERE r.id = %(id)s AND r.status IN ('accepted', 'dispatching', 'running') AND r.ttl_expires_at < now()
  AND (r.status <> 'running' OR NOT {_ACTIVE_WORK_OF_REQUEST_SQL})
RETURNING r.id, r.tenant_id, r.status, r.target_client_id, r.requested_task_count, r.dispatched_task_count
"""

# Accepted long ago and nothing dispatched: warned once.
_WARN_NO_DISPATCH = """
UPDATE monitoring_collect_requests
SET no_dispatch_warned_at = now(), updated_at = now()
WHERE status = 'accepted' AND dispatched_task_count = 0 AND first_dispatched_at IS NULL
  AND no_dispatch_warned_at IS NULL
  AND created_at < now() - make_interval(secs => %(warn_s)s)
RETURNING id, tenant_id, target_client_id, created_at
"""


async def refresh_progress(conn: Conn, request_id: uuid.UUID | None) -> str | None:
    """After a task of the request became terminal outside ingest (the reconciler): recount from the business tasks
    (idempotent, never lowers a count) and finish the request when all its tasks are terminal. Returns the final
    status, if it finished now."""
    if request_id is None:
        return None
    cur = await conn.execute(_RECOUNT, {"id": request_id})
    row = await cur.fetchone()
    if row is None or row["status"] not in OPEN_REQUEST:
        return None
    completed = max(int(row["completed"]), int(row["completed_task_count"]))
    failed = max(int(row["failed"]), int(row["failed_task_count"]))
    final = request_final_status(int(row["requested_task_count"]), completed, failed)
    await conn.execute(_UPDATE_COUNTS, {"id": request_id, "completed": completed, "failed": failed, "final": final})
    if final is not None:
        log.info("collect request finished by reconcile", extra={"collect_request_id": str(request_id),
                                                                 "status": final})
    return final


class TimedOut(msgspec.Struct, frozen=True):
    """A request `time_out` ended, and how many of its pending tasks left the high lane."""

    id: uuid.UUID
    tenant_id: int
    target_client_id: uuid.UUID | None
    requested_task_count: int
    dispatched_task_count: int
    tasks_demoted: int


class NoDispatchWarning(msgspec.Struct, frozen=True):
    id: uuid.UUID
    tenant_id: int
    target_client_id: uuid.UUID | None
    created_at: datetime


async def timed_out_candidates(conn: Conn, *, limit: int) -> list[uuid.UUID]:
    """Open requests past their TTL with nothing running (oldest TTL first, at most `limit`), read without locks."""
    cur = await conn.execute(_TIME_OUT_CANDIDATES, {"limit": limit})
    return [row["id"] for row in await cur.fetchall()]


async def time_out(conn: Conn, request_id: uuid.UUID) -> TimedOut | None:
    """accepted | dispatching | running -> timed_out, when past its TTL with nothing running (re-checked under the
    row lock); its pending high tasks not executing leave the high lane, unbound (docs/architecture.md §10.6). None:
    the request no longer qualifies. In the caller's transaction."""
    cur = await conn.execute(_TIME_OUT, {"id": request_id})
    row = await cur.fetchone()
    if row is None:
        return None
    demoted = await conn.execute(_DEMOTE_TIMED_OUT, {"id": request_id, "tenant_id": row["tenant_id"],
                                                     "normal_priority": NORMAL_PRIORITY})
    return TimedOut(id=row["id"], tenant_id=int(row["tenant_id"]), target_client_id=row["target_client_id"],
                    requested_task_count=int(row["requested_task_count"]),
                    dispatched_task_count=int(row["dispatched_task_count"]), tasks_demoted=demoted.rowcount)


async def warn_no_dispatch(conn: Conn, *, warn_s: float) -> list[NoDispatchWarning]:
    """Requests accepted more than `warn_s` ago with nothing dispatched, each stamped so it is warned of once."""
    cur = await conn.execute(_WARN_NO_DISPATCH, {"warn_s": warn_s})
    return [NoDispatchWarning(id=r["id"], tenant_id=int(r["tenant_id"]), target_client_id=r["target_client_id"],
                              created_at=r["created_at"]) for r in await cur.fetchall()]


# The click's statements of this table, planned by every new collect-now connection (libs/tasks/clicks.py,
# CLICK_WARM_UP).
CLICK_STATEMENTS: tuple[str, ...] = (_SUPERSEDE, _CREATE)
