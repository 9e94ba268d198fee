"""A RabbitMQ user per service, with configure / write / read permissions limited to the exchanges and queues it
declares, publishes to and consumes from (docs/security.md "Least privilege").

RabbitMQ checks: `configure` to declare or delete a queue or exchange, `write` on an exchange to publish to it and
on a queue to bind it, `read` on a queue to consume and on an exchange to bind a queue to it; declaring a queue
with a dead-letter exchange takes write on that exchange and read on the queue. Every service declares
the five exchanges at start-up (libs.mq.topology.declare_exchanges, idempotent), so each may configure those; the
queues it may configure, the exchanges it may publish to and the queues it may read are its own only: the hub may
publish results but no dispatch, lifecycle or projection event; the pump may publish outbox events but no results;
collect-now-api has no broker user at all.

`definitions(prefix, passwords)` is a RabbitMQ definitions document (users with salted SHA-256 password hashes,
permissions): import it with `rabbitmqctl import_definitions FILE`, `rabbitmqadmin import FILE` or
`POST /api/definitions`; an import merges, it removes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Any

from libs.mq.topology import DISPATCH, DLX, LIFECYCLE, LOGICAL_EXCHANGES, PROJECTION, RESULT

NOTHING = "^$"


@dataclass(frozen=True, slots=True)
class Permission:
    configure: str
    write: str
    read: str


def _any(prefix: str, *names: str) -> str:
    """An anchored regex matching exactly `prefix + name` for each name; a name ending in `*` matches any tail."""
    parts = [re.escape(name[:-1]) + ".+" if name.endswith("*") else re.escape(name) for name in names]
    return f"^{re.escape(prefix)}(?:{'|'.join(parts)})$" if parts else NOTHING


_EXCHANGES = (*LOGICAL_EXCHANGES, DLX)
_INGEST = ("monitor.result.ingest.shard.*", "monitor.result.ingest.dlq", "monitor.result.ingest.dlq.tally")
_HUB = ("desktop.task.dispatch.hub.*", "desktop.task.dispatch.dlq")
_PROJECTION = ("monitor.projection.rebuild", "monitor.projection.rebuild.dlq")


def _lifecycle(consumer: str) -> tuple[str, str]:
    return f"monitor.lifecycle.{consumer}", f"monitor.lifecycle.{consumer}.dlq"


# Per service: (queues it declares and binds, exchanges it publishes to, exchanges its queues bind to, queues it
# consumes).
_USES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "outbox-pump": ((), (DISPATCH, PROJECTION, LIFECYCLE), (), ()),
    "dispatch-coordinator": (_lifecycle("coordinator"), (DISPATCH, DLX), (LIFECYCLE, DLX),
                             (_lifecycle("coordinator")[0],)),
    "reconciler": (_lifecycle("reconciler"), (DLX,), (LIFECYCLE, DLX), (_lifecycle("reconciler")[0],)),
    # The hub declares the shard queues too, so that a result published before ingest ever started is kept.
    "dispatch-hub": ((*_INGEST, *_HUB), (RESULT,), (RESULT, DISPATCH, DLX), ("desktop.task.dispatch.hub.*",)),
    "ingest-shard-workers": (_INGEST, (DLX,), (RESULT, DLX),
                             ("monitor.result.ingest.shard.*", "monitor.result.ingest.dlq.tally")),
    "projection-worker": (_PROJECTION, (DLX,), (PROJECTION, DLX), ("monitor.projection.rebuild",)),
}
BROKER_SERVICES = tuple(_USES)


def permissions(prefix: str) -> dict[str, Permission]:
    out = {}
    for service, (queues, publishes, binds_to, consumes) in _USES.items():
        # Declaring a queue with a dead-letter exchange takes write on that exchange and read on the queue.
        dlx = (DLX,) if queues else ()
        out[service] = Permission(configure=_any(prefix, *_EXCHANGES, *queues),
                                  write=_any(prefix, *dict.fromkeys((*publishes, *dlx, *queues))),
                                  read=_any(prefix, *dict.fromkeys((*binds_to, *consumes, *queues))))
    return out


def user_name(prefix: str, service: str) -> str:
    if service not in _USES:
        raise ValueError(f"{service!r} has no broker user; one of {', '.join(BROKER_SERVICES)}")
    return f"{prefix}{service}"


def password_hash(password: str, *, salt: bytes | None = None) -> str:
    """RabbitMQ's `rabbit_password_hashing_sha256`: base64(salt + sha256(salt + password)), 4 bytes of salt."""
    salt = secrets.token_bytes(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def definitions(mq_prefix: str, passwords: dict[str, str], *, user_prefix: str = "",
                vhost: str = "/") -> dict[str, Any]:
    """Users `<user_prefix><service>` (no tags: no management access) and their permissions on `vhost` over the
    topology named with `mq_prefix` (the services' MQ_PREFIX), for the services in `passwords`."""
    perms = permissions(mq_prefix)
    users, grants = [], []
    for service, password in passwords.items():
        name = user_name(user_prefix, service)
        users.append({"name": name, "password_hash": password_hash(password),
                      "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []})
        p = perms[service]
        grants.append({"user": name, "vhost": vhost, "configure": p.configure, "write": p.write, "read": p.read})
    return {"users": users, "permissions": grants}
