"""monitorctl: the operator CLI. Human-readable text by default, JSON with --json."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import uvloop

from libs.config import Settings
from tools.monitorctl.common import Context

# One module per command group; each exposes `register(subparsers)`.
COMMAND_MODULES = (
    "cmd_migrate",
    "cmd_outbox",
    "cmd_token",
    "cmd_seed",
    "cmd_reconcile",
    "cmd_dispatch",
    "cmd_trace",
    "cmd_roles",
    "cmd_ingest",
    "cmd_contracts",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="monitorctl", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"tools.monitorctl.{name}").register(sub)
    return parser


async def _run(args: argparse.Namespace) -> int:
    ctx = Context(settings=Settings.from_env(), as_json=args.json)
    try:
        code: int = await args.func(args, ctx)
        return code
    finally:
        await ctx.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    sys.exit(uvloop.run(_run(args)))
