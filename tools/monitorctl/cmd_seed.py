"""`monitorctl seed-demo` and `monitorctl client create`: demo data and desktop client tokens (the other
`client` commands are in cmd_client.py)."""

from __future__ import annotations

import argparse
from typing import Any

from libs.demo import create_client, seed_demo
from libs.dispatch_settings import SettingError, check_ceiling, load_settings
from services.dispatch_coordinator.admin import CEILING_LOCK
from tools.monitorctl.cmd_client import register_client_commands
from tools.monitorctl.common import Context, fail


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    seed = sub.add_parser("seed-demo", help="create demo tenants, brands, questions, plans and desktop clients")
    seed.add_argument("--tenants", type=_positive, default=1)
    seed.add_argument("--brands", type=_positive, default=1, help="brands per tenant")
    seed.add_argument("--questions", type=_positive, default=2, help="questions per brand")
    seed.add_argument("--keywords", type=_positive, default=1, help="keywords per brand")
    seed.add_argument("--clients", type=_non_negative, default=1, help="desktop clients per tenant")
    seed.add_argument("--platforms", default="openai,gemini,perplexity", help="comma-separated platform codes")
    seed.add_argument("--time-zone", default="UTC", help="the tenants' time zone (business dates)")
    seed.add_argument("--not-due", action="store_true", help="plans start tomorrow instead of now")
    seed.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    seed.set_defaults(func=run_seed)

    client = sub.add_parser("client", help="desktop clients")
    client_sub = client.add_subparsers(dest="client_command", required=True)
    create = client_sub.add_parser("create", help="register a desktop client and print its token (shown once)")
    create.add_argument("--tenant", type=_positive, required=True)
    create.add_argument("--workspace", type=_positive, required=True)
    create.add_argument("--user", type=_positive, required=True)
    create.add_argument("--name", default="")
    create.add_argument("--max-concurrent", type=_non_negative, default=2)
    create.add_argument("--max-queue-depth", type=_non_negative, default=20)
    create.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    create.set_defaults(func=run_client_create)
    register_client_commands(client_sub)


def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return number


def _json_flag(args: argparse.Namespace, ctx: Context) -> None:
    # `--json` is accepted both before and after the sub-command.
    if getattr(args, "json", False):
        ctx.as_json = True


async def run_seed(args: argparse.Namespace, ctx: Context) -> int:
    _json_flag(args, ctx)
    codes = tuple(c.strip() for c in args.platforms.split(",") if c.strip())
    if not codes:
        return fail("--platforms needs at least one platform code")
    conn = await ctx.conn()
    result = await seed_demo(conn, tenants=args.tenants, brands=args.brands, questions=args.questions,
                             clients=args.clients, platforms=codes, due=not args.not_due,
                             keywords_per_brand=args.keywords, time_zone=args.time_zone)
    ctx.emit(result, _seed_text)
    return 0


def _seed_text(result: dict[str, Any]) -> str:
    lines = ["platforms: " + ", ".join(f"{p['code']}={p['ai_platform_id']}" for p in result["platforms"])]
    for tenant in result["tenants"]:
        lines.append(f"tenant {tenant['tenant_id']} (workspace {tenant['workspace_id']}, user {tenant['user_id']})")
        for brand in tenant["brands"]:
            lines.append(f"  brand {brand['brand_id']}: keywords {brand['keyword_ids']} "
                         f"questions {brand['question_ids']}")
        for client in tenant["clients"]:
            lines.append(f"  client {client['client_id']} token {client['token']}")
    return "\n".join(lines)


async def run_client_create(args: argparse.Namespace, ctx: Context) -> int:
    _json_flag(args, ctx)
    conn = await ctx.conn()
    cur = await conn.execute("SELECT 1 FROM tenants WHERE id = %(id)s", {"id": args.tenant})
    if await cur.fetchone() is None:
        return fail(f"tenant {args.tenant} does not exist")
    async with conn.transaction():
        await conn.execute(CEILING_LOCK)  # no ceiling lowered between the check and the write
        settings = await load_settings(conn)
        try:
            check_ceiling(settings, "client.max_concurrent", args.max_concurrent)
            check_ceiling(settings, "client.max_queue_depth", args.max_queue_depth)
        except SettingError as exc:
            return fail(str(exc))
        client_id, token = await create_client(
            conn, tenant_id=args.tenant, workspace_id=args.workspace, user_id=args.user, name=args.name,
            max_concurrent_monitor=args.max_concurrent, max_queue_depth=args.max_queue_depth)
    ctx.emit({"client_id": str(client_id), "token": token, "tenant_id": args.tenant,
              "workspace_id": args.workspace, "user_id": args.user},
             f"client_id: {client_id}\ntoken: {token}\n(the token is shown once; only its hash is stored)")
    return 0
