"""`monitorctl client disable | enable | rotate-token`: revoking a desktop client.

What each does, and how fast it bites (README, "Security model"):
- disable: the client's HTTP calls are refused (401 `client_disabled`) within the hubs' auth cache time (5 s),
  its open sockets are closed with code 4403 within a revocation sweep (2 s), its heartbeats are ignored, the
  coordinator sends it nothing new, and the reconciler hands its queued and running work back for dispatch to
  other clients.
- enable: the client may connect again (its token is unchanged).
- rotate-token: a new token is printed once; the old one stops working the same way (sockets closed with 4401),
  so a leaked token is dead within seconds while the client itself is re-provisioned with the new one.
Each is one transaction with its lifecycle event (outbox), and running it twice changes nothing more.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from libs.auth import hash_token, new_client_token
from libs.contracts.amqp import LifecycleKind
from libs.db.pool import Conn
from libs.tasks.transitions import emit_lifecycle
from services.dispatch_coordinator import admin
from tools.monitorctl.common import Context, fail

# `online` stays the hub's to write: it marks the client offline when it closes the client's sockets.
DISABLE = "UPDATE desktop_clients SET disabled_at = now(), updated_at = now() WHERE id = %(id)s"

ENABLE = "UPDATE desktop_clients SET disabled_at = NULL, updated_at = now() WHERE id = %(id)s"

ROTATE = "UPDATE desktop_clients SET token_hash = %(token_hash)s, updated_at = now() WHERE id = %(id)s"

STATE = "SELECT tenant_id, disabled_at FROM desktop_clients WHERE id = %(id)s FOR UPDATE"


def register_client_commands(client_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, func, text in (
        ("disable", run_disable, "refuse the client everywhere within seconds (sockets closed, calls refused)"),
        ("enable", run_enable, "allow a disabled client again (same token)"),
        ("rotate-token", run_rotate, "issue a new token (shown once); the old one stops working within seconds"),
    ):
        cmd = client_sub.add_parser(name, help=text)
        cmd.add_argument("client_id", type=_client_id)
        cmd.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
        cmd.set_defaults(func=func)
    register_client_set(client_sub)


def register_client_set(client_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = client_sub.add_parser("set", help="change a client's monitor concurrency and queue depth (bounded by "
                                            "client_max_concurrent_ceiling / client_max_queue_depth_ceiling)")
    cmd.add_argument("client_id", type=_client_id)
    cmd.add_argument("--max-concurrent", type=int)
    cmd.add_argument("--max-queue-depth", type=int)
    cmd.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    cmd.set_defaults(func=run_set)


async def run_set(args: argparse.Namespace, ctx: Context) -> int:
    if getattr(args, "json", False):
        ctx.as_json = True
    if args.max_concurrent is None and args.max_queue_depth is None:
        return fail("give --max-concurrent and/or --max-queue-depth")
    try:
        row = await admin.set_client_limits(await ctx.conn(), args.client_id, max_concurrent=args.max_concurrent,
                                            max_queue_depth=args.max_queue_depth)
    except admin.AdminError as exc:
        return fail(str(exc))
    ctx.emit(row)
    return 0


def _client_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a client id (a UUID)") from None


async def _locked_state(conn: Conn, client_id: uuid.UUID) -> dict[str, Any] | None:
    cur = await conn.execute(STATE, {"id": client_id})
    return await cur.fetchone()


async def _audit(conn: Conn, event: LifecycleKind, tenant_id: int, client_id: uuid.UUID) -> None:
    await emit_lifecycle(conn, event, tenant_id=tenant_id, client_id=client_id, reason="monitorctl")


async def run_disable(args: argparse.Namespace, ctx: Context) -> int:
    return await _set_disabled(args, ctx, disabled=True)


async def run_enable(args: argparse.Namespace, ctx: Context) -> int:
    return await _set_disabled(args, ctx, disabled=False)


async def _set_disabled(args: argparse.Namespace, ctx: Context, *, disabled: bool) -> int:
    """Disable or enable a client: one transaction with its audit event; nothing changes when it already is."""
    if getattr(args, "json", False):
        ctx.as_json = True
    conn = await ctx.conn()
    async with conn.transaction():
        state = await _locked_state(conn, args.client_id)
        if state is None:
            return fail(f"no desktop client {args.client_id}")
        changed = (state["disabled_at"] is None) == disabled
        if changed:
            await conn.execute(DISABLE if disabled else ENABLE, {"id": args.client_id})
            await _audit(conn, "client.disabled" if disabled else "client.enabled", int(state["tenant_id"]),
                         args.client_id)
    verb = "disabled" if disabled else "enabled"
    unchanged = "was already disabled" if disabled else "was not disabled"
    ctx.emit({"client_id": str(args.client_id), "disabled": disabled, "changed": changed},
             f"client {args.client_id} {verb}" if changed else f"client {args.client_id} {unchanged}")
    return 0


async def run_rotate(args: argparse.Namespace, ctx: Context) -> int:
    if getattr(args, "json", False):
        ctx.as_json = True
    conn = await ctx.conn()
    token = new_client_token()
    async with conn.transaction():
        state = await _locked_state(conn, args.client_id)
        if state is None:
            return fail(f"no desktop client {args.client_id}")
        await conn.execute(ROTATE, {"id": args.client_id, "token_hash": hash_token(token)})
        await _audit(conn, "client.token_rotated", int(state["tenant_id"]), args.client_id)
    ctx.emit({"client_id": str(args.client_id), "token": token},
             f"client_id: {args.client_id}\ntoken: {token}\n(the token is shown once; the old one no longer works)")
    return 0
