"""`monitorctl migrate`: create the database if needed and apply pending migrations."""

from __future__ import annotations

import argparse

from libs.db.migrate import ensure_database, migrate
from tools.monitorctl.common import Context


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("migrate", help="apply pending migrations (safe to run concurrently)")
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, ctx: Context) -> int:
    created = await ensure_database(ctx.settings.database_url)
    applied = await migrate(ctx.settings.database_url)
    names = [f"{m.version:03d}_{m.name}" for m in applied]
    ctx.emit({"database_created": created, "applied": names},
             "nothing to apply; the schema is current" if not names else "applied: " + ", ".join(names))
    return 0
