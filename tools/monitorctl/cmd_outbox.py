"""`monitorctl outbox dead-letters|replay|depth`."""

from __future__ import annotations

import argparse
import getpass
import logging
import sys
from typing import Any

from libs.outbox import admin
from libs.outbox.state import ReplayPlan
from libs.telemetry.logging import JsonFormatter
from tools.monitorctl.common import Context, fail


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("outbox", help="inspect and replay outbox dead letters")
    inner = parser.add_subparsers(dest="outbox_cmd", required=True)
    dl = inner.add_parser("dead-letters", help="list dead-lettered events with their reasons")
    dl.add_argument("--limit", type=int, default=100)
    dl.set_defaults(func=list_dead_letters)
    rp = inner.add_parser("replay", help="put dead-lettered events back in the queue (explicit only; transient "
                                         "failures only unless --include-permanent)")
    rp.add_argument("ids", nargs="*", type=int, help="outbox ids to replay")
    rp.add_argument("--all", action="store_true", help="replay every dead letter")
    rp.add_argument("--include-permanent", action="store_true",
                    help="also replay dead letters whose failure was permanent (or is unknown: dead-lettered "
                         "before failures were classed)")
    rp.set_defaults(func=replay)
    dp = inner.add_parser("depth", help="rows by status and the oldest pending age")
    dp.set_defaults(func=depth)


async def list_dead_letters(args: argparse.Namespace, ctx: Context) -> int:
    rows = await admin.dead_letters(await ctx.conn(), args.limit)
    ctx.emit(rows)
    return 0


async def replay(args: argparse.Namespace, ctx: Context) -> int:
    if not args.ids and not args.all:
        return fail("name outbox ids to replay, or pass --all")
    _transition_lines_to_stderr()
    plan = await admin.replay(await ctx.conn(), ids=args.ids, replay_all=args.all,
                              include_permanent=args.include_permanent, operator=_operator())
    ctx.emit(_replay_summary(plan), _replay_text(plan))
    return 0 if plan.reset or args.all else fail("nothing replayed", 1)


def _transition_lines_to_stderr() -> None:
    """monitorctl logs warnings only; a replay's transition lines (one per reset dead letter) are its audit
    trail, so they go to stderr as the services' JSON lines, apart from the command's own output on stdout."""
    logger = logging.getLogger("outbox.admin")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter("monitorctl"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _operator() -> str:
    try:
        return f"monitorctl:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name to be found (a bare container)
        return "monitorctl"


def _replay_summary(plan: ReplayPlan) -> dict[str, Any]:
    permanent = [s for s in plan.skipped if s.error_class == "permanent"]
    unclassified = [s for s in plan.skipped if s.error_class is None]
    return {
        "replayed": plan.reset,
        "skipped_permanent": [{"id": s.id, "reason": s.reason} for s in permanent],
        "skipped_unclassified": [{"id": s.id, "reason": s.reason} for s in unclassified],
        "not_dead_letters": [{"id": i, "status": status} for i, status in plan.not_dead.items()],
        "not_found": plan.not_found,
        "counts": {"replayed": len(plan.reset), "skipped_permanent": len(permanent),
                   "skipped_unclassified": len(unclassified), "not_dead_letters": len(plan.not_dead),
                   "not_found": len(plan.not_found)},
    }


def _replay_text(plan: ReplayPlan) -> str:
    summary = _replay_summary(plan)
    lines = [f"replayed {len(plan.reset)} event(s): {plan.reset}"]
    if summary["skipped_permanent"]:
        lines.append(f"skipped {len(summary['skipped_permanent'])} permanent dead letter(s) (they would fail the "
                     "same way again; --include-permanent replays them anyway):")
        lines += [f"  {s['id']}: {s['reason']}" for s in summary["skipped_permanent"]]
    if summary["skipped_unclassified"]:
        lines.append(f"skipped {len(summary['skipped_unclassified'])} unclassified dead letter(s), treated as "
                     "permanent (dead-lettered before failures were classed; --include-permanent replays them):")
        lines += [f"  {s['id']}: {s['reason']}" for s in summary["skipped_unclassified"]]
    if plan.not_dead:
        lines.append(f"{len(plan.not_dead)} id(s) not dead letters: "
                     + ", ".join(f"{i} ({status})" for i, status in plan.not_dead.items()))
    if plan.not_found:
        lines.append(f"{len(plan.not_found)} id(s) not found: {plan.not_found}")
    return "\n".join(lines)


async def depth(args: argparse.Namespace, ctx: Context) -> int:
    ctx.emit(await admin.depth(await ctx.conn()))
    return 0
