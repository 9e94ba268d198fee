"""Targeted delivery of dispatch events: each hub receives only the events of the clients it holds.

A hub's queue is bound once, to `hub.<its word>.#`. The outbox relay, when it publishes a dispatch event
(`monitor.<lane>.<client>`, `publish.<client>`), reads the client's presence (`desktop_clients.connected_hub`,
written by the hub's online statement) and publishes it as `hub.<word>.<original key>`. One binding per hub
instead of one per client (a binding costs the broker a Mnesia write: ~800 a second measured here), and one
copy of each event instead of one per hub replica.

Why the presence is read when the event is published, not when it is written: the event's transaction has
committed by then, so a client that attaches to a hub after the read gets that task in its replay (the replay
reads after the client's online write committed, which is after the read, which is after the task's commit),
and a client that attached before the read is routed to. A client that moves between hubs misses nothing;
an event routed to the hub it left is dropped there. A client with no presence yet keeps the original key,
which no hub binds (dropped by the broker; the replay on its first connect covers it).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from libs.db.pool import Conn

HUB_KEY_PREFIX = "hub"
_NOT_A_WORD = str.maketrans({".": "_", "*": "_", "#": "_"})

# The connected hub of each (client, tenant) of a batch of dispatch events; absent: no hub has held the client.
CLIENT_HUBS = """
SELECT c.id, c.connected_hub
FROM unnest(%(ids)s::uuid[], %(tenant_ids)s::bigint[]) AS e(id, tenant_id)
JOIN desktop_clients c ON c.id = e.id AND c.tenant_id = e.tenant_id
WHERE c.connected_hub IS NOT NULL
"""


def hub_word(hub_id: str) -> str:
    """A hub instance id as one routing-key word (no dots, no wildcards)."""
    return hub_id.translate(_NOT_A_WORD) or "_"


def hub_binding(hub_id: str) -> str:
    """The one binding of a hub's queue on the dispatch exchange."""
    return f"{HUB_KEY_PREFIX}.{hub_word(hub_id)}.#"


def hub_routing_key(hub_id: str, routing_key: str) -> str:
    """A dispatch event's key as published towards the hub that holds its client."""
    return f"{HUB_KEY_PREFIX}.{hub_word(hub_id)}.{routing_key}"


def client_of_dispatch_key(routing_key: str) -> uuid.UUID | None:
    """`monitor.high.<uuid>` / `publish.<uuid>` / `hub.<word>.monitor.control.<uuid>` -> the client id."""
    _, _, tail = routing_key.rpartition(".")
    try:
        return uuid.UUID(tail)
    except ValueError:
        return None


class RoutableEvent(Protocol):
    @property
    def exchange(self) -> str: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def tenant_id(self) -> int | None: ...


def clients_to_resolve(events: Sequence[RoutableEvent], dispatch_exchange: str) -> dict[uuid.UUID, int]:
    """The (client -> tenant) pairs whose presence routes some of `events` (dispatch events with a client key)."""
    wanted: dict[uuid.UUID, int] = {}
    for event in events:
        if event.exchange != dispatch_exchange or event.tenant_id is None:
            continue
        client = client_of_dispatch_key(event.routing_key)
        if client is not None:
            wanted[client] = int(event.tenant_id)
    return wanted


def routed_key(event: RoutableEvent, dispatch_exchange: str, hubs: dict[uuid.UUID, str]) -> str:
    """The key `event` is published with: towards its client's hub when it has one, else unchanged."""
    if event.exchange != dispatch_exchange:
        return event.routing_key
    client = client_of_dispatch_key(event.routing_key)
    hub = hubs.get(client) if client is not None else None
    return event.routing_key if hub is None else hub_routing_key(hub, event.routing_key)


async def read_client_hubs(conn: Conn, wanted: dict[uuid.UUID, int]) -> dict[uuid.UUID, str]:
    """The connected hub of each wanted client (one statement)."""
    if not wanted:
        return {}
    cur = await conn.execute(CLIENT_HUBS, {"ids": list(wanted), "tenant_ids": list(wanted.values())})
    rows: list[dict[str, Any]] = await cur.fetchall()
    return {row["id"]: str(row["connected_hub"]) for row in rows}
