"""`monitorctl token issue`: a gateway JWT for local use (the tenant-api gateway issues these in production)."""

from __future__ import annotations

import argparse

from libs.auth import TenantPrincipal, issue_gateway_jwt
from tools.monitorctl.common import Context, fail


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("token", help="issue a gateway JWT for calling collect-now-api locally")
    inner = parser.add_subparsers(dest="token_cmd", required=True)
    issue = inner.add_parser("issue", help="sign a JWT with GATEWAY_JWT_SECRET (HS256)")
    issue.add_argument("--tenant", type=int, required=True)
    issue.add_argument("--workspace", type=int, required=True)
    issue.add_argument("--user", type=int, required=True)
    issue.add_argument("--ttl", type=int, default=3600, help="seconds until it expires")
    issue.set_defaults(func=run)


async def run(args: argparse.Namespace, ctx: Context) -> int:
    key, algorithm = ctx.settings.jwt_key()
    if algorithm != "HS256":
        return fail("only HS256 tokens can be issued here (RS256 needs the gateway's private key)")
    settings = ctx.settings
    # The audience and issuer the service checks (required outside DEV_MODE), so the token is one it accepts.
    token = issue_gateway_jwt(key, TenantPrincipal(args.tenant, args.workspace, args.user), ttl_s=args.ttl,
                              audience=settings.gateway_jwt_audience or None,
                              issuer=settings.gateway_jwt_issuer or None)
    ctx.emit({"token": token}, token)
    return 0
