"""Dispatch batches on real Postgres and RabbitMQ: the outbox relay publishes one `dispatch_batch` per hub for a
batch of dispatch events (libs/outbox/dispatch_batches.py) and each hub hands every event to the right socket;
an event for a client that left the hub is dropped there as before; an unreadable envelope goes to the hub's DLQ
with its reason, and one unreadable item is refused alone while the envelope's other events are delivered
(services/dispatch_hub/envelope.py)."""

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
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import DISPATCH_BATCH
from libs.contracts.wire import TaskAvailable
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.mq.dead_letter import REASON_HEADER
from libs.mq.hub_routing import hub_routing_key, hub_word
from libs.mq.topology import DISPATCH, Topology
from libs.outbox import OutboxEvent, enqueue_many
from libs.outbox import dispatch_batches as batches
from libs.outbox.relay import AmqpPublisher, OutboxRelay, claim_own
from libs.telemetry import metrics
from services.dispatch_hub.gateway import Gateway
from services.dispatch_hub.http_api import GATEWAY
from tests.support.desktop import running_hub
from tests.support.wait import eventually

Json = dict[str, Any]


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> Json:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=2, brands=1, questions=1, clients=6, due=False)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _connect(http: aiohttp.ClientSession, hub: TestServer, token: str) -> aiohttp.ClientWebSocketResponse:
    ws = await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers={"Authorization": f"Bearer {token}"})
    hello = msgspec.json.decode((await ws.receive(timeout=10)).data)
    assert hello["type"] == "hello"
    for _ in range(hello["replayed_available"] + hello["replayed_controls"]):
        await ws.receive(timeout=10)
    return ws


async def _frames(ws: aiohttp.ClientWebSocketResponse, n: int) -> list[Json]:
    return [msgspec.json.decode((await ws.receive(timeout=10)).data) for _ in range(n)]


def _available(client: str) -> TaskAvailable:
    return TaskAvailable(kind="monitor", task_id=uuid.uuid4(), target_client_id=uuid.UUID(client), priority=100,
                         lane="normal", updated_at=datetime.now(UTC))


class _Raw:
    """Every broker message on the dispatch exchange towards any hub, as the broker carried it (not unwrapped)."""

    def __init__(self) -> None:
        self.messages: list[AbstractIncomingMessage] = []

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        self.messages.append(message)


async def _raw_capture(amqp: AbstractRobustConnection, topology: Topology) -> tuple[_Raw, aio_pika.abc.AbstractChannel]:
    channel = await amqp.channel()
    exchange = await channel.declare_exchange(topology.dispatch_exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True, auto_delete=True)
    await queue.bind(exchange, routing_key="hub.#")
    raw = _Raw()
    await queue.consume(raw.on_message, no_ack=True)
    return raw, channel


async def test_the_relay_publishes_one_message_per_hub_and_each_hub_fans_it_out_to_the_right_sockets(
        settings: Settings, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: Json,
        amqp: AbstractRobustConnection, topology: Topology) -> None:
    fleet = [(t, c["client_id"], c["token"]) for t in seed["tenants"] for c in t["clients"]]
    on_a, on_b, (moved, nowhere) = fleet[:6], fleet[6:10], (fleet[10], fleet[11])
    raw, channel = await _raw_capture(amqp, topology)
    publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="batch-relay-test")
    await publisher.start()
    try:
        async with running_hub(settings) as hub_a, running_hub(settings) as hub_b:
            gateway_a: Gateway = hub_a.app[GATEWAY]
            gateway_b: Gateway = hub_b.app[GATEWAY]
            sockets = {c: await _connect(http, hub_a, tok) for _, c, tok in on_a}
            sockets |= {c: await _connect(http, hub_b, tok) for _, c, tok in on_b}
            async with pool.connection() as conn:  # presence on hub a, but the client is not (or no longer) there
                await conn.execute("UPDATE desktop_clients SET connected_hub = %s WHERE id = %s",
                                   (gateway_a.hub_id, moved[1]))
            # Two events for one client of hub a (one ordering key: in order), one for every other client.
            events = [(c, _available(c)) for _, c, _ in [*on_a, *on_b, moved, nowhere]]
            events.insert(1, (on_a[0][1], _available(on_a[0][1])))
            received0 = gateway_a.received, gateway_b.received
            envelopes0 = metrics.hub_dispatch_batches_received_total.value()
            async with pool.connection() as conn:
                async with conn.transaction():
                    ids = await enqueue_many(conn, [OutboxEvent(
                        exchange=DISPATCH, routing_key=f"monitor.normal.{c}", message=e, ordering_key=f"client:{c}",
                        tenant_id=next(t["tenant_id"] for t, cid, _ in fleet if cid == c)) for c, e in events])
                    own = await claim_own(conn, ids, claimed_by="relay-under-test", lease_seconds=30)
                claimed = await own.events()
            relay = OutboxRelay(pool, publisher, claimed_by="relay-under-test")
            assert await relay.process(claimed) == len(events)

            # Each connected client gets its own events, in order, on its own socket only.
            for client, ws in sockets.items():
                mine = [str(e.task_id) for c, e in events if c == client]
                assert [f["task_id"] for f in await _frames(ws, len(mine))] == mine, client
            await eventually(lambda: gateway_a.received - received0[0] == 8, message="hub a took its 8 events")
            assert gateway_b.received - received0[1] == 4
            assert gateway_a.for_other_hubs >= 1, "the moved client's event was dropped at hub a"
            # Exactly one broker message per hub: an envelope each, on the hub's batch key.
            await eventually(lambda: len(raw.messages) >= 2, message="the envelopes")
            await asyncio.sleep(0)
            assert sorted((m.routing_key, m.type) for m in raw.messages) == sorted([
                (batches.batch_routing_key(hub_word(gateway_a.hub_id)), DISPATCH_BATCH),
                (batches.batch_routing_key(hub_word(gateway_b.hub_id)), DISPATCH_BATCH)])
            assert metrics.hub_dispatch_batches_received_total.value() - envelopes0 == 2
            for ws in sockets.values():
                await ws.close()
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT status, count(*) AS n FROM outbox WHERE exchange = %s GROUP BY 1",
                                     (DISPATCH,))
            assert {r["status"]: r["n"] for r in await cur.fetchall()} == {"published": len(events)}
    finally:
        await publisher.close()
        await channel.close()


async def _dead_letters(amqp: AbstractRobustConnection, topology: Topology, n: int) -> list[AbstractIncomingMessage]:
    channel = await amqp.channel()
    queue = await channel.get_queue(topology.hub_dlq, ensure=False)
    found: list[AbstractIncomingMessage] = []

    async def got() -> list[AbstractIncomingMessage] | None:
        message = await queue.get(no_ack=True, fail=False)
        if message is not None:
            found.append(message)
        return found if len(found) >= n else None

    complete: list[AbstractIncomingMessage] = await eventually(got, message=f"{n} dead letters in the hub's DLQ")
    await channel.close()
    return complete


async def test_malformed_envelopes_go_to_the_dlq_and_one_bad_item_never_takes_the_others(
        settings: Settings, http: aiohttp.ClientSession, seed: Json, amqp: AbstractRobustConnection,
        topology: Topology) -> None:
    (first, second) = [(c["client_id"], c["token"]) for c in seed["tenants"][0]["clients"][:2]]
    async with running_hub(settings) as hub:
        gateway: Gateway = hub.app[GATEWAY]
        ws_first, ws_second = await _connect(http, hub, first[1]), await _connect(http, hub, second[1])
        good = [_available(first[0]), _available(second[0])]
        items = [{"key": hub_routing_key(gateway.hub_id, f"monitor.normal.{e.target_client_id}"),
                  "message_id": str(uuid.uuid4()), "message_type": "task_available",
                  "event": msgspec.json.decode(msgspec.json.encode(e))} for e in good]
        items.insert(1, {"key": 42, "message_type": "task_available", "event": {}})  # unreadable: no message_id
        channel = await amqp.channel()
        exchange = await channel.get_exchange(topology.dispatch_exchange, ensure=False)
        key = batches.batch_routing_key(hub_word(gateway.hub_id))
        await exchange.publish(aio_pika.Message(msgspec.json.encode({"type": DISPATCH_BATCH, "v": 1,
                                                                     "events": items}), type=DISPATCH_BATCH,
                                                message_id="with-a-bad-item"), routing_key=key)
        # The readable items reach their sockets.
        assert (await _frames(ws_first, 1))[0]["task_id"] == str(good[0].task_id)
        assert (await _frames(ws_second, 1))[0]["task_id"] == str(good[1].task_id)
        # An envelope of a version this hub does not know, and one that is not JSON: nothing delivered.
        for body, message_id in ((b'{"type": "dispatch_batch", "v": 99, "events": []}', "from-the-future"),
                                 (b"\x00 not json", "garbage")):
            await exchange.publish(aio_pika.Message(body, type=DISPATCH_BATCH, message_id=message_id),
                                   routing_key=key)
        dead = {m.message_id: m for m in await _dead_letters(amqp, topology, 3)}
        assert set(dead) == {"with-a-bad-item", "from-the-future", "garbage"}
        assert str(dead["with-a-bad-item"].headers[REASON_HEADER]).startswith(
            "malformed_items: 1 of 3 not delivered (item 1:")
        assert "version 99" in str(dead["from-the-future"].headers[REASON_HEADER])
        assert str(dead["garbage"].headers[REASON_HEADER]).startswith("malformed: not a dispatch_batch")
        assert dead["garbage"].body == b"\x00 not json", "the dead letter is the message as it came"
        # An old single-event message still goes the old way (a relay of before the envelopes).
        late = _available(first[0])
        await exchange.publish(aio_pika.Message(msgspec.json.encode(late)),
                               routing_key=hub_routing_key(gateway.hub_id, f"monitor.normal.{first[0]}"))
        assert (await _frames(ws_first, 1))[0]["task_id"] == str(late.task_id)
        with pytest.raises(asyncio.TimeoutError):  # nothing else reached the first socket
            await ws_second.receive(timeout=0.3)
        await channel.close()
        await ws_first.close()
        await ws_second.close()

