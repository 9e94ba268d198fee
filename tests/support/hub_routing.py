"""Publishing a dispatch event straight to the broker as the outbox relay would: towards the hub that holds its
client (libs/mq/hub_routing.py), read from the client's presence."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.mq import hub_routing
from libs.mq.topology import DISPATCH


class _Event:
    def __init__(self, routing_key: str, tenant_id: int) -> None:
        self.exchange, self.routing_key, self.tenant_id = DISPATCH, routing_key, tenant_id


async def routed(pool: AsyncConnectionPool[Conn], routing_key: str) -> str:
    """`routing_key` (`monitor.high.<client>`, ...) as the relay would publish it now."""
    client = hub_routing.client_of_dispatch_key(routing_key)
    assert client is not None, routing_key
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT tenant_id FROM desktop_clients WHERE id = %s", (client,))
        row = await cur.fetchone()
        if row is None:
            return routing_key
        event = _Event(routing_key, int(row["tenant_id"]))
        hubs = await hub_routing.read_client_hubs(conn, hub_routing.clients_to_resolve([event], DISPATCH))
    return hub_routing.routed_key(event, DISPATCH, hubs)


def logical_key(routing_key: str) -> str:
    """A dispatch event's key as its writer wrote it (`hub.<hub>.monitor.high.<client>` -> `monitor.high.<client>`)."""
    if routing_key.startswith(f"{hub_routing.HUB_KEY_PREFIX}."):
        return routing_key.split(".", 2)[2]
    return routing_key
