"""WebSocket RED of the dispatch-hub on real Postgres and RabbitMQ (services/dispatch_hub/connections.py): the
delivery latency of dispatch events (arrival at the hub's consumer to the frame on the socket, live events only),
the upgrade-to-hello latency, and abnormal closes by close code (a dropped connection, a client's odd code, a silent
client the hub closes), while normal and deliberate closes count nothing."""

from __future__ import annotations

import asyncio
import base64
import os
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
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import TaskAvailable
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.mq.topology import Topology
from libs.telemetry import metrics
from tests.support.desktop import dispatch_execution, running_hub
from tests.support.hub_routing import routed
from tests.support.wait import eventually


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=1, brands=1, questions=2, clients=1, due=False)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def _closes() -> dict[str, float]:
    return {code: metrics.desktop_ws_abnormal_closes_total.value(code=code)
            for code in ("1006", "4408", "other", "1000", "4409")}


def _connections() -> float:
    return _sample("desktop_websocket_connections")


async def _connect(http: aiohttp.ClientSession, hub: TestServer, token: str) -> aiohttp.ClientWebSocketResponse:
    return await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers={"Authorization": f"Bearer {token}"},
                                 autoping=False)


async def _receive(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    msg = await ws.receive(timeout=5)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    event: dict[str, Any] = msgspec.json.decode(msg.data)
    return event


async def _publish(amqp: AbstractRobustConnection, topology: Topology, pool: AsyncConnectionPool[Conn],
                   client: str) -> None:
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(topology.dispatch_exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    event = TaskAvailable(kind="monitor", task_id=uuid.uuid4(), target_client_id=uuid.UUID(client), priority=5000,
                          lane="high", interrupt_generation=1, updated_at=datetime.now(UTC))
    await exchange.publish(aio_pika.Message(msgspec.json.encode(event)),
                           routing_key=await routed(pool, f"monitor.high.{client}"))
    await channel.close()


async def test_live_events_are_timed_from_the_hubs_consumer_to_the_socket_and_the_hello_from_the_upgrade(
        settings: Settings, amqp: AbstractRobustConnection, topology: Topology, http: aiohttp.ClientSession,
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    async with pool.connection() as conn:  # one queued execution: replayed on connect, not a live delivery
        await dispatch_execution(conn, tenant=tenant, platform_id=seed["platforms"][0]["ai_platform_id"],
                                 client_id=client)
    delivered, delivered_s = _sample("desktop_ws_delivery_seconds_count"), _sample("desktop_ws_delivery_seconds_sum")
    hellos = _sample("desktop_ws_hello_seconds_count")
    async with running_hub(settings, heartbeat_timeout_seconds=30) as hub:
        ws = await _connect(http, hub, token)
        assert (await _receive(ws))["type"] == "hello"
        assert (await _receive(ws))["type"] == "task_available"  # the replay
        await eventually(lambda: _sample("desktop_ws_hello_seconds_count") == hellos + 1, message="hello timed")
        assert 0 < _sample("desktop_ws_hello_seconds_sum") < 60
        assert _sample("desktop_ws_delivery_seconds_count") == delivered, "hello and replay are no live delivery"

        for _ in range(3):
            await _publish(amqp, topology, pool, client)
            assert (await _receive(ws))["type"] == "task_available"
        await eventually(lambda: _sample("desktop_ws_delivery_seconds_count") == delivered + 3,
                         message="every live event timed once")
        assert 0 < _sample("desktop_ws_delivery_seconds_sum") - delivered_s < 15
        await ws.send_str('{"type": "heartbeat"}')
        assert (await _receive(ws))["type"] == "heartbeat_ack"
        await ws.close()
        await eventually(lambda: _connections() == 0, message="socket detached")
    assert _sample("desktop_ws_delivery_seconds_count") == delivered + 3, "an ack is no delivery"
    assert _sample("desktop_ws_hello_seconds_count") == hellos + 1


async def _drop(hub: TestServer, token: str) -> None:
    """A client that upgrades, reads its hello and vanishes without a close frame (a TCP reset)."""
    reader, writer = await asyncio.open_connection(hub.host, hub.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /api/desktop/ws HTTP/1.1\r\nHost: {hub.host}:{hub.port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                  f"Authorization: Bearer {token}\r\n\r\n").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 101"), head
    assert b"hello" in await asyncio.wait_for(reader.read(4096), 5)
    writer.transport.abort()


async def test_abnormal_closes_are_counted_by_code_and_normal_or_deliberate_ones_are_not(
        settings: Settings, http: aiohttp.ClientSession, seed: dict[str, Any]) -> None:
    token = seed["tenants"][0]["clients"][0]["token"]
    async with running_hub(settings, heartbeat_timeout_seconds=30, hub_max_sockets_per_client=1) as hub:
        before = _closes()
        # Normal: the client closes (1000).
        ws = await _connect(http, hub, token)
        assert (await _receive(ws))["type"] == "hello"
        await ws.close()
        await eventually(lambda: _connections() == 0, message="closed socket detached")
        # Deliberate: a newer socket of the client replaces the older one (4409).
        old = await _connect(http, hub, token)
        assert (await _receive(old))["type"] == "hello"
        new = await _connect(http, hub, token)
        assert (await _receive(new))["type"] == "hello"
        replaced = await old.receive(timeout=5)
        assert (replaced.type, replaced.data) == (aiohttp.WSMsgType.CLOSE, 4409)
        await eventually(lambda: _connections() == 1, message="replaced socket detached")
        assert _closes() == before
        # A client's own code outside the known ones: "other".
        await new.close(code=4000)
        await eventually(lambda: _connections() == 0, message="socket detached")
        assert _closes() == {**before, "other": before["other"] + 1}
        # Dropped without a close frame: 1006.
        await _drop(hub, token)
        await eventually(lambda: _closes()["1006"] == before["1006"] + 1, message="dropped socket counted")
        await eventually(lambda: _connections() == 0, message="dropped socket detached")
        assert _closes() == {**before, "other": before["other"] + 1, "1006": before["1006"] + 1}


async def test_a_silent_client_closed_by_the_hub_counts_as_a_heartbeat_timeout(
        settings: Settings, http: aiohttp.ClientSession, seed: dict[str, Any]) -> None:
    token = seed["tenants"][0]["clients"][0]["token"]
    async with running_hub(settings, hub_ping_interval_s=1.0, heartbeat_timeout_seconds=2) as hub:
        before = _closes()
        ws = await _connect(http, hub, token)  # autoping off: it answers no ping, sends nothing
        assert (await _receive(ws))["type"] == "hello"
        closed = await ws.receive(timeout=15)
        while closed.type == aiohttp.WSMsgType.PING:  # unanswered
            closed = await ws.receive(timeout=15)
        assert (closed.type, closed.data) == (aiohttp.WSMsgType.CLOSE, 4408)
        await eventually(lambda: _closes()["4408"] == before["4408"] + 1, timeout=15, message="timeout counted")
        assert _closes() == {**before, "4408": before["4408"] + 1}
