"""The two execution paths behind one interface (docs/architecture.md "The task store: Executions").

`Executions` is the lease protocol as operations: dispatch (`create`), the lease (`pick`, `mark_leased`), `extend`,
the result (`claim_result`, `release_result_claim`, `mark_result_received`), ending (`end_one`, `end_many`), a
click's preemption (`preempt_scheduled`), a broken login (`release_unhealthy`), and the reconciler's lease jobs
(expired, offline, overdue-interrupt and unknown work). It has two implementations, `DesktopTaskExecutions`
(libs/tasks/executions.py: `desktop_tasks` + `desktop_task_attempts`) and `LegacyExecutions`
(libs/tasks/legacy.py: `legacy_leases` + the business row's lease), picked once by the task's `execution_owner`
(`executions_for`). Where a caller works on both at once (a lease call takes work of either path, a task id may name
either, a click preempts on both, a reconcile sweep covers both) the functions below run over `PATHS`, so no caller
branches on the path.

The SQL of each path is module constants of its implementation module, private (`_NAME`); a statement over both
tables (the capacity, the replay, a replacement's name) is here or in libs/tasks/fragments.py. An operation whose
move matches nothing answers a typed outcome of libs/tasks/outcomes.py (`Stale`, `NotFound`, `Fenced`), never None.

To change the lease protocol: this Protocol, `DesktopTaskExecutions`, `LegacyExecutions` (and a function here if
the change is over both).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Protocol, TypeVar, runtime_checkable

from libs.db.pool import Conn
from libs.tasks import executions as desktop_path
from libs.tasks import legacy as legacy_path
from libs.tasks.fragments import CLIENT_CAPACITY_SQL
from libs.tasks.outcomes import Fenced, NotFound, Stale
from libs.tasks.queued import Queued
from libs.tasks.records import (
    Done,
    EndedExecution,
    ExecutionEnd,
    ExecutionOwner,
    ExpiringLease,
    Extended,
    InterruptReplay,
    Leased,
    LeaseState,
    Offer,
    OverdueInterrupt,
    Preempted,
    QueuedReplay,
    QueuedWork,
    ReleasedWork,
    ResultClaim,
    UnknownExecution,
    UnknownMarked,
    from_rows,
)


@runtime_checkable
class Executions(Protocol):
    """One execution path's lease protocol. Every operation runs in the caller's transaction (or pipeline)."""

    @property
    def owner(self) -> ExecutionOwner: ...

    async def create(self, conn: Conn, rows: list[dict[str, Any]], *, ts: datetime) -> None: ...

    async def pick(self, conn: Conn, *, client_id: uuid.UUID, tenant_id: int,
                   max_tasks: int) -> Queued[list[Offer]]: ...

    async def mark_leased(self, conn: Conn, task_id: uuid.UUID, *, epoch: int, token_hash: str,
                          ttl_s: float) -> Queued[Leased | Stale]: ...

    async def extend(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int, client_id: uuid.UUID, epoch: int,
                     token_hash: str, ttl_s: float, phase: str | None) -> Extended | Fenced: ...

    async def lease_state(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int,
                          for_update: bool = False) -> LeaseState | NotFound: ...

    async def claim_result(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int, epoch: int,
                           digest: str) -> ResultClaim | Stale: ...

    async def release_result_claim(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int, epoch: int,
                                   digest: str) -> Done | Stale: ...

    async def mark_result_received(self, conn: Conn, task_id: uuid.UUID, *, tenant_id: int,
                                   epoch: int) -> Done | Stale: ...

    async def end_one(self, conn: Conn, end: ExecutionEnd) -> EndedExecution | None: ...

    async def end_many(self, conn: Conn, ends: list[ExecutionEnd]) -> list[EndedExecution]: ...

    async def status_of(self, conn: Conn, task_id: uuid.UUID) -> str | None: ...

    async def preempt_scheduled(self, conn: Conn, *, client_id: uuid.UUID, tenant_id: int,
                                request_id: uuid.UUID) -> Queued[Preempted]: ...

    async def release_unhealthy(self, conn: Conn, client_ids: list[uuid.UUID]) -> list[ReleasedWork]: ...

    async def expired(self, conn: Conn, *, limit: int) -> list[uuid.UUID]: ...

    async def lock_expired(self, conn: Conn, task_id: uuid.UUID) -> ExpiringLease | Stale: ...

    async def offline_queued(self, conn: Conn, *, timeout_s: float, limit: int) -> list[uuid.UUID]: ...

    async def lock_offline_queued(self, conn: Conn, task_id: uuid.UUID, *,
                                  timeout_s: float) -> QueuedWork | Stale: ...

    async def overdue_interrupts(self, conn: Conn, *, default_hard_ms: int, limit: int) -> list[uuid.UUID]: ...

    async def lock_overdue_interrupt(self, conn: Conn, task_id: uuid.UUID, *,
                                     default_hard_ms: int) -> OverdueInterrupt | Stale: ...

    async def queued_high_of_client(self, conn: Conn, client_id: uuid.UUID) -> list[QueuedWork]: ...

    async def mark_unknown(self, conn: Conn, *, grace_s: float, limit: int) -> list[UnknownMarked]: ...

    async def unknown(self, conn: Conn, *, limit: int) -> list[uuid.UUID]: ...

    async def lock_unknown(self, conn: Conn, task_id: uuid.UUID) -> UnknownExecution | Stale: ...

    async def requeue_unknown(self, conn: Conn, task_id: uuid.UUID, *, lease_epoch: int) -> Done | Stale: ...


DESKTOP_TASKS: Executions = desktop_path.DesktopTaskExecutions()
LEGACY: Executions = legacy_path.LegacyExecutions()
# Every path, in the order a task id is looked up on (the new path first: most work is there).
PATHS: tuple[Executions, ...] = (DESKTOP_TASKS, LEGACY)
_BY_OWNER: dict[str, Executions] = {p.owner: p for p in PATHS}


def executions_for(owner: str) -> Executions:
    """The implementation of a task's execution path (`monitoring_collect_tasks.execution_owner`)."""
    return _BY_OWNER[owner]


# ---- dispatch (the coordinator) -----------------------------------------------------------------------------------

async def dispatch(conn: Conn, rows: list[dict[str, Any]], *,
                   ts: datetime) -> dict[ExecutionOwner, list[dict[str, Any]]]:
    """The work a dispatch pass decided, each row on its task's path (`execution_owner`): an execution, or an offer
    on the business row (in the caller's pipeline). Returns the rows each path created."""
    by_path: dict[ExecutionOwner, list[dict[str, Any]]] = {}
    for r in rows:  # a row of no known owner is the new path's (the column's default)
        by_path.setdefault(r["execution_owner"] if r["execution_owner"] in _BY_OWNER else DESKTOP_TASKS.owner,
                           []).append(r)
    for path in PATHS:
        if mine := by_path.get(path.owner):
            await path.create(conn, mine, ts=ts)
    return by_path


# ---- the lease call (the hub) -------------------------------------------------------------------------------------

def best_first(picked: list[Offer], free: int) -> list[Offer]:
    """Both paths' picks merged in dispatch order (lane weight, priority, enqueued), as many as the free slots."""
    return sorted(picked, key=lambda o: (-o.lane_weight, -o.priority, o.enqueued_at))[:free]


async def pick_for_client(conn: Conn, *, client_id: uuid.UUID, tenant_id: int,
                          max_tasks: int) -> Queued[list[Offer] | NotFound]:
    """What a lease call takes: the client's free slots and each path's best work, read and locked in one round
    trip (pipelined); NotFound: not a client of this tenant."""
    capacity = await conn.execute(CLIENT_CAPACITY_SQL, {"client_id": client_id, "tenant_id": tenant_id,
                                                        "max_tasks": max_tasks})
    picks = [await p.pick(conn, client_id=client_id, tenant_id=tenant_id, max_tasks=max_tasks) for p in PATHS]

    async def read() -> list[Offer] | NotFound:
        row = await capacity.fetchone()
        if row is None:
            return NotFound()
        offers: list[Offer] = []
        for pick in picks:
            offers += await pick.result()
        return best_first(offers, int(row["free"]))
    return Queued(read)


async def mark_leased(conn: Conn, offer: Offer, *, epoch: int, token_hash: str,
                      ttl_s: float) -> Queued[Leased | Stale]:
    """The picked work leased on its path (pipelined); Stale: no longer queued (cannot happen under the pick's
    row lock)."""
    return await executions_for(offer.execution_owner).mark_leased(conn, offer.id, epoch=epoch,
                                                                   token_hash=token_hash, ttl_s=ttl_s)


async def extend(conn: Conn, task_id: uuid.UUID, *, tenant_id: int, client_id: uuid.UUID, epoch: int,
                 token_hash: str, ttl_s: float, phase: str | None) -> Extended | Fenced:
    """The lease extended on whichever path holds it; Fenced: neither holds it for this token and epoch."""
    outcome: Extended | Fenced = Fenced(task_id=task_id)
    for path in PATHS:
        outcome = await path.extend(conn, task_id, tenant_id=tenant_id, client_id=client_id, epoch=epoch,
                                    token_hash=token_hash, ttl_s=ttl_s, phase=phase)
        if isinstance(outcome, Extended):
            return outcome
    return outcome


async def lease_state(conn: Conn, task_id: uuid.UUID, *, tenant_id: int,
                      for_update: bool = False) -> LeaseState | NotFound:
    """A lease's state on whichever path it is (locked, in each path's lock order, with `for_update`)."""
    for path in PATHS:
        state = await path.lease_state(conn, task_id, tenant_id=tenant_id, for_update=for_update)
        if isinstance(state, LeaseState):
            return state
    return NotFound(task_id=task_id)


# ---- ending (every service) ---------------------------------------------------------------------------------------

async def end(conn: Conn, request: ExecutionEnd) -> EndedExecution | Stale | NotFound:
    """A live execution or lease (at `request.lease_epoch`, if given) to its terminal state; Stale: it is not live
    (ended already) or is at another epoch (a fenced-off holder never ends the new holder's work); NotFound: no such
    execution on either path."""
    for path in PATHS:
        ended = await path.end_one(conn, request)
        if ended is not None:
            return ended
    for path in PATHS:
        status = await path.status_of(conn, request.task_id)
        if status is not None:
            return Stale(task_id=request.task_id, status=status)
    return NotFound(task_id=request.task_id)


async def end_many(conn: Conn, ends: list[ExecutionEnd]) -> list[EndedExecution]:
    """`end` for many in few statements (rows locked in id order; a task id given twice is ended by its first entry).
    Returns those that were live: the others were Stale or NotFound, which a batch (an ingest batch, a rollback)
    reads as "ended already"."""
    unique: dict[uuid.UUID, ExecutionEnd] = {}
    for e in ends:
        unique.setdefault(e.task_id, e)
    left = sorted(unique.values(), key=lambda e: e.task_id)  # lock order
    ended: list[EndedExecution] = []
    for path in PATHS:
        if not left:
            break
        done = await path.end_many(conn, left)
        ended += done
        found = {e.task_id for e in done}
        left = [e for e in left if e.task_id not in found]
    return ended


# ---- a click's preemption (collect-now) ---------------------------------------------------------------------------

async def preempt_scheduled(conn: Conn, *, client_id: uuid.UUID, tenant_id: int,
                            request_id: uuid.UUID) -> Queued[Preempted]:
    """The client's scheduled work on both paths: queued work cancelled (offers withdrawn), running work asked to
    yield, with the click's new generation (pipelined: read after the caller's sync)."""
    pending = [await p.preempt_scheduled(conn, client_id=client_id, tenant_id=tenant_id, request_id=request_id)
               for p in PATHS]

    async def read() -> Preempted:
        cancelled, interrupted = [], []
        for p in pending:
            done = await p.result()
            cancelled += done.cancelled
            interrupted += done.interrupted
        return Preempted(cancelled=cancelled, interrupted=interrupted)
    return Queued(read)


name_replacement = desktop_path.name_replacement


# ---- a broken login (the hub's heartbeat flush) -------------------------------------------------------------------

async def release_unhealthy(conn: Conn, client_ids: list[uuid.UUID]) -> list[ReleasedWork]:
    """The clients' queued work of the held lanes on platforms they report a broken login on, released on both
    paths."""
    released: list[ReleasedWork] = []
    for path in PATHS:
        released += await path.release_unhealthy(conn, client_ids)
    return released


# ---- the reconciler's lease jobs ----------------------------------------------------------------------------------

async def expired(conn: Conn, *, limit: int) -> list[uuid.UUID]:
    """Leases past their expiry without a result, on both paths (at most `limit` a path; read without locks)."""
    return [i for p in PATHS for i in await p.expired(conn, limit=limit)]


_Locked = TypeVar("_Locked")


async def _first_locked(task_id: uuid.UUID, lock: Callable[[Executions], Awaitable[_Locked | Stale]]) -> (
        _Locked | Stale):
    """The row the first path locks (a task id is on one path only); Stale when neither does."""
    for path in PATHS:
        found = await lock(path)
        if not isinstance(found, Stale):
            return found
    return Stale(task_id=task_id)


async def lock_expired(conn: Conn, task_id: uuid.UUID) -> ExpiringLease | Stale:
    """The expired lease locked, re-checked; Stale: it was extended, resulted, ended or is locked meanwhile."""
    return await _first_locked(task_id, lambda path: path.lock_expired(conn, task_id))


async def offline_queued(conn: Conn, *, timeout_s: float, limit: int) -> list[uuid.UUID]:
    """Queued work (not leased, not pulled) of clients without a fresh heartbeat or disabled, on both paths."""
    return [i for p in PATHS for i in await p.offline_queued(conn, timeout_s=timeout_s, limit=limit)]


async def lock_offline_queued(conn: Conn, task_id: uuid.UUID, *, timeout_s: float) -> QueuedWork | Stale:
    return await _first_locked(task_id, lambda path: path.lock_offline_queued(conn, task_id, timeout_s=timeout_s))


async def overdue_interrupts(conn: Conn, *, default_hard_ms: int, limit: int) -> list[uuid.UUID]:
    return [i for p in PATHS for i in await p.overdue_interrupts(conn, default_hard_ms=default_hard_ms, limit=limit)]


async def lock_overdue_interrupt(conn: Conn, task_id: uuid.UUID, *, default_hard_ms: int) -> OverdueInterrupt | Stale:
    return await _first_locked(task_id, lambda path: path.lock_overdue_interrupt(
        conn, task_id, default_hard_ms=default_hard_ms))


async def queued_high_of_client(conn: Conn, client_id: uuid.UUID) -> list[QueuedWork]:
    return [w for p in PATHS for w in await p.queued_high_of_client(conn, client_id)]


async def mark_unknown(conn: Conn, *, grace_s: float, limit: int) -> list[UnknownMarked]:
    return [m for p in PATHS for m in await p.mark_unknown(conn, grace_s=grace_s, limit=limit)]


async def unknown(conn: Conn, *, limit: int) -> list[uuid.UUID]:
    return [i for p in PATHS for i in await p.unknown(conn, limit=limit)]


async def lock_unknown(conn: Conn, task_id: uuid.UUID) -> UnknownExecution | Stale:
    for path in PATHS:
        work = await path.lock_unknown(conn, task_id)
        if isinstance(work, UnknownExecution):
            return work
    return Stale(task_id=task_id)


async def requeue_unknown(conn: Conn, task_id: uuid.UUID, *, lease_epoch: int) -> Done | Stale:
    for path in PATHS:
        done = await path.requeue_unknown(conn, task_id, lease_epoch=lease_epoch)
        if isinstance(done, Done):
            return done
    return Stale(task_id=task_id)


# ---- replay on (re)connect (the hub) ------------------------------------------------------------------------------

# For a batch of clients (client_ids[i] of tenant_ids[i]): everything queued for each on either path, in lane
# order ...
_REPLAY_QUEUED = """
SELECT d.kind, d.id, d.target_client_id, d.priority, d.lane, d.scheduler_group_key, d.business_date,
       d.interrupt_generation, d.updated_at, d.monitor_task_id, d.collect_request_id
FROM unnest(%(client_ids)b::uuid[], %(tenant_ids)b::bigint[]) WITH ORDINALITY AS c(client_id, tenant_id, n)
CROSS JOIN LATERAL (
    SELECT d.* FROM (
        SELECT d.kind, d.id, d.target_client_id, d.priority, d.lane, d.lane_weight, d.scheduler_group_key,
               d.business_date, d.interrupt_generation, d.updated_at, d.monitor_task_id, d.collect_request_id,
               d.enqueued_at
        FROM desktop_tasks d
        WHERE d.target_client_id = c.client_id AND d.tenant_id = c.tenant_id AND d.status = 'queued'
        UNION ALL  -- the legacy path's offers not pulled yet, with the coordinator's group key
        SELECT l.kind, l.id, l.target_client_id, l.priority, l.lane, l.lane_weight, 'qid:' || l.question_id,
               l.business_date, l.interrupt_generation, l.updated_at, l.monitor_task_id, l.collect_request_id,
               l.enqueued_at
        FROM legacy_leases l
        WHERE l.target_client_id = c.client_id AND l.tenant_id = c.tenant_id AND l.status = 'queued'
    ) d
    ORDER BY d.lane_weight DESC, d.priority DESC, d.enqueued_at ASC
    LIMIT %(limit)s
) d
ORDER BY c.n, d.lane_weight DESC, d.priority DESC, d.enqueued_at ASC
"""

# ... and every interrupt still outstanding on their running work.
_REPLAY_INTERRUPTS = """
SELECT d.kind, d.id, d.target_client_id, d.interrupt_generation, d.control_flags, d.interrupt_reason,
       d.updated_at, d.collect_request_id
FROM unnest(%(client_ids)b::uuid[], %(tenant_ids)b::bigint[]) WITH ORDINALITY AS c(client_id, tenant_id, n)
CROSS JOIN LATERAL (
    SELECT d.* FROM (
        SELECT d.kind, d.id, d.target_client_id, d.interrupt_generation, d.control_flags, d.interrupt_reason,
               d.updated_at, d.collect_request_id, d.leased_at
        FROM desktop_tasks d
        WHERE d.target_client_id = c.client_id AND d.tenant_id = c.tenant_id AND d.status = 'in_progress'
          AND coalesce((d.control_flags ->> 'interrupt_requested')::boolean, false)
        UNION ALL  -- pulled legacy leases asked to yield and without a posted result
        SELECT l.kind, l.id, l.target_client_id, l.interrupt_generation, l.control_flags, l.interrupt_reason,
               l.updated_at, l.collect_request_id, l.leased_at
        FROM legacy_leases l
        WHERE l.target_client_id = c.client_id AND l.tenant_id = c.tenant_id AND l.status = 'in_progress'
          AND l.result_received_at IS NULL AND coalesce((l.control_flags ->> 'interrupt_requested')::boolean, false)
    ) d
    ORDER BY d.leased_at
    LIMIT %(limit)s
) d
ORDER BY c.n, d.leased_at
"""


async def replay(conn: Conn, clients: list[tuple[uuid.UUID, int]], *,
                 limit: int) -> tuple[list[QueuedReplay], list[InterruptReplay]]:
    """For (re)connecting clients ((client, tenant) pairs): their queued work in lane order and their outstanding
    interrupts, on both paths, at most `limit` of each per client."""
    params = {"client_ids": [c for c, _ in clients], "tenant_ids": [t for _, t in clients], "limit": limit}
    cur = await conn.execute(_REPLAY_QUEUED, params)
    queued = from_rows(await cur.fetchall(), QueuedReplay)
    cur = await conn.execute(_REPLAY_INTERRUPTS, params)
    return queued, from_rows(await cur.fetchall(), InterruptReplay)
