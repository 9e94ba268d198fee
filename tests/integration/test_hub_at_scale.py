"""dispatch-hub at scale on real Postgres and RabbitMQ: sockets that connect together share batched statements yet
each gets its own hello, replay, events and `client.online`, and goes offline with its own `client.offline`; every
hub's queue takes every client's events and forwards only its own sockets'; a client's liveness is written at
most once per refresh interval, and a sign of life in between is written later, not lost."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiohttp
import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import TaskAvailable
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.mq.topology import Topology
from services.dispatch_hub.gateway import Gateway
from services.dispatch_hub.heartbeats import HeartbeatWriter
from services.dispatch_hub.http_api import GATEWAY
from tests.support.desktop import dispatch_execution, running_hub
from tests.support.hub_routing import routed
from tests.support.wait import eventually

Json = dict[str, Any]
CLIENTS_PER_TENANT = 8


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> Json:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=3, brands=1, questions=4, clients=CLIENTS_PER_TENANT, due=False)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def clients(seed: Json) -> list[tuple[Json, str, str]]:
    return [(t, c["client_id"], c["token"]) for t in seed["tenants"] for c in t["clients"]]


async def connect(http: aiohttp.ClientSession, hub: TestServer, token: str) -> aiohttp.ClientWebSocketResponse:
    return await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers={"Authorization": f"Bearer {token}"})


async def receive(ws: aiohttp.ClientWebSocketResponse) -> Json:
    event: Json = msgspec.json.decode((await ws.receive(timeout=10)).data)
    return event


async def publish(amqp: AbstractRobustConnection, topology: Topology, pool: AsyncConnectionPool[Conn],
                  events: dict[str, TaskAvailable]) -> None:
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(topology.dispatch_exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    for key, event in events.items():
        await exchange.publish(aio_pika.Message(msgspec.json.encode(event)), routing_key=await routed(pool, key))
    await channel.close()


def available(client: str) -> TaskAvailable:
    return TaskAvailable(kind="monitor", task_id=uuid.uuid4(), target_client_id=uuid.UUID(client), priority=5000,
                         lane="high", updated_at=datetime.now(UTC))


async def lifecycle_counts(pool: AsyncConnectionPool[Conn], event: str) -> dict[str, int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT convert_from(payload, 'UTF8')::jsonb->>'client_id' AS client, count(*) AS n "
                                 "FROM outbox WHERE routing_key = %s GROUP BY 1", (event,))
        return {r["client"]: int(r["n"]) for r in await cur.fetchall()}


async def test_clients_connecting_together_each_get_their_own_hello_replay_events_and_lifecycle(
        settings: Settings, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: Json,
        amqp: AbstractRobustConnection, topology: Topology) -> None:
    fleet = clients(seed)
    queued: dict[str, uuid.UUID] = {}
    async with pool.connection() as conn:
        for n, (tenant, client, _) in enumerate(fleet):
            i = n % CLIENTS_PER_TENANT  # a different question x platform for each client of a tenant
            task = await dispatch_execution(conn, tenant=tenant, client_id=client, question_index=i % 4,
                                            platform_id=seed["platforms"][i // 4]["ai_platform_id"])
            queued[client] = task["task_id"]
    async with running_hub(settings) as hub:
        gateway: Gateway = hub.app[GATEWAY]
        sockets = await asyncio.gather(*(connect(http, hub, token) for _, _, token in fleet))
        for ws, (_, client, _) in zip(sockets, fleet, strict=True):
            hello = await receive(ws)
            assert (hello["type"], hello["client_id"], hello["replayed_available"]) == ("hello", client, 1)
            replayed = await receive(ws)
            assert (replayed["type"], replayed["task_id"]) == ("task_available", str(queued[client]))
        assert gateway.attaching.largest > 1, "the handshakes shared a batch"

        # One event per client, each on its own socket only.
        events = {f"monitor.high.{client}": available(client) for _, client, _ in fleet}
        await publish(amqp, topology, pool, events)
        for ws, (_, client, _) in zip(sockets, fleet, strict=True):
            assert (await receive(ws))["task_id"] == str(events[f"monitor.high.{client}"].task_id)

        async with pool.connection() as conn:
            cur = await conn.execute("SELECT count(*) AS n FROM desktop_clients WHERE id = ANY(%s) AND online "
                                     "AND connected_hub = %s", ([c for _, c, _ in fleet], gateway.hub_id))
            assert (await cur.fetchone()) == {"n": len(fleet)}
        assert await lifecycle_counts(pool, "client.online") == {client: 1 for _, client, _ in fleet}

        await asyncio.gather(*(ws.close() for ws in sockets))

        async def all_offline() -> dict[str, int] | None:
            counts = await lifecycle_counts(pool, "client.offline")
            return counts if len(counts) == len(fleet) else None

        assert await eventually(all_offline, message="every client marked offline") == {
            client: 1 for _, client, _ in fleet}
        assert gateway.detaching.calls < len(fleet), "the disconnects shared a batch"


async def test_each_hub_receives_only_the_events_of_the_clients_it_holds(
        settings: Settings, http: aiohttp.ClientSession, seed: Json, amqp: AbstractRobustConnection,
        topology: Topology, pool: AsyncConnectionPool[Conn]) -> None:
    (_, here, here_token), (_, there, there_token), (_, nowhere, _) = clients(seed)[:3]
    async with running_hub(settings) as hub_a, running_hub(settings) as hub_b:
        ws_a, ws_b = await connect(http, hub_a, here_token), await connect(http, hub_b, there_token)
        for ws in (ws_a, ws_b):
            hello = await receive(ws)
            for _ in range(hello["replayed_available"] + hello["replayed_controls"]):
                await receive(ws)
        events = {f"monitor.high.{here}": available(here), f"monitor.control.{there}": available(there),
                  f"publish.{nowhere}": available(nowhere)}
        await publish(amqp, topology, pool, events)
        assert (await receive(ws_a))["task_id"] == str(events[f"monitor.high.{here}"].task_id)
        assert (await receive(ws_b))["task_id"] == str(events[f"monitor.control.{there}"].task_id)
        gateway_a, gateway_b = hub_a.app[GATEWAY], hub_b.app[GATEWAY]
        # Neither hub took the other's event, nor the one of the client no hub holds.
        assert (gateway_a.received, gateway_b.received) == (1, 1)
        assert (gateway_a.for_other_hubs, gateway_b.for_other_hubs) == (0, 0)
        await ws_a.close()
        await ws_b.close()


async def test_a_client_moving_to_another_hub_misses_nothing(
        settings: Settings, http: aiohttp.ClientSession, seed: Json, amqp: AbstractRobustConnection,
        topology: Topology, pool: AsyncConnectionPool[Conn]) -> None:
    """The event of a task dispatched while the client moves is routed to the hub it left (dropped there): the
    replay on the new hub carries the task, and the next event goes to the new hub."""
    tenant, client, token = clients(seed)[0]
    platform = seed["platforms"][0]["ai_platform_id"]
    async with running_hub(settings) as hub_a, running_hub(settings) as hub_b:
        ws = await connect(http, hub_a, token)
        hello = await receive(ws)
        assert hello["hub_instance"] == hub_a.app[GATEWAY].hub_id
        for _ in range(hello["replayed_available"] + hello["replayed_controls"]):
            await receive(ws)
        await ws.close()
        async with pool.connection() as conn:
            missed = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                              lane="high", generation=1)
        gone = available(client)
        await publish(amqp, topology, pool, {f"monitor.high.{client}": gone})
        await eventually(lambda: hub_a.app[GATEWAY].for_other_hubs == 1,
                         message="the hub the client left took the event and dropped it")
        ws = await connect(http, hub_b, token)
        hello = await receive(ws)
        assert hello["hub_instance"] == hub_b.app[GATEWAY].hub_id
        replay = [await receive(ws) for _ in range(hello["replayed_available"] + hello["replayed_controls"])]
        assert str(missed["task_id"]) in [e.get("task_id") for e in replay]
        later = available(client)
        await publish(amqp, topology, pool, {f"monitor.high.{client}": later})
        assert (await receive(ws))["task_id"] == str(later.task_id)
        assert hub_a.app[GATEWAY].received == 1 and hub_b.app[GATEWAY].received == 1
        await ws.close()


async def test_liveness_is_written_at_most_once_per_refresh_and_a_beat_in_between_is_not_lost(
        pool: AsyncConnectionPool[Conn], seed: Json) -> None:
    _, client, _ = clients(seed)[0]
    client_id = uuid.UUID(client)
    writer = HeartbeatWriter(pool, hub="hub-refresh", interval_s=1.0, is_connected=lambda _: True, refresh_s=0.5)

    async def last_heartbeat() -> Any:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT last_heartbeat_at, online FROM desktop_clients WHERE id = %s", (client,))
            return await cur.fetchone()

    writer.touch(client_id)
    assert await writer.flush() == 1
    first = await last_heartbeat()
    assert first["online"] is True
    # The reconciler marks it offline meanwhile; a new sign of life within the refresh interval waits ...
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET online = false WHERE id = %s", (client,))
    writer.touch(client_id)
    assert await writer.flush() == 0
    assert (await last_heartbeat())["last_heartbeat_at"] == first["last_heartbeat_at"]

    # ... and is written by a later flush without being repeated, reviving the client with one `client.online`.
    async def written() -> bool:
        return await writer.flush() == 1

    await eventually(written, timeout=5, message="the deferred heartbeat written")
    later = await last_heartbeat()
    assert later["last_heartbeat_at"] > first["last_heartbeat_at"] and later["online"] is True
    assert await lifecycle_counts(pool, "client.online") == {client: 2}  # each time it came (back) online
    assert await writer.flush() == 0  # nothing left over
