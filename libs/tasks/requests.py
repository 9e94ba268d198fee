"""Collect-now requests (`monitoring_collect_requests`): their statuses, the rules that move them, and every
transition another service makes on them, with its SQL (docs/architecture.md §7.4, §13.5).

    accepted --(coordinator: first task dispatched)--> dispatching --(hub: a task leased)--> running
    accepted | dispatching | running --(ingest or reconciler: every requested task terminal)--> succeeded | partial
        | failed
    accepted | dispatching | running --(collect-now: a newer click on the same client)--> superseded
    accepted | dispatching | running --(reconciler: past its TTL, nothing running)--> timed_out

Every statement that writes the table is here, whoever runs it: collect-now-api creates the row (CREATE, in its accept
transaction) and supersedes older ones, the coordinator marks dispatches, the hub marks leases and preemptions, ingest
records results and finishes requests, the reconciler recounts, times out and warns.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Literal

from libs.db.pool import Conn
from libs.tasks.statuses import ACTIVE_EXECUTION_SQL, ACTIVE_LEASE_SQL, sql_list

log = logging.getLogger("collect_requests")

RequestStatus = Literal["accepted", "dispatching", "running", "partial", "succeeded", "failed", "timed_out",
                        "superseded"]
RequestFinal = Literal["succeeded", "partial", "failed"]
# Statuses a request may still move out of; the others are final.
OPEN_REQUEST: tuple[RequestStatus, ...] = ("accepted", "dispatching", "running")
OPEN_REQUEST_SQL = sql_list(OPEN_REQUEST)
TERMINAL_BUSINESS = frozenset({"completed", "failed", "skipped", "expired"})


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


# ---- transitions -------------------------------------------------------------------------------------------------

# Collect-now accepted a click: the request row, in the click's transaction (docs/architecture.md §13.5).
CREATE = """
INSERT INTO monitoring_collect_requests
    (id, tenant_id, workspace_id, brand_id, keyword_id, requested_by_user_id, target_client_id, scope_hash,
     request_scope, status, preempt, interrupt_generation, requested_task_count, aborted_queued_count,
     interrupt_requested_count, ttl_expires_at, traceparent)
VALUES (%(id)s, %(tenant_id)s, %(workspace_id)s, %(brand_id)s, %(keyword_id)s, %(user_id)s, %(client_id)s,
        %(scope_hash)s, %(scope)s, 'accepted', %(preempt)s, %(generation)s, %(requested)s, %(aborted_queued)s,
        %(interrupt_requested)s, now() + make_interval(secs => %(ttl_s)s), %(traceparent)s)
RETURNING *
"""

# The coordinator dispatched tasks of these requests (ids[i]: counts[i] tasks): counted, first dispatch stamped,
# accepted -> dispatching. Returns each request's id, whether this was its first dispatch, and its age.
MARK_DISPATCHED = """
WITH counts AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(counts)s::int[]) AS c(id, n)
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

# Collect-now: a newer click on the same client replaces these open requests.
SUPERSEDE = f"""
UPDATE monitoring_collect_requests
SET status = 'superseded', superseded_by_request_id = %(request_id)s, finished_at = now(), updated_at = now()
WHERE id = ANY(%(old_ids)s::uuid[]) AND tenant_id = %(tenant_id)s AND status IN {OPEN_REQUEST_SQL}
RETURNING id
"""

# Ingest: results of the request's tasks: first result stamped, terminal-task counters moved (the status follows
# in Python, request_status_after).
RECORD_RESULTS = """
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

# The reconciler made a task of the request terminal: recount from the business tasks ...
RECOUNT = """
SELECT r.requested_task_count, r.completed_task_count, r.failed_task_count, r.status,
       count(*) FILTER (WHERE t.status = 'completed') AS completed,
       count(*) FILTER (WHERE t.status IN ('failed', 'expired', 'skipped')) AS failed
FROM monitoring_collect_requests r
LEFT JOIN monitoring_collect_tasks t ON t.collect_request_id = r.id AND t.tenant_id = r.tenant_id
WHERE r.id = %(id)s
GROUP BY r.id
"""

# ... never lowering a count, and finish the request when every task is terminal.
UPDATE_COUNTS = f"""
UPDATE monitoring_collect_requests
SET completed_task_count = greatest(completed_task_count, %(completed)s),
    failed_task_count = greatest(failed_task_count, %(failed)s),
    status = coalesce(%(final)s, status),
    finished_at = CASE WHEN %(final)s::text IS NULL THEN finished_at ELSE now() END,
    updated_at = now()
WHERE id = %(id)s AND status IN {OPEN_REQUEST_SQL}
"""


# Ingest: a request whose every task is terminal gets its final status (request_status_after).
FINISH = f"""
UPDATE monitoring_collect_requests
SET status = %(status)s, finished_at = coalesce(finished_at, now()), updated_at = now()
WHERE id = %(id)s AND status IN {OPEN_REQUEST_SQL}
"""


# A task of the request still running, on either path: an active execution, or a live legacy lease.
ACTIVE_WORK_OF_REQUEST_SQL = f"""
(EXISTS (SELECT 1 FROM monitoring_collect_tasks t JOIN desktop_tasks d ON d.monitor_task_id = t.id
         WHERE t.collect_request_id = r.id AND t.tenant_id = r.tenant_id
           AND d.status IN {ACTIVE_EXECUTION_SQL})
 OR EXISTS (SELECT 1 FROM monitoring_collect_tasks t JOIN legacy_leases l ON l.monitor_task_id = t.id
            WHERE t.collect_request_id = r.id AND t.tenant_id = r.tenant_id AND l.status IN {ACTIVE_LEASE_SQL}))
"""


# The reconciler: past its TTL with nothing running -> timed_out.
TIME_OUT = f"""
UPDATE monitoring_collect_requests r
SET status = 'timed_out', finished_at = now(), updated_at = now()
WHERE r.id = %(id)s AND r.status IN ('accepted', 'dispatching', 'running') AND r.ttl_expires_at < now()
  AND (r.status <> 'running' OR NOT {ACTIVE_WORK_OF_REQUEST_SQL})
RETURNING r.id, r.tenant_id, r.status, r.target_client_id, r.requested_task_count, r.dispatched_task_count
"""


# The reconciler: accepted long ago and nothing dispatched: warned once.
WARN_NO_DISPATCH = """
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
    cur = await conn.execute(RECOUNT, {"id": request_id})
    row = await cur.fetchone()
    if row is None or row["status"] not in OPEN_REQUEST:
        return None
    completed = max(int(row["completed"]), int(row["completed_task_count"]))
    failed = max(int(row["failed"]), int(row["failed_task_count"]))
    final = request_final_status(int(row["requested_task_count"]), completed, failed)
    await conn.execute(UPDATE_COUNTS, {"id": request_id, "completed": completed, "failed": failed, "final": final})
    if final is not None:
        log.info("collect request finished by reconcile", extra={"collect_request_id": str(request_id),
                                                                 "status": final})
    return final
