"""`monitorctl contracts write|check`: the committed API documents under contracts/ (docs/api.md, Versioning)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tools.contracts_docs import CONTRACTS_DIR, DOCUMENTS, stale, write
from tools.monitorctl.common import Context


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("contracts", help="regenerate or check the committed OpenAPI documents (contracts/)")
    inner = parser.add_subparsers(dest="contracts_cmd", required=True)
    for name, text in (("write", "write the documents the code serves into contracts/"),
                       ("check", "exit 1 when a committed document is not what the code serves")):
        command = inner.add_parser(name, help=text)
        command.add_argument("--dir", type=Path, default=CONTRACTS_DIR, help="the contracts folder")
        command.set_defaults(func=run_write if name == "write" else run_check)


async def run_write(args: argparse.Namespace, ctx: Context) -> int:
    changed = write(args.dir)
    ctx.emit({"written": changed, "documents": sorted(DOCUMENTS)},
             "written: " + ", ".join(changed) if changed else "every document is current")
    return 0


async def run_check(args: argparse.Namespace, ctx: Context) -> int:
    differing = stale(args.dir)
    ctx.emit({"stale": differing, "documents": sorted(DOCUMENTS)},
             "stale (run `monitorctl contracts write`): " + ", ".join(differing) if differing
             else "every document is current")
    return 1 if differing else 0
