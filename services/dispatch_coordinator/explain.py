"""Why is this task not dispatched yet? (`monitorctl explain TASK_ID`, GET /api/ops/tasks/{id}/explain)

Reads the same snapshot a dispatch pass reads and runs the same decision tree on the one task, then
adds where the task stands in its lane and how much its tenant has waiting.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from libs.coordinator_state import read_coordinator_state, slowdown_from_state
from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings, load_settings
from libs.domain.dispatch import (
    LANE_ORDER,
    REMEDY,
    Candidate,
    ClientState,
    PassLimits,
    RejectReason,
    client_reject_reason,
    cluster_room,
    evaluate,
    retry_allowed,
)
from libs.tasks import explain_reads
from libs.tasks.explain_reads import ExplainedTask
from services.dispatch_coordinator.dispatcher import Snapshot, limits_from, read_snapshot


async def resolve_task_id(conn: Conn, raw: str) -> int | None:
    """A business task id, or an execution (desktop_tasks) uuid mapped to its business task."""
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        exec_id = uuid.UUID(raw)
    except ValueError:
        return None
    return await explain_reads.task_of_execution(conn, exec_id)


def _client_view(task: Candidate, client: ClientState) -> dict[str, Any]:
    reason = client_reject_reason(task, client)
    return {"client_id": str(client.id), "in_progress": client.in_progress, "max_concurrent": client.max_concurrent,
            "queued": client.queued, "max_queue_depth": client.max_queue_depth, "pending_high": client.pending_high,
            "interrupt_overdue": client.interrupt_overdue,
            "login_broken_on": sorted(client.blocked_platforms), "blocked_by": reason}


async def explain_task(conn: Conn, raw_id: str, settings: DispatchSettings | None = None) -> dict[str, Any] | None:
    """The explanation as a JSON-ready dict, or None when no such task exists."""
    t = await _load_task(conn, raw_id)
    if t is None:
        return None
    settings = settings or await load_settings(conn)
    out = _task_facts(t)
    out["tenant_ready_backlog"] = await explain_reads.tenant_ready_backlog(conn, t.tenant_id)
    not_ready = await _why_not_ready(conn, t, out)
    if not_ready:
        out.update(ready=False, dispatchable_now=False, blocked_by=None, why=not_ready)
        return out
    await _explain_ready(conn, t, settings, out)
    return out


async def _load_task(conn: Conn, raw_id: str) -> ExplainedTask | None:
    """The business task `raw_id` names (its id or one of its executions' uuid), or None."""
    task_id = await resolve_task_id(conn, raw_id)
    if task_id is None:
        return None
    return await explain_reads.task(conn, task_id)


def _task_facts(t: ExplainedTask) -> dict[str, Any]:
    return {
        "task_id": t.id, "tenant_id": t.tenant_id, "workspace_id": t.workspace_id, "status": t.status,
        "lane": t.lane, "priority": t.priority, "aging_boost": t.aging_boost,
        "ai_platform_id": t.ai_platform_id, "target_client_id": t.target_client_id,
        "execution_owner": t.execution_owner, "dispatch_attempts": t.dispatch_attempts,
        "business_date": t.business_date, "enqueued_at": t.enqueued_at, "waited_ms": int(t.waited_ms),
        "collect_request_id": t.collect_request_id,
    }


async def _why_not_ready(conn: Conn, t: ExplainedTask, out: dict[str, Any]) -> list[str]:
    """Why no dispatch pass considers the task (empty: it is ready); adds its live legacy lease and its active
    execution, if any, to `out`."""
    active = await explain_reads.active_execution(conn, t.id)
    not_ready = []
    if t.status != "pending":
        held = "; a client holds its lease on the legacy path" if t.status in ("leased", "received") else ""
        not_ready.append(f"status is {t.status} (only pending tasks are dispatched{held})")
    if t.status in ("leased", "received"):
        lease = await explain_reads.legacy_lease(conn, t.id)
        if lease is not None:
            out["legacy_lease"] = msgspec.structs.asdict(lease)
    if t.not_due:
        not_ready.append(f"dispatch_after is in the future ({t.dispatch_after.isoformat()})")
    if active is not None:
        not_ready.append(f"already dispatched: execution {active.id} is {active.status} on client "
                         f"{active.target_client_id}")
        out["active_execution"] = msgspec.structs.asdict(active)
    return not_ready


async def _explain_ready(conn: Conn, t: ExplainedTask, settings: DispatchSettings, out: dict[str, Any]) -> None:
    """For a ready task: the verdict a pass would reach now, its place in its lane, the budgets and the clients."""
    state = await read_coordinator_state(conn)
    slowdown, slowdown_view = slowdown_from_state(state)
    limits: PassLimits = limits_from(settings, slowdown=slowdown)
    snap = await read_snapshot(conn, settings)
    normal_has_work = await explain_reads.normal_has_work(conn)
    high_backlog = await explain_reads.high_ready_count(conn)
    candidate = Candidate(id=t.id, tenant_id=t.tenant_id, workspace_id=t.workspace_id,
                          ai_platform_id=t.ai_platform_id, lane=t.lane, priority=t.priority,
                          enqueued_at=t.enqueued_epoch, target_client_id=t.target_client_id)
    scope = [c for c in snap.clients if c.tenant_id == t.tenant_id and c.workspace_id == t.workspace_id]
    by_id = {c.id: c for c in snap.clients}
    client, reason = _planner_verdict(t, candidate, snap, limits, scope, by_id, normal_has_work=normal_has_work,
                                      high_backlog=high_backlog, tenant_backlog=out["tenant_ready_backlog"])
    position = await _lane_position(conn, t)
    out.update(
        ready=True,
        dispatchable_now=reason is None,
        blocked_by=reason,
        remedy=REMEDY.get(reason) if reason else None,
        would_go_to_client=str(client.id) if client is not None else None,
        why=[f"blocked by {reason}: {REMEDY.get(reason, '')}"] if reason else
            ["passes every check now; it goes out with the next pass (tick or wake-up)"],
        lane_position=position,
        budgets=_budgets(t, snap, limits, normal_has_work=normal_has_work),
        platform=_platform_view(t, snap),
        clients=_clients_view(t, candidate, scope, by_id),
        lane_paused=t.lane in limits.paused_lanes,
        auto_slowdown=slowdown_view,
    )
    if t.target_client_id is not None and t.target_client_id not in by_id:
        out["why"].append(f"bound client {t.target_client_id} is not online (or its heartbeat is stale)")


def _planner_verdict(t: ExplainedTask, candidate: Candidate, snap: Snapshot, limits: PassLimits,
                     scope: list[ClientState], by_id: dict[uuid.UUID, ClientState], *, normal_has_work: bool,
                     high_backlog: int, tenant_backlog: dict[str, int]) -> tuple[ClientState | None,
                                                                                 RejectReason | None]:
    """What a pass would decide for the task now: the client it goes to, or the reason it waits (the decision
    tree, then the retry lane's low-water rule)."""
    client, reason = evaluate(candidate, snap.ledger, limits, scope, by_id, normal_has_work=normal_has_work)
    tenant_normal = sum(n for lane, n in tenant_backlog.items() if lane != "retry" and lane != "high")
    if reason is None and t.lane == "retry" and not retry_allowed(
            t.tenant_id, cluster_high_backlog=high_backlog, tenant_normal_backlog={t.tenant_id: tenant_normal},
            watermark=limits.retry_low_watermark):
        reason, client = "retry_waits_for_low_water", None
    return client, reason


async def _lane_position(conn: Conn, t: ExplainedTask) -> dict[str, int]:
    """How many ready tasks are ahead of this one in its lane (all, and its tenant's), in higher lanes, and how
    many tenants share the lane."""
    higher = list(LANE_ORDER[:LANE_ORDER.index(t.lane)]) if t.lane in LANE_ORDER else []
    position = await explain_reads.lane_position(conn, t, higher_lanes=higher)
    return msgspec.structs.asdict(position)


def _budgets(t: ExplainedTask, snap: Snapshot, limits: PassLimits, *, normal_has_work: bool) -> dict[str, Any]:
    """The window's cluster, non-high and tenant budgets as they stand for this task."""
    return {
        "window_seconds": snap.window_seconds,
        "seconds_to_next_window": round(snap.window_start + snap.window_seconds - snap.now, 3),
        "cluster_used": snap.ledger.cluster_used, "cluster_limit": limits.cluster_per_window,
        "cluster_room_for_lane": cluster_room(t.lane, snap.ledger, limits, normal_has_work=normal_has_work),
        "non_high_used": snap.ledger.non_high_used, "non_high_cap": limits.non_high_cap,
        "tenant_used": snap.ledger.tenant_used.get(t.tenant_id, 0), "tenant_limit": limits.tenant_per_window,
        "tenant_budget_applies": t.lane != "high",
    }


def _platform_view(t: ExplainedTask, snap: Snapshot) -> dict[str, Any]:
    """The task's platform: its activity against its limit, and whether it is paused."""
    platform_key = (t.tenant_id, t.ai_platform_id)
    return {"active": snap.ledger.platform_active.get(platform_key, 0),
            "limit": snap.ledger.platform_limit.get(t.ai_platform_id, snap.ledger.default_platform_limit),
            "paused": t.ai_platform_id in snap.ledger.paused_platforms,
            "code": snap.platform_codes.get(t.ai_platform_id),
            # the tenant's platform-health pause: "health" (every client's login broken) or "operator"
            "tenant_paused_by": snap.platform_pauses.get(platform_key)}


def _clients_view(t: ExplainedTask, candidate: Candidate, scope: list[ClientState],
                  by_id: dict[uuid.UUID, ClientState]) -> list[dict[str, Any]]:
    """The bound client when it is online, else every client of the scope, least loaded first."""
    return [_client_view(candidate, c) for c in
            ([by_id[t.target_client_id]] if t.target_client_id in by_id else [])
            or sorted(scope, key=lambda c: (c.load, str(c.id)))]
