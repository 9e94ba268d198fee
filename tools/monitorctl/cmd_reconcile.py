"""`monitorctl reconcile --once [--job NAME]`: run reconcile jobs now, outside the reconciler service.

The jobs are safe to run next to the service (row locks with SKIP LOCKED, conditional updates), so
no leader lock is taken here.
"""

from __future__ import annotations

import argparse
from typing import Any

from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.runner import run_job
from tools.monitorctl.common import Context, fail, render_table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("reconcile", help="run reconcile jobs once (expired leases, TTLs, offline clients, ...)")
    parser.add_argument("--once", action="store_true", help="run the jobs once and exit (required)")
    parser.add_argument("--job", action="append", choices=sorted(JOBS), metavar="NAME",
                        help=f"run only this job (repeatable); one of: {', '.join(JOBS)}")
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, ctx: Context) -> int:
    if not args.once:
        return fail("pass --once (the reconciler service runs the jobs continuously)")
    names = args.job or list(JOBS)
    conn = await ctx.conn()
    config = ReconcilerConfig.from_env()
    rows: list[dict[str, Any]] = []
    for name in names:
        result = await run_job(JOBS[name], conn, config)
        rows.append({"job": name, "fixed": result.fixed, "details": result.details})

    def text(value: list[dict[str, Any]]) -> str:
        return render_table([{"job": r["job"], "fixed": r["fixed"],
                              "details": ", ".join(f"{k}={v}" for k, v in r["details"].items() if v) or "-"}
                             for r in value])

    ctx.emit(rows, text)
    return 0
