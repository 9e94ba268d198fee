"""Operator actions on dispatch (used by `monitorctl` and the coordinator's ops endpoints)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import msgspec
from psycopg.pq import TransactionStatus

from libs.contracts.amqp import LifecycleEvent
from libs.coordinator_state import read_coordinator_state
from libs.db.migrate import load_migrations
from libs.db.pool import Conn
from libs.dispatch_settings import (
    CEILINGS,
    DispatchSettings,
    SettingError,
    as_dict,
    budget_sum_warning,
    check_budget_coupling,
    check_ceiling,
    check_new_ceiling,
    coerce,
    load_settings,
    set_setting,
)
from libs.domain.dispatch import window_start
from libs.domain.lanes import MONITOR_LANE_NAMES
from libs.domain.platform_health import OverrideMode
from libs.ingest.lag import ingest_lag_ms
from libs.leader import leader_states
from libs.mq.topology import LIFECYCLE
from libs.outbox import OutboxEvent, enqueue_many
from libs.outbox import admin as outbox_admin
from libs.tasks import admin_ops, business, execution_paths
from libs.tasks.controls import control_event
from libs.tasks.records import ExecutionEnd
from libs.tasks.statuses import EndReason
from libs.tasks.transitions import DISPATCH_WAKE_CHANNEL
from services.dispatch_coordinator import queries as q

ROLLBACK_REASON: EndReason = "phase2_emergency_rollback"

_PLATFORMS = """
SELECT p.id AS ai_platform_id, p.code, p.enabled, coalesce(s.max_concurrent, 1) AS max_concurrent,
       coalesce(s.interrupt_soft_timeout_ms, 15000) AS interrupt_soft_timeout_ms,
       coalesce(s.interrupt_hard_timeout_ms, 45000) AS interrupt_hard_timeout_ms, coalesce(s.paused, false) AS paused,
       coalesce(s.timeouts_dynamic, true) AS timeouts_dynamic, s.timeouts_tuned_at,
       s.safe_point_p95_ms AS measured_safe_point_p95_ms, s.safe_point_samples AS measured_samples,
       s.safe_point_clients AS measured_clients,
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
       coalesce(%(paused)s, s.paused, false),
       -- fixed values given make the platform static (the tuner would overwrite them); none: dynamic by default
       coalesce(%(dynamic)s, CASE WHEN %(soft)s::int IS NOT NULL OR %(hard)s::int IS NOT NULL THEN false END,
                s.timeouts_dynamic, true), now()
FROM ai_platforms p LEFT JOIN platform_settings s ON s.ai_platform_id = p.id
WHERE p.code = %(code)s
ON CONFLICT (ai_platform_id) DO UPDATE
SET max_concurrent = EXCLUDED.max_concurrent, interrupt_soft_timeout_ms = EXCLUDED.interrupt_soft_timeout_ms,
    interrupt_hard_timeout_ms = EXCLUDED.interrupt_hard_timeout_ms, paused = EXCLUDED.paused,
    timeouts_dynamic = EXCLUDED.timeouts_dynamic, updated_at = now()
RETURNING ai_platform_id
"""
# ---- the migration levers: rollout and emergency rollback (docs/legacy-path.md) ----------------------------------

# Serialises the rollout's read-modify-write (`rollout set`, `rollback`): the "before" each one reports is the value
# it replaced.
ROLLOUT_LOCK = "SELECT pg_advisory_xact_lock(7401552114)"

# The tenants on each path for new tasks at a percentage (libs.domain.schedule.execution_owner_for), and those that
# move between two percentages.
_TENANTS_BY_ROLLOUT = """
SELECT count(*) AS tenants,
       count(*) FILTER (WHERE id %% 100 < %(before)s) AS desktop_tasks_before,
       count(*) FILTER (WHERE id %% 100 < %(after)s) AS desktop_tasks_after,
       count(*) FILTER (WHERE id %% 100 >= %(before)s AND id %% 100 < %(after)s) AS to_desktop_tasks,
       count(*) FILTER (WHERE id %% 100 >= %(after)s AND id %% 100 < %(before)s) AS to_legacy
FROM tenants
"""

# Read-only counts from one snapshot (when the read runs in its own transaction).
_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"


class AdminError(ValueError):
    pass


async def get_budgets(conn: Conn) -> dict[str, Any]:
    return as_dict(await load_settings(conn))


# A budget or limit and its ceiling change one at a time: every command that sets either takes this lock first.
CEILING_LOCK = "SELECT pg_advisory_xact_lock(7401552113)"

# The per-client and per-platform limits a ceiling bounds: how many are set above a proposed ceiling (and the highest),
# what they are, and the command that lowers one. Platforms without settings count at the coordinator's default (1).
_LIMITS_ABOVE: dict[str, tuple[str, str, str]] = {
    "client_max_concurrent_ceiling": (
        "SELECT count(*) AS n, max(max_concurrent_monitor) AS top FROM desktop_clients "
        "WHERE max_concurrent_monitor > %(value)s",
        "client(s) have client.max_concurrent", "monitorctl client set CLIENT_ID --max-concurrent {value}"),
    "client_max_queue_depth_ceiling": (
        "SELECT count(*) AS n, max(max_queue_depth) AS top FROM desktop_clients WHERE max_queue_depth > %(value)s",
        "client(s) have client.max_queue_depth", "monitorctl client set CLIENT_ID --max-queue-depth {value}"),
    "platform_max_concurrent_ceiling": (
        "SELECT count(*) AS n, max(coalesce(s.max_concurrent, 1)) AS top FROM ai_platforms p "
        "LEFT JOIN platform_settings s ON s.ai_platform_id = p.id WHERE coalesce(s.max_concurrent, 1) > %(value)s",
        "platform(s) have platform.max_concurrent", "monitorctl platform set CODE --max-concurrent {value}"),
}


async def _check_limits_below(conn: Conn, ceiling_key: str, value: int) -> None:
    """A ceiling of per-client or per-platform limits may not go below a limit in use (lower those first)."""
    bounded = _LIMITS_ABOVE.get(ceiling_key)
    if bounded is None:
        return
    query, what, command = bounded
    cur = await conn.execute(query, {"value": value})
    row = await cur.fetchone()
    if row is not None and int(row["n"]) > 0:
        raise SettingError(f"{ceiling_key} = {value} is below what {row['n']} {what} set to (up to {row['top']}); "
                           f"lower them first: `{command.format(value=value)}`")


async def set_budget(conn: Conn, key: str, value: Any) -> Any:
    """`monitorctl budgets set`: any dispatch setting but a ceiling, a budget never above its ceiling."""
    if key in CEILINGS:
        raise SettingError(f"{key} is a ceiling; change it with `monitorctl budgets set-ceiling {key} VALUE`")
    if key == "rollout_percentage":  # the ramp's gates and the tenant movement report belong to its own commands
        raise SettingError("rollout_percentage changes with `monitorctl rollout advance` (the guarded ramp) or "
                           "`monitorctl rollout set PCT [--force]`")
    async with conn.transaction():
        await conn.execute(CEILING_LOCK)
        current = await load_settings(conn)
        check_ceiling(current, key, coerce(key, value))
        if key in BUDGET_KEYS:
            check_budget_coupling(replace(current, **{key: coerce(key, value)}))
        return await set_setting(conn, key, value)


BUDGET_KEYS = ("cluster_dispatch_per_minute", "tenant_dispatch_per_minute")
# Tenants with scheduled (non-high) dispatches counted in the last two budget windows: of the lanes the tenant
# budget holds.
_TENANT_HELD = f"d.lane <> {q.BUDGET_EXEMPT_LANE}"
_ACTIVE_TENANTS = f"""
SELECT count(DISTINCT d.tenant_id) AS n FROM dispatch_budget_rows d
WHERE d.kind = 'monitor' AND {_TENANT_HELD} AND d.created_at >= now() - make_interval(secs => %(window_s)s * 2)
  AND {q.COUNTS_AGAINST_BUDGET}
"""


async def budget_warning(conn: Conn) -> str | None:
    """§9.2's sum of tenant budgets over the tenants dispatching lately, when it passes the cluster's."""
    settings = await load_settings(conn)
    row = await (await conn.execute(_ACTIVE_TENANTS, {"window_s": max(1, settings.budget_window_seconds)})).fetchone()
    return budget_sum_warning(settings, int(row["n"]) if row else 0)


async def set_ceiling(conn: Conn, key: str, value: Any) -> Any:
    """`monitorctl budgets set-ceiling`: raise a ceiling (or lower it, not below its budget, nor below a client's or
    platform's limit it bounds)."""
    async with conn.transaction():
        await conn.execute(CEILING_LOCK)
        ceiling = coerce(key, value)
        check_new_ceiling(await load_settings(conn), key, ceiling)
        await _check_limits_below(conn, key, ceiling)
        return await set_setting(conn, key, value)


async def set_client_limits(conn: Conn, client_id: uuid.UUID, *, max_concurrent: int | None,
                            max_queue_depth: int | None) -> dict[str, Any]:
    """A client's monitor concurrency and queue depth, bounded by their ceilings (the coordinator reads them
    on its next pass)."""
    async with conn.transaction():
        await conn.execute(CEILING_LOCK)  # no ceiling lowered between the check and the write
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


_PLATFORM_MODES = """
SELECT ai_platform_id, mode, interrupt_soft_timeout_ms, interrupt_hard_timeout_ms FROM platform_mode_settings
ORDER BY ai_platform_id, mode
"""
_UPSERT_MODE = """
INSERT INTO platform_mode_settings (ai_platform_id, mode, interrupt_soft_timeout_ms, interrupt_hard_timeout_ms)
SELECT p.id, %(mode)s, %(soft)s, %(hard)s FROM ai_platforms p WHERE p.code = %(code)s
ON CONFLICT (ai_platform_id, mode) DO UPDATE
SET interrupt_soft_timeout_ms = EXCLUDED.interrupt_soft_timeout_ms,
    interrupt_hard_timeout_ms = EXCLUDED.interrupt_hard_timeout_ms, updated_at = now()
RETURNING ai_platform_id
"""


async def get_platforms(conn: Conn, code: str | None = None) -> list[dict[str, Any]]:
    """Each platform's settings, with its per-mode interrupt timeouts (`modes`, §10.5)."""
    cur = await conn.execute(_PLATFORMS, {"code": code})
    rows = [dict(r) for r in await cur.fetchall()]
    modes: dict[int, dict[str, dict[str, int]]] = {}
    for m in await (await conn.execute(_PLATFORM_MODES)).fetchall():
        modes.setdefault(int(m["ai_platform_id"]), {})[m["mode"]] = {
            "interrupt_soft_timeout_ms": m["interrupt_soft_timeout_ms"],
            "interrupt_hard_timeout_ms": m["interrupt_hard_timeout_ms"]}
    for row in rows:
        row["modes"] = modes.get(int(row["ai_platform_id"]), {})
    return rows


async def set_platform_mode(conn: Conn, code: str, mode: str, *, soft_timeout_ms: int | None,
                            hard_timeout_ms: int | None) -> dict[str, Any]:
    """`monitorctl platform set CODE --mode M --soft-timeout-ms S --hard-timeout-ms H`: one mode's timeouts."""
    if soft_timeout_ms is None or hard_timeout_ms is None:
        raise AdminError("--mode needs both --soft-timeout-ms and --hard-timeout-ms")
    if not 0 < soft_timeout_ms <= hard_timeout_ms:
        raise AdminError("a mode's timeouts need 0 < --soft-timeout-ms <= --hard-timeout-ms")
    if not mode or len(mode) > 40:
        raise AdminError("--mode must be 1..40 characters")
    cur = await conn.execute(_UPSERT_MODE, {"code": code, "mode": mode, "soft": soft_timeout_ms,
                                            "hard": hard_timeout_ms})
    if await cur.fetchone() is None:
        raise AdminError(f"no platform with code {code!r}")
    return (await get_platforms(conn, code))[0]


async def set_platform(conn: Conn, code: str, *, max_concurrent: int | None = None, soft_timeout_ms: int | None = None,
                       hard_timeout_ms: int | None = None, paused: bool | None = None,
                       dynamic: bool | None = None) -> dict[str, Any]:
    if max_concurrent is not None and max_concurrent < 0:
        raise AdminError("--max-concurrent must be >= 0")
    for name, value in (("--soft-timeout-ms", soft_timeout_ms), ("--hard-timeout-ms", hard_timeout_ms)):
        if value is not None and value <= 0:
            raise AdminError(f"{name} must be > 0")
    async with conn.transaction():
        if max_concurrent is not None:
            await conn.execute(CEILING_LOCK)  # no ceiling lowered between the check and the write
            try:
                check_ceiling(await load_settings(conn), "platform.max_concurrent", max_concurrent)
            except SettingError as exc:
                raise AdminError(str(exc)) from None
        cur = await conn.execute(_UPSERT_PLATFORM, {"code": code, "max_concurrent": max_concurrent,
                                                    "soft": soft_timeout_ms, "hard": hard_timeout_ms,
                                                    "paused": paused, "dynamic": dynamic})
        if await cur.fetchone() is None:
            raise AdminError(f"no platform with code {code!r}")
    rows = await get_platforms(conn, code)
    return rows[0]


async def _tenant_movement(conn: Conn, before: int, after: int) -> dict[str, Any]:
    cur = await conn.execute(_TENANTS_BY_ROLLOUT, {"before": before, "after": after})
    row = await cur.fetchone()
    assert row is not None
    tenants = int(row["tenants"])
    return {
        "rollout_percentage": {"before": before, "after": after},
        "tenants": tenants,
        "desktop_tasks_tenants": {"before": int(row["desktop_tasks_before"]), "after": int(row["desktop_tasks_after"])},
        "legacy_tenants": {"before": tenants - int(row["desktop_tasks_before"]),
                           "after": tenants - int(row["desktop_tasks_after"])},
        "tenants_to_desktop_tasks": int(row["to_desktop_tasks"]),
        "tenants_to_legacy": int(row["to_legacy"]),
    }


async def rollout_preview(conn: Conn, percentage: int) -> dict[str, Any]:
    """What `rollout set PERCENTAGE` would change: the tenants whose NEW tasks change path (existing tasks keep
    theirs). Changes nothing; raises SettingError outside 0..100."""
    after = int(coerce("rollout_percentage", percentage))
    before = (await load_settings(conn)).rollout_percentage
    return {**await _tenant_movement(conn, before, after), "applied": False}


async def set_rollout(conn: Conn, percentage: int, *, force: bool = False) -> dict[str, Any]:
    """`monitorctl rollout set`: store the percentage (the scanner and collect-now read it for the tasks they
    create from now on) and report the tenants that moved, in one transaction. Raising it skips the ramp's gates
    (`rollout advance`), so it needs `force`; lowering it is the safe direction and does not."""
    after = int(coerce("rollout_percentage", percentage))
    async with conn.transaction():
        await conn.execute(ROLLOUT_LOCK)
        before = (await load_settings(conn)).rollout_percentage
        if after > before and not force:
            raise SettingError(f"raising the rollout {before}% -> {after}% skips the ramp's gates: "
                               "`monitorctl rollout advance` takes the next step when they held, "
                               f"`monitorctl rollout set {after} --force` jumps deliberately")
        await set_setting(conn, "rollout_percentage", after)
        movement = await _tenant_movement(conn, before, after)
    return {**movement, "applied": True}


async def rollout_status(conn: Conn) -> dict[str, Any]:
    """`monitorctl rollout status`: per path the tenants whose new tasks take it (by the current percentage), its
    business tasks pending (not in flight), in flight (desktop_tasks: active executions; legacy: leased or received
    rows) and completed today (UTC); and the live legacy leases and active executions in total."""
    outer = conn.info.transaction_status == TransactionStatus.IDLE
    async with conn.transaction():
        if outer:  # one snapshot for every count
            await conn.execute(_SNAPSHOT)
        pct = (await load_settings(conn)).rollout_percentage
        tenants = await _tenant_movement(conn, pct, pct)
        paths: dict[str, dict[str, int]] = {
            "desktop_tasks": {"tenants": tenants["desktop_tasks_tenants"]["after"], "pending": 0, "in_flight": 0,
                              "completed_today": 0},
            "legacy": {"tenants": tenants["legacy_tenants"]["after"], "pending": 0, "in_flight": 0, "leased": 0,
                       "received": 0, "completed_today": 0},
        }
        counts = await admin_ops.path_tasks(conn)
        for path, n in counts.pending_rows.items():
            paths[path]["pending"] = n - counts.pending_with_execution.get(path, 0)
        if "legacy" in counts.leased:  # the write matrix keeps desktop_tasks rows out of leased/received
            paths["legacy"]["leased"] = counts.leased["legacy"]
            paths["legacy"]["received"] = counts.received["legacy"]
            paths["legacy"]["in_flight"] = counts.leased["legacy"] + counts.received["legacy"]
        for path, n in counts.completed_today.items():
            paths[path]["completed_today"] = n
        executions = {s: 0 for s in ("queued", "in_progress", "unknown")}
        executions.update(await admin_ops.active_executions_by_status(conn))
        leases = {"queued": 0, "in_progress": 0, **counts.live_leases}
    paths["desktop_tasks"]["in_flight"] = sum(executions.values())
    return {
        "rollout_percentage": pct,
        "tenants": tenants["tenants"],
        "paths": paths,
        "active_executions": {**executions, "total": sum(executions.values())},
        "live_legacy_leases": {"offered": leases["queued"], "pulled": leases["in_progress"],
                               "total": sum(leases.values())},
    }


async def emergency_rollback(conn: Conn, *, force_in_flight: bool, dry_run: bool = False) -> dict[str, Any]:
    """`monitorctl rollback` (docs/legacy-path.md): rollout to 0% (new tasks take the legacy path) and the pending
    desktop_tasks-owned business tasks without an active execution handed to the legacy path; in-flight
    executions are left to finish on desktop_tasks. With `force_in_flight`, every active monitor execution is also
    aborted (reason phase2_emergency_rollback, the client told with a TaskControl 'cancelled', `task.aborted`)
    and its business task, given its dispatch attempt back, goes to the legacy path too.

    One transaction under the coordinator's pass lock (no dispatch pass interleaves) with its outbox events.
    Idempotent: a second run changes nothing and reports zeros. `dry_run` reports the same counts and changes
    nothing (nor takes the pass lock)."""
    if dry_run:
        outer = conn.info.transaction_status == TransactionStatus.IDLE
        async with conn.transaction():
            if outer:  # one snapshot for every count
                await conn.execute(_SNAPSHOT)
            before = (await load_settings(conn)).rollout_percentage
            movement = await _tenant_movement(conn, before, 0)
            preview = await admin_ops.rollback_preview(conn)
        in_flight = preview.in_flight
        moved = preview.pending_desktop_tasks if force_in_flight else preview.pending_without_execution
        would_abort = in_flight if force_in_flight else 0
        return _rollback_result(dry_run=True, forced=force_in_flight, before=before, movement=movement,
                                aborted=would_abort, moved=moved, left=in_flight - would_abort)
    async with conn.transaction():
        await conn.execute(q.PASS_LOCK)  # no dispatch pass interleaves with the rollback
        await conn.execute(ROLLOUT_LOCK)
        before = (await load_settings(conn)).rollout_percentage
        if before != 0:
            await set_setting(conn, "rollout_percentage", 0)
        movement = await _tenant_movement(conn, before, 0)
        aborted = await _abort_in_flight(conn) if force_in_flight else 0
        moved = await business.rollback_to_legacy(conn)
        left = await admin_ops.active_execution_count(conn)
        if moved or aborted:  # the coordinator offers them on the legacy path without waiting for its tick
            await conn.execute("SELECT pg_notify(%(channel)s, '')", {"channel": DISPATCH_WAKE_CHANNEL})
    return _rollback_result(dry_run=False, forced=force_in_flight, before=before, movement=movement,
                            aborted=aborted, moved=moved, left=left)


async def _abort_in_flight(conn: Conn) -> int:
    """--force: end every active monitor execution (aborted, phase2_emergency_rollback), give each business task
    its dispatch attempt back, and tell the clients (TaskControl 'cancelled') and the lifecycle stream
    (`task.aborted`) through the outbox. Returns how many were ended."""
    active = {row.id: row for row in await admin_ops.active_monitor_executions(conn)}
    ended = await execution_paths.end_many(conn, [ExecutionEnd(task_id=task_id, outcome="aborted",
                                                               reason=ROLLBACK_REASON) for task_id in active])
    rows = [(active[e.task_id], e) for e in ended if e.task_id in active]
    if not rows:
        return 0
    await admin_ops.give_back_dispatch_attempts(conn, (row.monitor_task_id for row, _ in rows))
    now = datetime.now(UTC)
    events: list[OutboxEvent] = []
    for row, end in rows:
        client = row.target_client_id
        events.append(control_event(task_id=row.id, client_id=client, control="cancelled", reason=ROLLBACK_REASON,
                                    interrupt_generation=row.interrupt_generation, tenant_id=row.tenant_id,
                                    collect_request_id=row.collect_request_id, now=now))
        events.append(OutboxEvent(
            exchange=LIFECYCLE, routing_key="task.aborted",
            message=LifecycleEvent(event="task.aborted", tenant_id=row.tenant_id, occurred_at=now,
                                   client_id=client, task_id=row.id, monitor_task_id=row.monitor_task_id,
                                   ai_platform_id=end.ai_platform_id, lane=end.lane, reason=ROLLBACK_REASON,
                                   collect_request_id=row.collect_request_id),
            tenant_id=row.tenant_id))
    await enqueue_many(conn, events, notify=True)
    return len(rows)


def _rollback_result(*, dry_run: bool, forced: bool, before: int, movement: dict[str, Any], aborted: int,
                     moved: int, left: int) -> dict[str, Any]:
    return {
        "dry_run": dry_run,
        "forced": forced,
        "rollout_percentage": 0,
        "rollout_percentage_before": before,
        "rollout_changed": before != 0,
        "tenants_to_legacy": movement["tenants_to_legacy"],
        "aborted_executions": aborted,
        "task_control_messages": aborted,
        "business_tasks_to_legacy": moved,
        "in_flight_left_to_finish": left,
    }


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
    lanes = {r.lane: {"ready": r.ready, "oldest_ms": int(r.oldest_ms)} for r in await admin_ops.lane_backlog(conn)}
    for lane in MONITOR_LANE_NAMES:
        lanes.setdefault(lane, {"ready": 0, "oldest_ms": 0})
        lanes[lane]["paused"] = lane in settings.paused_lanes  # type: ignore[assignment]
    executions = await admin_ops.active_executions_by_status(conn)
    clients = msgspec.structs.asdict(
        await admin_ops.client_counts(conn, heartbeat_timeout_s=settings.heartbeat_timeout_seconds))
    depth = await outbox_admin.depth(conn)
    window = max(1, settings.budget_window_seconds)
    start = window_start(time.time(), window)
    cur = await conn.execute(q.BUDGET_USED, {"window_start": start, "window_end": start + window})
    used = [dict(r) for r in await cur.fetchall()]
    state = await read_coordinator_state(conn)
    leaders = await leader_states(conn)
    cur = await conn.execute("SELECT coalesce(max(version), 0) AS version FROM schema_migrations")
    applied = int((await cur.fetchone() or {"version": 0})["version"])
    expected = max((m.version for m in load_migrations()), default=0)
    lag_ms = await ingest_lag_ms(conn)
    problems = [f"no {r['role']} replica holds the leader lock" for r in leaders if not r["leading"]]
    if applied < expected:
        problems.append(f"schema at version {applied}, the code expects {expected}: run monitorctl migrate")
    if lag_ms > settings.ingest_lag_threshold_ms:
        problems.append(f"ingest lag {lag_ms:.0f} ms over {settings.ingest_lag_threshold_ms} ms")
    return {
        "healthy": not problems,
        "problems": problems,
        "schema": {"version": applied, "expected": expected},
        "leaders": leaders,
        "ingest_lag_ms": round(lag_ms),
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
