"""Dispatch operations: `budgets`, `lane`, `platform`, `rollout`, `rollback`, `explain`, `status`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from libs.dispatch_settings import LANES, SettingError
from services.dispatch_coordinator import admin, rollout_ramp
from services.dispatch_coordinator.explain import explain_task
from tools.monitorctl.common import Context, fail, render_table, render_text


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
    pset.add_argument("--mode", help="set the two timeouts of one mode the platform runs questions in (e.g. "
                                     "deep_reasoning) instead of the platform's own")
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

    rollout = sub.add_parser("rollout", help="which execution path new tasks take: tenant_id %% 100 < PCT -> "
                                             "desktop_tasks, else legacy (docs/legacy-path.md)")
    roll_inner = rollout.add_subparsers(dest="rollout_cmd", required=True)
    rset = roll_inner.add_parser("set", help="set the rollout percentage and print how many tenants move; "
                                             "existing tasks keep their path")
    rset.add_argument("percentage", type=int, help="0..100")
    rset.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    rset.add_argument("--force", action="store_true",
                      help="needed to raise the percentage: a deliberate jump past the ramp's gates "
                           "(lowering it needs none)")
    rset.set_defaults(func=rollout_set)
    radv = roll_inner.add_parser(
        "advance", help="take the next step of the ramp (rollout_ramp, default 5:2d,25:4d,50:7d,100) if the "
                        "current step's gates held for its dwell; else print why not and exit 1")
    radv.add_argument("--dry-run", action="store_true", help="judge the gates, change nothing")
    radv.set_defaults(func=rollout_advance)
    roll_inner.add_parser("status", help="per path: tenants, business tasks pending, in flight and completed "
                                         "today; live legacy leases and active executions").set_defaults(
        func=rollout_status_run)

    rollback = sub.add_parser(
        "rollback", help="emergency rollback to the legacy path: a dry run unless --yes (docs/legacy-path.md)",
        description="Without --yes (or with --dry-run): print the counts a rollback would change and change "
                    "nothing. --yes: rollout to 0%% and pending desktop_tasks tasks without an active execution to "
                    "legacy; in-flight desktop_tasks executions finish. --yes --force: also abort every active "
                    "monitor execution (reason phase2_emergency_rollback, clients told) and return its task to "
                    "legacy. One transaction; running it again changes nothing.")
    mode = rollback.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="the default: print the counts, change nothing")
    mode.add_argument("--yes", action="store_true", help="apply the rollback")
    rollback.add_argument("--force", action="store_true",
                          help="also abort in-flight desktop_tasks executions and return their tasks to legacy")
    rollback.add_argument("--keep-in-flight", action="store_true", help=argparse.SUPPRESS)  # deprecated: the default
    rollback.set_defaults(func=rollback_run)

    explain = sub.add_parser("explain", help="why a ready task is not dispatched yet")
    explain.add_argument("task_id", help="business task id (or a monitor execution uuid)")
    explain.set_defaults(func=explain_run)

    status = sub.add_parser("status", help="leaders, schema version, ingest lag, lane backlogs, clients online, "
                                           "outbox depth, dead letters; exits 1 when unhealthy")
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
    result: dict[str, Any] = {"key": args.key, "value": value}
    warning = await admin.budget_warning(await ctx.conn()) if args.key in admin.BUDGET_KEYS else None
    if warning:
        result["warning"] = warning
        print(f"monitorctl: warning: {warning}", file=sys.stderr)
    ctx.emit(result, f"{args.key} = {json.dumps(value)}")
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
        if args.mode is not None:
            ctx.emit(await admin.set_platform_mode(await ctx.conn(), args.code, args.mode,
                                                   soft_timeout_ms=args.soft_timeout_ms,
                                                   hard_timeout_ms=args.hard_timeout_ms))
            return 0
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
        if args.dry_run:
            result = await admin.rollout_preview(await ctx.conn(), args.percentage)
        else:
            result = await admin.set_rollout(await ctx.conn(), args.percentage, force=args.force)
    except SettingError as exc:
        return fail(str(exc))
    ctx.emit(result, _rollout_set_text)
    return 0


def _rollout_set_text(value: dict[str, Any]) -> str:
    pct, desk, legacy = value["rollout_percentage"], value["desktop_tasks_tenants"], value["legacy_tenants"]
    head = "rollout (dry run, nothing changed)" if not value["applied"] else "rollout"
    return "\n".join([
        f"{head}: {pct['before']}% -> {pct['after']}% (tenant_id % 100 < {pct['after']} -> desktop_tasks)",
        f"tenants: {value['tenants']}; desktop_tasks {desk['before']} -> {desk['after']}, "
        f"legacy {legacy['before']} -> {legacy['after']}",
        f"new tasks move to legacy for {value['tenants_to_legacy']} tenant(s), to desktop_tasks for "
        f"{value['tenants_to_desktop_tasks']} tenant(s)",
        "existing tasks keep their path (pending and in flight): only tasks created from now on take the new one",
    ])


async def rollout_advance(args: argparse.Namespace, ctx: Context) -> int:
    result = await rollout_ramp.advance(await ctx.conn(), dry_run=args.dry_run)
    ctx.emit(result, _rollout_advance_text)
    return 0 if result["allowed"] else 1


def _rollout_advance_text(value: dict[str, Any]) -> str:
    pct = value["rollout_percentage"]
    if value["applied"]:
        head = f"rollout advanced: {pct['before']}% -> {pct['after']}% (ramp {value['ramp']})"
    elif value["allowed"]:
        head = f"rollout may advance {pct['before']}% -> {value['next_step']}% (dry run, nothing changed)"
    elif value["next_step"] is None:
        head = f"rollout not advanced: {pct['before']}% is the last step of the ramp"
    else:
        head = f"rollout not advanced: stays at {pct['before']}% (next step {value['next_step']}%)"
    lines = [head, f"dwell {value['dwell_seconds']} s; gates held for {value['held_seconds']:.0f} s "
                   f"(since {value['held_since']})"]
    lines += [f"- why not: {reason}" for reason in value["reasons"]]
    for gate in value["gates"]:
        rest = ", ".join(f"{k}={v}" for k, v in gate.items() if k not in {"gate", "ok"})
        lines.append(f"  {'ok  ' if gate['ok'] else 'FAIL'} {gate['gate']}: {rest}")
    return "\n".join(lines)


async def rollout_status_run(args: argparse.Namespace, ctx: Context) -> int:
    ctx.emit(await admin.rollout_status(await ctx.conn()), _rollout_status_text)
    return 0


def _rollout_status_text(value: dict[str, Any]) -> str:
    pct = value["rollout_percentage"]
    rows = [{"path": path, "tenants": p["tenants"], "pending": p["pending"], "in_flight": p["in_flight"],
             "completed_today": p["completed_today"]} for path, p in value["paths"].items()]
    legacy, leases, execs = value["paths"]["legacy"], value["live_legacy_leases"], value["active_executions"]
    return "\n".join([
        f"rollout: {pct}% (tenant_id % 100 < {pct} -> desktop_tasks for new tasks), {value['tenants']} tenant(s)",
        render_table(rows),
        f"legacy in flight: {legacy['leased']} leased, {legacy['received']} received (result posted)",
        f"live legacy leases: {leases['total']} ({leases['offered']} offered, {leases['pulled']} pulled)",
        f"active executions: {execs['total']} ({execs['queued']} queued, {execs['in_progress']} in progress, "
        f"{execs['unknown']} unknown)",
    ])


async def rollback_run(args: argparse.Namespace, ctx: Context) -> int:
    if args.keep_in_flight:
        print("monitorctl: --keep-in-flight is deprecated: leaving in-flight executions to finish is the default "
              "of --yes", file=sys.stderr)
        if args.force:
            return fail("--keep-in-flight contradicts --force")
    result = await admin.emergency_rollback(await ctx.conn(), force_in_flight=args.force, dry_run=not args.yes)
    ctx.emit(result, _rollback_text)
    return 0


def _rollback_text(value: dict[str, Any]) -> str:
    dry = value["dry_run"]
    if not dry:
        head = "emergency rollback applied" + (" (--force)" if value["forced"] else "")
    elif value["forced"]:
        head = "emergency rollback --force, dry run: nothing changed (--yes --force applies)"
    else:
        head = "emergency rollback, dry run: nothing changed (--yes applies; --yes --force also aborts in-flight work)"
    rollout = (f"rollout: {value['rollout_percentage_before']}% -> 0% (new tasks of {value['tenants_to_legacy']} "
               f"tenant(s) {'would move' if dry else 'moved'} to legacy)" if value["rollout_changed"]
               else "rollout: already 0% (every new task takes the legacy path)")
    lines = [head, rollout,
             f"business tasks {'to move' if dry else 'moved'} to legacy: {value['business_tasks_to_legacy']}"]
    if value["forced"]:
        lines.append(f"in-flight desktop_tasks executions {'to abort' if dry else 'aborted'}: "
                     f"{value['aborted_executions']} (reason {admin.ROLLBACK_REASON}; "
                     f"{value['task_control_messages']} task_control message(s) to clients)")
    else:
        left = value["in_flight_left_to_finish"]
        lines.append(f"in-flight desktop_tasks executions left to finish: {left}"
                     + (" (--force aborts them)" if left else ""))
    return "\n".join(lines)


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
    """Exit 1 when the status names a problem (a role with no leader, the schema behind, ingest lagging), so a
    script or a probe can act on it."""
    status = await admin.status(await ctx.conn())
    ctx.emit(status)
    return 0 if status["healthy"] else 1
