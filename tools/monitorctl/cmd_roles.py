"""`monitorctl db-roles` and `monitorctl broker-definitions`: least-privilege credentials per service
(docs/security.md "Least privilege"; deploy/k8s runs `db-roles` in the migration Job after `migrate`)."""

from __future__ import annotations

import argparse
import json
import os

from libs.db.roles import apply_roles
from libs.mq.permissions import BROKER_SERVICES, definitions
from tools.monitorctl.common import Context

DEFAULT_PREFIX = "monitoring_dispatch_"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("db-roles", help="create the per-service Postgres group roles and set their grants "
                                             "(run as the migration role, after migrate)")
    parser.add_argument("--prefix", default=os.environ.get("DB_ROLE_PREFIX", DEFAULT_PREFIX),
                        help="role name prefix (roles are cluster-wide): <prefix><service>, env DB_ROLE_PREFIX")
    parser.set_defaults(func=run_db_roles)
    parser = sub.add_parser("broker-definitions",
                            help="print a RabbitMQ definitions document: a user per service with its permissions")
    parser.add_argument("--prefix", default=os.environ.get("MQ_USER_PREFIX", ""),
                        help="user name prefix: <prefix><service>, env MQ_USER_PREFIX")
    parser.add_argument("--mq-prefix", default=os.environ.get("MQ_PREFIX", ""),
                        help="the services' exchange and queue name prefix (their MQ_PREFIX)")
    parser.add_argument("--vhost", default="/")
    parser.add_argument("--password-env", default="BROKER_PASSWORD_",
                        help="each service's password is read from <this><SERVICE> (e.g. BROKER_PASSWORD_DISPATCH_HUB)")
    parser.set_defaults(func=run_broker_definitions)


async def run_db_roles(args: argparse.Namespace, ctx: Context) -> int:
    granted = await apply_roles(await ctx.conn(), args.prefix)
    ctx.emit(granted, "\n".join(f"{args.prefix}{service.replace('-', '_')}: " + ", ".join(
        f"{table} ({' '.join(p[0] for p in privileges)})" for table, privileges in tables.items())
        for service, tables in granted.items()))
    return 0


async def run_broker_definitions(args: argparse.Namespace, ctx: Context) -> int:
    passwords = {}
    for service in BROKER_SERVICES:
        variable = args.password_env + service.upper().replace("-", "_")
        if not os.environ.get(variable):
            print(f"monitorctl: {variable} is not set (the broker password of {service})")
            return 2
        passwords[service] = os.environ[variable]
    # The document only: it holds password hashes, so it goes to stdout for the operator to import.
    print(json.dumps(definitions(args.mq_prefix, passwords, user_prefix=args.prefix, vhost=args.vhost), indent=2))
    return 0
