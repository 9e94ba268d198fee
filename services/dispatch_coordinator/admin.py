"""Operator actions on dispatch (used by `monitorctl` and the coordinator's ops endpoints)."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

from libs.contracts.wire import TaskControl
from libs.coordinator_state import read_coordinator_state
from libs.db.pool import Conn
from libs.dispatch_settings import (
    CEILINGS,
    DispatchSettings,
    SettingError,
    as_dict,
    check_ceiling,
    check_new_ceiling,
    coerce,
    load_settings,
    set_setting,
)
from libs.domain.dispatch import window_start
from libs.domain.platform_health import OverrideMode
from libs.mq.topology import DISPATCH
from libs.outbox import OutboxEvent, enqueue_many
from libs.outbox import admin as outbox_admin
from libs.tasks.transitions import ELIGIBLE_CLIENT_SQL, end_execution
from services.dispatch_coordinator import queries as q

ROLLBACK_REASON = "phase2_emergency_rollback"

_PLATFORMS = """
SELECT p.id AS ai_platform_id, p.code, p.enabled, coalesce(s.max_concurrent, 1) AS max_concurrent,
       coalesce(s.interrupt_soft_timeout_ms, 15000) AS interrupt_soft_timeout_ms,
       coalesce(s.interrupt_hard_timeout_ms, 45000) AS interrupt_hard_timeout_ms, coalesce(s.paused, false) AS paused,
       coalesce(s.timeouts_dynamic, false) AS timeouts_dynamic, s.timeouts_tuned_at,
       s.safe_point_p95_ms AS measured_safe_point_p95_ms, s.safe_point_samples AS measured_samples,
       s.safe_point_measured_at AS measured_at, s.updated_at
FROM ai_platforms p LEFT JOIN platform_settings s ON s.ai_platform_id = p.id
WHERE %(code)s::text IS NULL OR p.code = %(code)s
ORDER BY p.id
"""
_HEALTH_OVERRIDES = "SELECT tenant_id, ai_platform_id, mode, reason, set_at FROM platform_health_overrides"
_SET_HEALTH_OVERRIDE = """
INSERT INTO platform_health_overrides (tenant_id, ai_platform_id, mode, reason)
VALUES (%(tenant_id)s, %(platform_id)s, %(mode)s, %(reason)s)
ON CONFLICT (tenant_id, ai_platform_id) DO UPDATE SET mode = EXCLUDED.mode, reason = EXCLUDED.reason, set_at = now()
"""
_CLEAR_HEALTH_OVERRIDE = """
DELETE FROM platform_health_overrides WHERE tenant_id = %(tenant_id)s AND ai_platform_id = %(platform_id)s
"""
_SET_CLIENT_LIMITS = """
UPDATE desktop_clients
SET max_concurrent_monitor = coalesce(%(max_concurrent)s, max_concurrent_monitor),
    max_queue_depth = coalesce(%(max_queue_depth)s, max_queue_depth), updated_at = now()
WHERE id = %(id)s
RETURNING id AS client_id, tenant_id, max_concurrent_monitor AS max_concurrent, max_queue_depth
"""
_UPSERT_PLATFORM = """
INSERT INTO platform_settings (ai_platform_id, max_concurrent, interrupt_soft_timeout_ms, interrupt_hard_timeout_ms,
                               paused, timeouts_dynamic, updated_at)
SELECT p.id, coalesce(%(max_concurrent)s, s.max_concurrent, 1),
       coalesce(%(soft)s, s.interrupt_soft_timeout_ms, 15000), coalesce(%(hard)s, s.interrupt_hard_timeout_ms, 45000),
       coalesce(%(paused)s, s.paused, false), coalesce(%(dynamic)s, s.timeouts_dynamic, false), now()
FROM ai_platforms p LEFT JOIN platform_settings s ON s.ai_platform_id = p.id
WHERE p.code = %(code)s
ON CONFLICT (ai_platform_id) DO UPDATE
SET max_concurrent = EXCLUDED.max_concurrent, interrupt_soft_timeout_ms = EXCLUDED.interrupt_soft_timeout_ms,
    interrupt_hard_timeout_ms = EXCLUDED.interrupt_hard_timeout_ms, paused = EXCLUDED.paused,
    timeouts_dynamic = EXCLUDED.timeouts_dynamic, updated_at = now()
RETURNING ai_platform_id
"""
_LANE_BACKLOG = f"""
SELECT t.dispatch_lane AS lane, count(*) AS ready, coalesce(max(extract(epoch FROM (now() - t.enqueued_at))), 0)
       * 1000 AS oldest_ms
FROM monitoring_collect_tasks t WHERE {q.READY} GROUP BY 1
"""
_EXECUTIONS = """
SELECT status, count(*) AS n FROM desktop_tasks
WHERE kind = 'monitor' AND status IN ('queued', 'in_progress', 'unknown') GROUP BY 1
"""
_CLIENTS_ONLINE = f"""
SELECT count(*) FILTER (WHERE {ELIGIBLE_CLIENT_SQL}) AS eligible, count(*) FILTER (WHERE c.online) AS online,
       count(*) AS registered
FROM desktop_clients c
"""
_ACTIVE_MONITOR = """
SELECT id, target_client_id, tenant_id, interrupt_generation FROM desktop_tasks
WHERE kind = 'monitor' AND status IN ('queued', 'in_progress', 'unknown')
ORDER BY id
"""
_ROLLBACK_BUSINESS = """
UPDATE monitoring_collect_tasks
SET execution_owner = 'legacy', status = 'pending', lease_token_hash = NULL, leased_to_executor = NULL,
    leased_at = NULL, lease_expires_at = NULL, updated_at = now()
WHERE execution_owner = 'desktop_tasks' AND status = 'pending'
"""


class AdminError(ValueError):
    pass


async def get_budgets(conn: Conn) -> dict[str, Any]:
    return as_dict(await load_settings(conn))


CEILING_LOCK = "SELECT pg_advisory_xact_lock(7401552113)"  # a budget and its ceiling change one at a time


async def set_budget(conn: Conn, key: str, value: Any) -> Any:
    """`monitorctl budgets set`: any dispatch setting but a ceiling, a budget never above its ceiling."""
    if key in CEILINGS:
        raise SettingError(f"{key} is a ceiling; change it with `monitorctl budgets set-ceiling {key} VALUE`")
    async with conn.transaction():
        await conn.execute(CEILING_LOCK)
        check_ceiling(await load_settings(conn), key, coerce(key, value))
        return await set_setting(conn, key, value)


async def set_ceiling(conn: Conn, key: str, value: Any) -> Any:
    """`monitorctl budgets set-ceiling`: raise a ceiling (or lower it, not below its budget)."""
    async with conn.transaction():
        await conn.execute(CEILING_LOCK)
        check_new_ceiling(await load_settings(conn), key, coerce(key, value))
        return await set_setting(conn, key, value)


async def set_client_limits(conn: Conn, client_id: uuid.UUID, *, max_concurrent: int | None,
                            max_queue_depth: int | None) -> dict[str, Any]:
    """A client's monitor concurrency and queue depth, bounded by their ceilings (the coordinator reads them
    on its next pass)."""
    async with conn.transaction():
        settings = await load_settings(conn)
        for what, value in (("client.max_concurrent", max_concurrent), ("client.max_queue_depth", max_queue_depth)):
            if value is not None:
                if value < 0:
                    raise AdminError(f"{what} must be >= 0")
                try:
                    check_ceiling(settings, what, value)
                except SettingError as exc:
                    raise AdminError(str(exc)) from None
        cur = await conn.execute(_SET_CLIENT_LIMITS, {"id": client_id, "max_concurrent": max_concurrent,
                                                      "max_queue_depth": max_queue_depth})
        row = await cur.fetchone()
    if row is None:
        raise AdminError(f"no desktop client {client_id}")
    return dict(row)


async def set_lane_paused(conn: Conn, lane: str, paused: bool) -> list[str]:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(7401552112)")  # read-modify-write of paused_lanes
        current = set((await load_settings(conn)).paused_lanes)
        current = current | {lane} if paused else current - {lane}
        stored: tuple[str, ...] = await set_setting(conn, "paused_lanes", sorted(current))
    return list(stored)


async def get_platforms(conn: Conn, code: str | None = None) -> list[dict[str, Any]]:
    cur = await conn.execute(_PLATFORMS, {"code": code})
    return list(await cur.fetchall())


async def set_platform(conn: Conn, code: str, *, max_concurrent: int | None = None, soft_timeout_ms: int | None = None,
                       hard_timeout_ms: int | None = None, paused: bool | None = None,
                       dynamic: bool | None = None) -> dict[str, Any]:
    if max_concurrent is not None and max_concurrent < 0:
        raise AdminError("--max-concurrent must be >= 0")
    if max_concurrent is not None:
        try:
            check_ceiling(await load_settings(conn), "platform.max_concurrent", max_concurrent)
        except SettingError as exc:
            raise AdminError(str(exc)) from None
    for name, value in (("--soft-timeout-ms", soft_timeout_ms), ("--hard-timeout-ms", hard_timeout_ms)):
        if value is not None and value <= 0:
            raise AdminError(f"{name} must be > 0")
    async with conn.transaction():
        cur = await conn.execute(_UPSERT_PLATFORM, {"code": code, "max_concurrent": max_concurrent,
                                                    "soft": soft_timeout_ms, "hard": hard_timeout_ms,
                                                    "paused": paused, "dynamic": dynamic})
        if await cur.fetchone() is None:
            raise AdminError(f"no platform with code {code!r}")
    rows = await get_platforms(conn, code)
    return rows[0]


async def set_rollout(conn: Conn, percentage: int) -> int:
    async with conn.transaction():
        value: int = await set_setting(conn, "rollout_percentage", percentage)
    return value


async def emergency_rollback(conn: Conn, *, force_in_flight: bool) -> dict[str, Any]:
    """docs/architecture.md §16.2.3. Step 1 always: rollout to 0% (new tasks take the legacy path). With
    `force_in_flight`: abort every active monitor execution (clients told through TaskControl
    'cancelled') and hand pending desktop_tasks-path business tasks back to legacy, in one transaction."""
    async with conn.transaction():
        await set_setting(conn, "rollout_percentage", 0)
        aborted = 0
        moved = 0
        if force_in_flight:
            await conn.execute(q.PASS_LOCK)  # no dispatch pass interleaves with the rollback
            cur = await conn.execute(_ACTIVE_MONITOR)
            events = []
            now = datetime.now(UTC)
            for row in await cur.fetchall():
                ended = await end_execution(conn, task_id=row["id"], outcome="aborted", reason=ROLLBACK_REASON)
                if ended is None:
                    continue
                aborted += 1
                events.append(OutboxEvent(
                    exchange=DISPATCH, routing_key=f"monitor.control.{row['target_client_id']}",
                    message=TaskControl(kind="monitor", task_id=row["id"], target_client_id=row["target_client_id"],
                                        control="cancelled", reason=ROLLBACK_REASON,
                                        interrupt_generation=row["interrupt_generation"], updated_at=now),
                    ordering_key=f"client:{row['target_client_id']}", tenant_id=row["tenant_id"]))
            await enqueue_many(conn, events, notify=bool(events))
            cur = await conn.execute(_ROLLBACK_BUSINESS)
            moved = cur.rowcount
    return {"rollout_percentage": 0, "aborted_executions": aborted, "business_tasks_to_legacy": moved,
            "forced": force_in_flight}


async def platform_health(conn: Conn, settings: DispatchSettings) -> list[dict[str, Any]]:
    """Per tenant and platform with a blocked client or an override: who blocks it, and whether (and why) the
    tenant's scheduled work of it is held (libs/domain/platform_health.py)."""
    from services.dispatch_coordinator.dispatcher import read_snapshot

    snap = await read_snapshot(conn, settings)
    cur = await conn.execute(_HEALTH_OVERRIDES)
    overrides = {(r["tenant_id"], r["ai_platform_id"]): dict(r) for r in await cur.fetchall()}
    blocked: dict[tuple[int, int], int] = {}
    online: dict[int, int] = {}
    for client in snap.clients:
        online[client.tenant_id] = online.get(client.tenant_id, 0) + 1
        for platform_id in client.blocked_platforms:
            blocked[(client.tenant_id, platform_id)] = blocked.get((client.tenant_id, platform_id), 0) + 1
    pairs = sorted(set(blocked) | set(overrides) | set(snap.platform_pauses))
    return [{"tenant_id": tenant, "platform": snap.platform_codes.get(platform, str(platform)),
             "clients_blocking": blocked.get((tenant, platform), 0), "clients_eligible": online.get(tenant, 0),
             "paused": snap.platform_pauses.get((tenant, platform)),
             "override": overrides.get((tenant, platform), {}).get("mode"),
             "override_reason": overrides.get((tenant, platform), {}).get("reason")}
            for tenant, platform in pairs]


async def set_health_override(conn: Conn, code: str, tenant_id: int, mode: OverrideMode | None,
                              reason: str = "") -> dict[str, Any]:
    """`monitorctl platform health-override`: pause, ignore reported health, or clear (mode None)."""
    async with conn.transaction():
        cur = await conn.execute("SELECT id FROM ai_platforms WHERE code = %(code)s", {"code": code})
        platform = await cur.fetchone()
        if platform is None:
            raise AdminError(f"no platform with code {code!r}")
        cur = await conn.execute("SELECT 1 FROM tenants WHERE id = %(id)s", {"id": tenant_id})
        if await cur.fetchone() is None:
            raise AdminError(f"no tenant {tenant_id}")
        params = {"tenant_id": tenant_id, "platform_id": platform["id"], "mode": mode, "reason": reason}
        await conn.execute(_SET_HEALTH_OVERRIDE if mode else _CLEAR_HEALTH_OVERRIDE, params)
    return {"tenant_id": tenant_id, "platform": code, "override": mode, "reason": reason}


async def status(conn: Conn) -> dict[str, Any]:
    """Lane backlogs, active executions, clients online, outbox depth and dead letters, coordinator state."""
    settings = await load_settings(conn)
    cur = await conn.execute(_LANE_BACKLOG)
    lanes = {r["lane"]: {"ready": int(r["ready"]), "oldest_ms": int(r["oldest_ms"])} for r in await cur.fetchall()}
    for lane in ("high", "normal_boosted", "normal", "retry"):
        lanes.setdefault(lane, {"ready": 0, "oldest_ms": 0})
        lanes[lane]["paused"] = lane in settings.paused_lanes  # type: ignore[assignment]
    cur = await conn.execute(_EXECUTIONS)
    executions = {r["status"]: int(r["n"]) for r in await cur.fetchall()}
    cur = await conn.execute(_CLIENTS_ONLINE, {"heartbeat_timeout_s": settings.heartbeat_timeout_seconds})
    clients = dict(await cur.fetchone() or {})
    depth = await outbox_admin.depth(conn)
    window = max(1, settings.budget_window_seconds)
    start = window_start(time.time(), window)
    cur = await conn.execute(q.BUDGET_USED, {"window_start": start, "window_end": start + window})
    used = [dict(r) for r in await cur.fetchall()]
    state = await read_coordinator_state(conn)
    return {
        "platform_health": await platform_health(conn, settings),
        "lanes": lanes,
        "executions": executions,
        "clients": clients,
        "outbox": {status: v["count"] for status, v in depth.items()},
        "dead_letters": depth.get("dead_letter", {}).get("count", 0),
        "budget_window": {"seconds": window, "cluster_used": sum(r["n"] for r in used),
                          "cluster_limit": settings.cluster_dispatch_per_minute,
                          "tenant_limit": settings.tenant_dispatch_per_minute},
        "rollout_percentage": settings.rollout_percentage,
        "coordinator": {k: {**v["value"], "age_s": round(v["age_s"], 1)} for k, v in state.items()},
    }
