"""Desktop protocol versions on the real hub (docs/desktop-protocol.md, Versioning): a 1.0 client (no subprotocol,
Structs of the 1.0 fields only) gets its hello, replay and heartbeat answers and decodes every one; a client
offering majors picks up the highest the hub serves, echoed in the 101; one offering only a newer major is refused
before the upgrade with 400 `unsupported_protocol_version`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import PROTOCOL_VERSION
from libs.db.pool import Conn
from libs.demo import seed_demo
from tests.support import protocol_v1
from tests.support.desktop import dispatch_execution, request_interrupt, running_hub


@pytest.fixture
async def hub(settings: Settings, amqp: AbstractRobustConnection) -> AsyncIterator[TestServer]:
    async with running_hub(settings, heartbeat_timeout_seconds=30) as server:
        yield server


@pytest.fixture
async def client(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=2, clients=1, due=False)
        tenant = seed["tenants"][0]
        client = tenant["clients"][0]
        platform = seed["platforms"][0]["ai_platform_id"]
        await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client["client_id"])
        running = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client["client_id"],
                                           question_index=1)
        await conn.execute("UPDATE desktop_tasks SET status = 'in_progress' WHERE id = %s", (running["task_id"],))
        await request_interrupt(conn, task_id=running["task_id"], generation=2)
    return dict(client)


def _url(hub: TestServer) -> str:
    return str(hub.make_url("/api/desktop/ws"))


async def test_versions_on_the_real_hub(hub: TestServer, client: dict[str, Any]) -> None:
    """One hub and database for all three cases (each one costs a hub and a database otherwise)."""
    await _a_1_0_client_decodes_hello_replay_and_acks_with_1_0_structs(hub, client)
    await _the_highest_served_major_is_echoed_and_an_unserved_one_refused_before_the_upgrade(hub, client)


async def _a_1_0_client_decodes_hello_replay_and_acks_with_1_0_structs(hub: TestServer,
                                                                       client: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(
            _url(hub), headers={"Authorization": f"Bearer {client['token']}"}) as ws:
        assert ws.protocol is None  # nothing offered, nothing echoed
        frames = [await ws.receive_str(timeout=5) for _ in range(3)]
        decoded = [protocol_v1.server_event_decoder.decode(frame) for frame in frames]
        hello, available, control = decoded
        assert isinstance(hello, protocol_v1.Hello) and str(hello.client_id) == client["client_id"]
        assert (hello.replayed_available, hello.replayed_controls) == (1, 1)
        assert isinstance(available, protocol_v1.TaskAvailable) and available.lane == "normal"
        assert isinstance(control, protocol_v1.TaskControl) and control.control == "interrupt_requested"
        assert control.interrupt_generation == 2
        # Today's hello carries more than 1.0 knew of, which the 1.0 Struct ignored.
        assert msgspec.json.decode(frames[0])["protocol_version"] == PROTOCOL_VERSION

        beat = protocol_v1.Heartbeat(sent_at=datetime.now(UTC), local_queue_depth=1, execution_phase="WAITING",
                                     platform_health={"openai": "healthy"}, active_task_id=uuid.uuid4())
        await ws.send_str(msgspec.json.encode(beat).decode())
        ack = protocol_v1.server_event_decoder.decode(await ws.receive_str(timeout=5))
        assert isinstance(ack, protocol_v1.HeartbeatAck)


async def _the_highest_served_major_is_echoed_and_an_unserved_one_refused_before_the_upgrade(
        hub: TestServer, client: dict[str, Any]) -> None:
    auth = {"Authorization": f"Bearer {client['token']}"}
    async with aiohttp.ClientSession() as http:
        for offered in (("monitor.desktop.v1",), ("monitor.desktop.v2", "monitor.desktop.v1")):
            async with http.ws_connect(_url(hub), protocols=offered, headers=auth) as ws:
                assert ws.protocol == "monitor.desktop.v1"
                hello = msgspec.json.decode(await ws.receive_str(timeout=5))
                assert hello["type"] == "hello" and hello["protocol_version"] == PROTOCOL_VERSION
        for refused in ("monitor.desktop.v2", "graphql-ws"):
            async with http.get(_url(hub), headers={
                    **auth, "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Protocol": refused}) as response:
                body = await response.json()
                assert response.status == 400, body
                assert body["error"] == "unsupported_protocol_version" and body["field"] == "Sec-WebSocket-Protocol"
                assert "monitor.desktop.v1" in body["message"]
