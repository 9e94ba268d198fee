"""Dispatch operations: `budgets`, `lane`, `platform`, `rollout`, `rollback`, `explain`, `status`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from libs.dispatch_settings import LANES, SettingError
from services.dispatch_coordinator import admin
from services.dispatch_coordinator.explain import explain_task
from tools.monitorctl.common import Context, fail, render_text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    budgets = sub.add_parser("budgets", help="dispatch budgets, thresholds and other hot-reloaded settings")
    inner = budgets.add_subparsers(dest="budgets_cmd", required=True)
    inner.add_parser("get", help="every dispatch setting with its current value").set_defaults(func=budgets_get)
    bset = inner.add_parser("set", help="change one setting (effective within seconds, no restart)")
    bset.add_argument("key", help="e.g. cluster_dispatch_per_minute, tenant_dispatch_per_minute")
    bset.add_argument("value", help="the new value (JSON or plain text)")
    bset.set_defaults(func=budgets_set)
    ceil = inner.add_parser("set-ceiling", help="raise (or lower) a budget's ceiling: the circuit-breaker value "
                                                "no `budgets set`, `client set` or `platform set` may exceed")
    ceil.add_argument("key", help="e.g. cluster_dispatch_per_minute_ceiling, client_max_concurrent_ceiling")
    ceil.add_argument("value", type=int)
    ceil.set_defaults(func=budgets_set_ceiling)

    lane = sub.add_parser("lane", help="pause or resume a dispatch lane")
    lane_inner = lane.add_subparsers(dest="lane_cmd", required=True)
    for name, paused in (("pause", True), ("resume", False)):
        p = lane_inner.add_parser(name, help=f"{name} dispatch of a lane")
        p.add_argument("lane", choices=LANES)
        p.set_defaults(func=lane_set, paused=paused)

    platform = sub.add_parser("platform", help="per-platform concurrency, interrupt timeouts (configured and "
                                               "measured) and health overrides")
    plat_inner = platform.add_subparsers(dest="platform_cmd", required=True)
    pget = plat_inner.add_parser("get", help="settings of one platform (or all)")
    pget.add_argument("code", nargs="?", help="platform code, e.g. openai")
    pget.set_defaults(func=platform_get)
    pset = plat_inner.add_parser("set", help="change a platform's settings")
    pset.add_argument("code")
    pset.add_argument("--max-concurrent", type=int, help="active executions per (tenant, platform)")
    pset.add_argument("--soft-timeout-ms", type=int, help="interrupt soft timeout")
    pset.add_argument("--hard-timeout-ms", type=int, help="interrupt hard timeout")
    group = pset.add_mutually_exclusive_group()
    group.add_argument("--pause", dest="paused", action="store_const", const=True, help="stop dispatching to it")
    group.add_argument("--resume", dest="paused", action="store_const", const=False, help="dispatch to it again")
    tuning = pset.add_mutually_exclusive_group()
    tuning.add_argument("--dynamic", dest="dynamic", action="store_const", const=True,
                        help="let the reconciler set the interrupt timeouts from the measured safe-point P95")
    tuning.add_argument("--static", dest="dynamic", action="store_const", const=False,
                        help="keep the interrupt timeouts as configured")
    pset.set_defaults(func=platform_set)
    pho = plat_inner.add_parser("health-override", help="override the platform-health pause of one tenant's "
                                                        "platform (its clients' reported login state)")
    pho.add_argument("code")
    pho.add_argument("--tenant", type=int, required=True)
    mode = pho.add_mutually_exclusive_group(required=True)
    mode.add_argument("--pause", dest="mode", action="store_const", const="pause",
                      help="hold the tenant's scheduled work of this platform, whatever its clients report")
    mode.add_argument("--ignore-health", dest="mode", action="store_const", const="ignore_health",
                      help="dispatch it whatever its clients report (a stale report)")
    mode.add_argument("--clear", dest="mode", action="store_const", const="clear",
                      help="let the clients' reports decide again")
    pho.add_argument("--reason", default="", help="why (shown by `monitorctl status`)")
    pho.set_defaults(func=platform_health_override)

    rollout = sub.add_parser("rollout", help="Phase 2 rollout percentage (docs/architecture.md §16.2.2)")
    roll_inner = rollout.add_subparsers(dest="rollout_cmd", required=True)
    rset = roll_inner.add_parser("set", help="tenant_id %% 100 < PCT -> new tasks on the desktop_tasks path")
    rset.add_argument("percentage", type=int)
    rset.set_defaults(func=rollout_set)

    rollback = sub.add_parser("rollback", help="emergency rollback, docs/architecture.md §16.2.3 (rollout to 0%%)")
    rollback.add_argument("--yes", action="store_true", help="required: confirms the emergency rollback")
    rollback.add_argument("--keep-in-flight", action="store_true",
                          help="only set rollout to 0%%; let in-flight desktop_tasks executions finish naturally")
    rollback.set_defaults(func=rollback_run)

    explain = sub.add_parser("explain", help="why a ready task is not dispatched yet")
    explain.add_argument("task_id", help="business task id (or a monitor execution uuid)")
    explain.set_defaults(func=explain_run)

    status = sub.add_parser("status", help="lane backlogs, clients online, outbox depth, dead letters")
    status.set_defaults(func=status_run)


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


async def budgets_get(args: argparse.Namespace, ctx: Context) -> int:
    ctx.emit(await admin.get_budgets(await ctx.conn()))
    return 0


async def budgets_set(args: argparse.Namespace, ctx: Context) -> int:
    try:
        value = await admin.set_budget(await ctx.conn(), args.key, _parse_value(args.value))
    except SettingError as exc:
        return fail(str(exc))
    ctx.emit({"key": args.key, "value": value}, f"{args.key} = {json.dumps(value)}")
    return 0


async def budgets_set_ceiling(args: argparse.Namespace, ctx: Context) -> int:
    try:
        value = await admin.set_ceiling(await ctx.conn(), args.key, args.value)
    except SettingError as exc:
        return fail(str(exc))
    ctx.emit({"key": args.key, "value": value}, f"{args.key} = {json.dumps(value)}")
    return 0


async def lane_set(args: argparse.Namespace, ctx: Context) -> int:
    paused = await admin.set_lane_paused(await ctx.conn(), args.lane, args.paused)
    verb = "paused" if args.paused else "resumed"
    ctx.emit({"lane": args.lane, "paused": args.paused, "paused_lanes": paused},
             f"lane {args.lane} {verb}; paused lanes: {', '.join(paused) or '(none)'}")
    return 0


async def platform_get(args: argparse.Namespace, ctx: Context) -> int:
    rows = await admin.get_platforms(await ctx.conn(), args.code)
    if args.code and not rows:
        return fail(f"no platform with code {args.code!r}", 1)
    ctx.emit(rows)
    return 0


async def platform_set(args: argparse.Namespace, ctx: Context) -> int:
    try:
        row = await admin.set_platform(await ctx.conn(), args.code, max_concurrent=args.max_concurrent,
                                       soft_timeout_ms=args.soft_timeout_ms, hard_timeout_ms=args.hard_timeout_ms,
                                       paused=args.paused, dynamic=args.dynamic)
    except admin.AdminError as exc:
        return fail(str(exc))
    except Exception as exc:  # the CHECK constraints (hard >= soft) speak for themselves
        if type(exc).__name__ == "CheckViolation":
            return fail(f"rejected by the database: {str(exc).splitlines()[0]}")
        raise
    ctx.emit(row)
    return 0


async def platform_health_override(args: argparse.Namespace, ctx: Context) -> int:
    mode = None if args.mode == "clear" else args.mode
    try:
        row = await admin.set_health_override(await ctx.conn(), args.code, args.tenant, mode, args.reason)
    except admin.AdminError as exc:
        return fail(str(exc))
    ctx.emit(row)
    return 0


async def rollout_set(args: argparse.Namespace, ctx: Context) -> int:
    try:
        value = await admin.set_rollout(await ctx.conn(), args.percentage)
    except SettingError as exc:
        return fail(str(exc))
    ctx.emit({"rollout_percentage": value}, f"rollout_percentage = {value}")
    return 0


async def rollback_run(args: argparse.Namespace, ctx: Context) -> int:
    if not args.yes:
        return fail("emergency rollback sets rollout to 0% and (unless --keep-in-flight) aborts every active "
                    "monitor execution; pass --yes to confirm")
    result = await admin.emergency_rollback(await ctx.conn(), force_in_flight=not args.keep_in_flight)
    ctx.emit(result)
    return 0


async def explain_run(args: argparse.Namespace, ctx: Context) -> int:
    result = await explain_task(await ctx.conn(), args.task_id)
    if result is None:
        return fail(f"no business task or monitor execution {args.task_id!r}", 1)
    ctx.emit(result, _explain_text)
    return 0


def _explain_text(value: dict[str, Any]) -> str:
    head = [f"task {value['task_id']} (tenant {value['tenant_id']}, lane {value['lane']}, "
            f"priority {value['priority']}, status {value['status']})"]
    if value.get("dispatchable_now"):
        head.append("dispatchable now")
    for line in value.get("why", []):
        head.append(f"- {line}")
    rest = {k: v for k, v in value.items() if k not in {"why", "task_id"}}
    return "\n".join(head) + "\n" + render_text(rest)


async def status_run(args: argparse.Namespace, ctx: Context) -> int:
    ctx.emit(await admin.status(await ctx.conn()))
    return 0
