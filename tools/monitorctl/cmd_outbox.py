"""`monitorctl outbox dead-letters|replay|depth`."""

from __future__ import annotations

import argparse

from libs.outbox import admin
from tools.monitorctl.common import Context, fail


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("outbox", help="inspect and replay outbox dead letters")
    inner = parser.add_subparsers(dest="outbox_cmd", required=True)
    dl = inner.add_parser("dead-letters", help="list dead-lettered events with their reasons")
    dl.add_argument("--limit", type=int, default=100)
    dl.set_defaults(func=list_dead_letters)
    rp = inner.add_parser("replay", help="put dead-lettered events back in the queue (explicit only)")
    rp.add_argument("ids", nargs="*", type=int, help="outbox ids to replay")
    rp.add_argument("--all", action="store_true", help="replay every dead letter")
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
    replayed = await admin.replay(await ctx.conn(), ids=args.ids, replay_all=args.all)
    ctx.emit({"replayed": replayed}, f"replayed {len(replayed)} event(s): {replayed}")
    return 0 if replayed or args.all else fail("none of those ids is a dead letter", 1)


async def depth(args: argparse.Namespace, ctx: Context) -> int:
    ctx.emit(await admin.depth(await ctx.conn()))
    return 0
