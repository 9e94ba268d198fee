"""dispatch-hub WebSocket on real Postgres and RabbitMQ: hello + replay, per-client forwarding,
bindings per connected client, heartbeats, malformed messages, online/offline, the drain on shutdown."""

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
from libs.contracts.wire import HUB_DRAINING_CLOSE, TaskAvailable, TaskControl, reconnect_delay_ms
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.mq.topology import Topology
from libs.telemetry import metrics
from services.dispatch_hub.http_api import GATEWAY
from tests.support.desktop import dispatch_execution, request_interrupt, running_hub
from tests.support.hub_routing import routed
from tests.support.wait import eventually


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=2, brands=1, questions=4, clients=1, due=False)


@pytest.fixture
async def hub(settings: Settings, amqp: AbstractRobustConnection) -> AsyncIterator[TestServer]:
    async with running_hub(settings, heartbeat_timeout_seconds=30) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def connect(http: aiohttp.ClientSession, hub: TestServer, token: str) -> aiohttp.ClientWebSocketResponse:
    return await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers={"Authorization": f"Bearer {token}"})


async def receive(ws: aiohttp.ClientWebSocketResponse, timeout: float = 5.0) -> dict[str, Any]:
    msg = await ws.receive(timeout=timeout)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    event: dict[str, Any] = msgspec.json.decode(msg.data)
    return event


async def publish(amqp: AbstractRobustConnection, topology: Topology, pool: AsyncConnectionPool[Conn],
                  routing_key: str, message: msgspec.Struct) -> None:
    """As the outbox relay publishes it: towards the hub that holds the client (none: no hub gets it)."""
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(topology.dispatch_exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    await exchange.publish(aio_pika.Message(msgspec.json.encode(message)), routing_key=await routed(pool, routing_key))
    await channel.close()


def available(client: str, lane: str = "high") -> TaskAvailable:
    return TaskAvailable(kind="monitor", task_id=uuid.uuid4(), target_client_id=uuid.UUID(client), priority=5000,
                         lane=lane, interrupt_generation=1, updated_at=datetime.now(UTC))  # type: ignore[arg-type]


async def client_row(pool: AsyncConnectionPool[Conn], client: str) -> dict[str, Any]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT online, connected_hub, last_heartbeat_at, platform_health "
                                 "FROM desktop_clients WHERE id = %s", (client,))
        row = await cur.fetchone()
    assert row is not None
    return row


async def test_hello_then_replay_in_lane_order_then_live_events(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
        amqp: AbstractRobustConnection, topology: Topology) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    platform = seed["platforms"][0]["ai_platform_id"]
    async with pool.connection() as conn:
        normal = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, age_s=60)
        running = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                           question_index=1)
        await conn.execute("UPDATE desktop_tasks SET status = 'in_progress' WHERE id = %s", (running["task_id"],))
        await request_interrupt(conn, task_id=running["task_id"], generation=4)
        high = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, lane="high",
                                        question_index=2, generation=4)
    ws = await connect(http, hub, token)
    hello = await receive(ws)
    assert hello["type"] == "hello" and hello["client_id"] == client and hello["replayed_available"] == 2
    assert hello["replayed_controls"] == 1
    replay = [await receive(ws) for _ in range(3)]
    assert [(e["type"], e["task_id"]) for e in replay] == [
        ("task_available", str(high["task_id"])), ("task_available", str(normal["task_id"])),
        ("task_control", str(running["task_id"]))]
    assert replay[0]["interrupt_generation"] == 4 and replay[0]["lane"] == "high"
    control = msgspec.json.decode(msgspec.json.encode(replay[2]), type=TaskControl)
    assert control.control == "interrupt_requested" and control.interrupt_generation == 4
    assert (await client_row(pool, client))["online"] is True

    # Live: an event for this client arrives unchanged; one for another client does not.
    other = seed["tenants"][1]["clients"][0]["client_id"]
    await publish(amqp, topology, pool, f"monitor.high.{other}", available(other))
    event = available(client)
    await publish(amqp, topology, pool, f"monitor.high.{client}", event)
    live = await receive(ws)
    assert live == msgspec.json.decode(msgspec.json.encode(event))
    await ws.close()


async def test_reconnect_replays_what_was_published_while_away(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
        amqp: AbstractRobustConnection, topology: Topology) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    platform = seed["platforms"][0]["ai_platform_id"]
    ws = await connect(http, hub, token)
    assert (await receive(ws))["type"] == "hello"
    await ws.close()

    async def offline() -> bool:
        return (await client_row(pool, client))["online"] is False

    await eventually(offline, message="client marked offline after its last socket closed")
    # While away: the coordinator dispatches (its broker event finds no binding and is dropped).
    async with pool.connection() as conn:
        missed = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, lane="high",
                                          generation=2)
    await publish(amqp, topology, pool, f"monitor.high.{client}", available(client))
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT routing_key FROM outbox WHERE routing_key LIKE 'client.%%' ORDER BY id")
        assert [r["routing_key"] for r in await cur.fetchall()] == ["client.online", "client.offline"]
    ws = await connect(http, hub, token)
    hello = await receive(ws)
    assert hello["replayed_available"] == 1
    replayed = await receive(ws)
    assert replayed["type"] == "task_available" and replayed["task_id"] == str(missed["task_id"])
    await ws.close()


async def test_two_sockets_of_one_client_share_a_binding(
        hub: TestServer, http: aiohttp.ClientSession, seed: dict[str, Any], amqp: AbstractRobustConnection,
        topology: Topology, pool: AsyncConnectionPool[Conn]) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    before = _gauge()
    first, second = await connect(http, hub, token), await connect(http, hub, token)
    for ws in (first, second):
        assert (await receive(ws))["type"] == "hello"
    assert _gauge() == before + 2
    await first.close()
    # The binding stays while one socket is left, and the client stays online.
    event = available(client)
    await publish(amqp, topology, pool, f"monitor.control.{client}", event)
    assert (await receive(second))["task_id"] == str(event.task_id)
    assert (await client_row(pool, client))["online"] is True
    await second.close()

    async def both_gone() -> bool:
        return _gauge() == before

    await eventually(both_gone, message="desktop_websocket_connections back to its value")


def _gauge() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("desktop_websocket_connections") or 0.0


async def test_heartbeats_malformed_messages_and_pings(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    ws = await connect(http, hub, token)
    assert (await receive(ws))["type"] == "hello"
    connected_at = (await client_row(pool, client))["last_heartbeat_at"]
    cases = [
        (b"not json", "invalid_json", None),
        (b'{"type": "dance"}', "unknown_type", "type"),
        (b'{"sent_at": "2026-01-01T00:00:00Z"}', "missing_field", "type"),
        (b'{"type": "heartbeat", "local_queue_depth": -3}', "invalid_field", "local_queue_depth"),
    ]
    for raw, code, field in cases:
        await ws.send_str(raw.decode())
        error = await receive(ws)
        assert (error["type"], error["error"], error.get("field")) == ("error", code, field), raw
    await ws.send_bytes(b"\x00")
    assert (await receive(ws))["type"] == "error"
    await ws.send_str('{"type": "heartbeat", "platform_health": {"openai": "login_required"}}')
    assert (await receive(ws))["type"] == "heartbeat_ack"
    await ws.ping(b"x")

    async def refreshed() -> dict[str, Any] | None:
        row = await client_row(pool, client)
        return row if row["last_heartbeat_at"] > connected_at and row["platform_health"] else None

    row = await eventually(refreshed, timeout=10, message="batched heartbeat write")
    assert row["platform_health"] == {"openai": "login_required"} and row["online"] is True
    await ws.close()


async def test_permessage_deflate_is_declined(hub: TestServer, http: aiohttp.ClientSession,
                                              seed: dict[str, Any]) -> None:
    """A client offering compression (as Node's `ws`, the TypeScript SDK's socket, does by default) gets a plain
    socket: no extension in the 101, uncompressed frames."""
    token = seed["tenants"][0]["clients"][0]["token"]
    ws = await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers={"Authorization": f"Bearer {token}"},
                               compress=15)
    assert ws.compress == 0
    assert (await receive(ws))["type"] == "hello"
    await ws.close()


async def test_handshakes_beyond_the_concurrency_wait_their_turn(
        settings: Settings, amqp: AbstractRobustConnection, http: aiohttp.ClientSession,
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    """HUB_HANDSHAKE_CONCURRENCY=1: while one client's attach is held (its row locked by another transaction), a
    second client's upgrade waits at the gate, counted in desktop_ws_handshakes_waiting, and goes through once the
    first is attached."""
    from prometheus_client import REGISTRY

    def waiting() -> float:
        return REGISTRY.get_sample_value("desktop_ws_handshakes_waiting") or 0.0

    first, second = (seed["tenants"][n]["clients"][0] for n in (0, 1))
    async with running_hub(settings, heartbeat_timeout_seconds=30, hub_handshake_concurrency=1) as hub, \
            pool.connection() as blocker:
        url = str(hub.make_url("/api/desktop/ws"))
        await blocker.execute("BEGIN")
        await blocker.execute("SELECT 1 FROM desktop_clients WHERE id = %s FOR UPDATE", (first["client_id"],))
        held = asyncio.create_task(http.ws_connect(url, headers={"Authorization": f"Bearer {first['token']}"}))
        await eventually(lambda: _attach_waits_for_lock(pool), message="the first attach waiting for its row")
        before = waiting()
        queued = asyncio.create_task(http.ws_connect(url, headers={"Authorization": f"Bearer {second['token']}"}))
        await eventually(lambda: waiting() == before + 1, message="the second upgrade waiting at the gate")
        assert not queued.done()
        await blocker.execute("ROLLBACK")
        sockets = await asyncio.wait_for(asyncio.gather(held, queued), 10)
        for ws in sockets:
            assert (await receive(ws))["type"] == "hello"
            await ws.close()
        assert waiting() == before


async def _attach_waits_for_lock(pool: AsyncConnectionPool[Conn]) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                 "AND datname = current_database()")
        row = await cur.fetchone()
    return row is not None and row["n"] > 0


async def test_unauthenticated_socket_is_refused(hub: TestServer, http: aiohttp.ClientSession) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers={"Authorization": "Bearer nope"})
    assert info.value.status == 401


async def test_shutdown_drains_sockets_with_a_reconnect_delay_and_writes_no_offline(
        settings: Settings, amqp: AbstractRobustConnection, http: aiohttp.ClientSession,
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    async with running_hub(settings, hub_drain_reconnect_spread_ms=3000) as hub:
        ws = await connect(http, hub, token)
        assert (await receive(ws))["type"] == "hello"
        closing = asyncio.create_task(ws.receive(timeout=10))
    msg = await closing
    assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == HUB_DRAINING_CLOSE
    delay = reconnect_delay_ms(msg.extra)
    assert delay is not None and 0 <= delay <= 3000, msg.extra
    # Told to reconnect elsewhere at once: no offline write and no client.offline for the leader (a client that
    # never comes back is marked offline by the reconciler at its heartbeat timeout); its socket rows are gone.
    assert (await client_row(pool, client))["online"] is True
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM outbox WHERE routing_key = 'client.offline'")
        assert (await cur.fetchone())["n"] == 0
        cur = await conn.execute("SELECT count(*) AS n FROM hub_sockets WHERE client_id = %s", (client,))
        assert (await cur.fetchone())["n"] == 0


async def test_one_clients_bad_platform_health_never_fails_another_clients_heartbeat(
        hub: TestServer, http: aiohttp.ClientSession, seed: dict[str, Any], pool: AsyncConnectionPool[Conn]) -> None:
    bad_tenant, good_tenant = seed["tenants"]
    bad, good = bad_tenant["clients"][0], good_tenant["clients"][0]
    bad_ws, good_ws = await connect(http, hub, bad["token"]), await connect(http, hub, good["token"])
    assert (await receive(bad_ws))["type"] == "hello" and (await receive(good_ws))["type"] == "hello"
    before = (await client_row(pool, good["client_id"]))["last_heartbeat_at"]
    cases = [
        ('{"type":"heartbeat","platform_health":{"openai":"ok\\u0000"}}', "invalid_field"),
        ('{"type":"heartbeat","platform_health":{"open\\u0000ai":"healthy"}}', "invalid_field"),
        ('{"type":"heartbeat","platform_health":{"openai":"sunny"}}', "invalid_field"),
        ('{"type":"heartbeat","platform_health":{"no-such-platform":"healthy"}}', "unknown_platform"),
        ('{"type":"heartbeat","platform_health":{' + ",".join(f'"p{i}":"healthy"' for i in range(51)) + "}}",
         "invalid_field"),
    ]
    for raw, code in cases:
        await bad_ws.send_str(raw)
        error = await receive(bad_ws)
        assert (error["type"], error["error"]) == ("error", code) and error["field"].startswith("platform_health"), raw
    await good_ws.send_str('{"type":"heartbeat","platform_health":{"openai":"healthy","gemini":"captcha"}}')
    assert (await receive(good_ws))["type"] == "heartbeat_ack"

    async def good_written() -> dict[str, Any] | None:
        row = await client_row(pool, good["client_id"])
        return row if row["last_heartbeat_at"] > before and row["platform_health"] else None

    row = await eventually(good_written, timeout=10, message="the good client's heartbeat and health written")
    assert row["platform_health"] == {"openai": "healthy", "gemini": "captcha"}
    assert (await client_row(pool, bad["client_id"]))["platform_health"] == {}
    # a later report replaces the stored one: gemini is no longer reported
    await good_ws.send_str('{"type":"heartbeat","platform_health":{"openai":"login_required"}}')
    assert (await receive(good_ws))["type"] == "heartbeat_ack"

    async def replaced() -> dict[str, Any] | None:
        row = await client_row(pool, good["client_id"])
        return row if row["platform_health"] == {"openai": "login_required"} else None

    await eventually(replaced, timeout=10, message="the report replaces, not merges")
    await bad_ws.close()
    await good_ws.close()


async def test_a_report_the_database_refuses_fails_only_its_own_client(
        settings: Settings, seed: dict[str, Any], pool: AsyncConnectionPool[Conn]) -> None:
    """Defence in depth below the contract: a NUL reaching the flush (a bug elsewhere) costs one report only."""
    from services.dispatch_hub.heartbeats import HeartbeatWriter

    bad, good = (uuid.UUID(t["clients"][0]["client_id"]) for t in seed["tenants"])
    writer = HeartbeatWriter(pool, hub="hub-test", interval_s=1.0, is_connected=lambda _: True)
    before = {c: (await client_row(pool, str(c)))["last_heartbeat_at"] for c in (bad, good)}
    writer.report_health(bad, {"openai": "ok\x00"})
    writer.report_health(good, {"openai": "healthy"})
    assert await writer.flush() == 2
    assert writer.health_rejected == 1
    rows = {c: await client_row(pool, str(c)) for c in (bad, good)}
    assert all(rows[c]["last_heartbeat_at"] is not None and rows[c]["last_heartbeat_at"] != before[c]
               for c in (bad, good))  # liveness of both written
    assert rows[good]["platform_health"] == {"openai": "healthy"} and rows[bad]["platform_health"] == {}


async def test_the_hub_takes_full_garbage_collections_over_unless_told_not_to(
        settings: Settings, amqp: AbstractRobustConnection) -> None:
    """HUB_GC_FULL_COLLECTION_S: while a hub runs, CPython's automatic full collections are out of reach (the hub runs
    its own when calm); 0 leaves them alone; stopped, the hub gives the thresholds back."""
    import gc

    from libs.gc_control import AUTOMATIC_FULL_THRESHOLD

    before = gc.get_threshold()
    assert before[2] != AUTOMATIC_FULL_THRESHOLD
    async with running_hub(settings, heartbeat_timeout_seconds=30):
        await eventually(lambda: gc.get_threshold()[2] == AUTOMATIC_FULL_THRESHOLD,
                         message="the hub's collection loop taking over")
    assert gc.get_threshold() == before
    async with running_hub(settings, heartbeat_timeout_seconds=30, hub_gc_full_collection_s=0) as hub, \
            aiohttp.ClientSession() as http:

        async def ready() -> bool:
            async with http.get(hub.make_url("/readyz")) as response:
                return response.status == 200

        await eventually(ready, message="the hub ready (its loops running)")
        assert gc.get_threshold() == before


async def test_a_hub_with_more_than_its_share_sheds_sockets_until_the_replicas_are_balanced(
        settings: Settings, amqp: AbstractRobustConnection, http: aiohttp.ClientSession,
        pool: AsyncConnectionPool[Conn]) -> None:
    """After a rolling restart the replica restarted first holds every client and nothing moves them (two hubs
    here, sixty clients all on the first). It sheds a socket or a few a sweep with 4503 while it holds more than its
    fair share plus the slack (1 + HUB_REBALANCE_SLACK times it, and at least 10 over: 40 of 60 here); their clients
    reconnect through the load balancer (here: to the other hub) until the first is within it, and then nothing more
    moves."""
    async with pool.connection() as conn:
        fleet = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=60, due=False)
    tokens = [c["token"] for c in fleet["tenants"][0]["clients"]]
    knobs: dict[str, Any] = {"hub_revocation_check_s": 0.2, "hub_rebalance_slack": 0.25,
                             "hub_drain_reconnect_spread_ms": 0, "hub_upgrade_burst_per_client": 50}
    moved: list[int] = []

    async def desktop(token: str, first: TestServer, other: TestServer) -> None:
        """A client behind a load balancer that sends a reconnect to the other hub."""
        hub = first
        while True:
            ws = await connect(http, hub, token)
            assert (await receive(ws))["type"] == "hello"
            while (msg := await ws.receive()).type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                pass
            assert msg.data == HUB_DRAINING_CLOSE and reconnect_delay_ms(msg.extra) == 0, (msg.data, msg.extra)
            moved.append(1)
            hub = other

    async with running_hub(settings, **knobs) as a, running_hub(settings, **knobs) as b:
        first, second = a.app[GATEWAY], b.app[GATEWAY]
        before = metrics.hub_rebalance_closes_total.value()
        desktops = [asyncio.create_task(desktop(token, a, b)) for token in tokens]
        try:
            await eventually(lambda: first.connection_count() + second.connection_count() == 60
                             and first.connection_count() <= 40, timeout=60,
                             message="the first hub within its share: at most 40 of the 60")
            shed, sweeps = first.rebalanced, first.sweeps
            await eventually(lambda: first.sweeps >= sweeps + 5 and second.sweeps >= 5,
                             message="five more sweeps of each")
            assert first.rebalanced == shed == len(moved) == 20, (shed, len(moved))
            assert (first.connection_count(), second.connection_count()) == (40, 20)
            assert second.rebalanced == 0 and first.fleet_sockets == 60
            assert metrics.hub_rebalance_closes_total.value() - before == shed
            assert not any(d.done() for d in desktops), [d.exception() for d in desktops if d.done()]
            # Moved, not gone: no offline write and no client.offline for the leader (as for a drain); every socket
            # row is the hub's that holds it now.
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT count(*) AS n FROM outbox WHERE routing_key = 'client.offline'")
                assert (await cur.fetchone())["n"] == 0
                cur = await conn.execute("SELECT hub_id, count(*) AS n FROM hub_sockets GROUP BY 1")
                assert {r["hub_id"]: r["n"] for r in await cur.fetchall()} == {first.hub_id: 40, second.hub_id: 20}
        finally:
            for d in desktops:
                d.cancel()
            await asyncio.gather(*desktops, return_exceptions=True)


async def test_behind_a_sticky_load_balancer_a_hub_stops_shedding_the_clients_that_keep_coming_back(
        settings: Settings, amqp: AbstractRobustConnection, http: aiohttp.ClientSession,
        pool: AsyncConnectionPool[Conn]) -> None:
    """A load balancer with session affinity sends every shed client back to the hub it left: shedding only churns.
    After 20 sheds that all came back (ShedReturns) the hub pauses rebalancing."""
    async with pool.connection() as conn:
        fleet = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=60, due=False)
    tokens = [c["token"] for c in fleet["tenants"][0]["clients"]]
    knobs: dict[str, Any] = {"hub_revocation_check_s": 0.2, "hub_rebalance_slack": 0.25,
                             "hub_drain_reconnect_spread_ms": 0, "hub_upgrade_burst_per_client": 50}

    async def pinned(token: str, hub: TestServer) -> None:
        while True:
            ws = await connect(http, hub, token)
            assert (await receive(ws))["type"] == "hello"
            while (await ws.receive()).type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                pass

    async with running_hub(settings, **knobs) as a, running_hub(settings, **knobs) as b:
        first, second = a.app[GATEWAY], b.app[GATEWAY]
        desktops = [asyncio.create_task(pinned(token, a)) for token in tokens]
        try:
            await eventually(lambda: first.shed_returns.paused_until > 0, timeout=60,
                             message="rebalancing paused on the hub its clients keep coming back to")
            shed, sweeps = first.rebalanced, first.sweeps
            await eventually(lambda: first.sweeps >= sweeps + 10, message="ten more sweeps")
            assert first.rebalanced == shed and 20 <= shed <= 22, shed
            assert first.connection_count() == 60 and second.connection_count() == 0
        finally:
            for d in desktops:
                d.cancel()
            await asyncio.gather(*desktops, return_exceptions=True)
