"""dispatch-hub edges on real Postgres and RabbitMQ: one result per lease, preempt cancels only for a requested
interrupt, sockets per client, upgrade rate limits, the unknown-token cache, and revocation that bites
(monitorctl client disable | enable | rotate-token)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import date
from typing import Any

import aiohttp
import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import MonitorResult
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.domain.shard import shard_for
from libs.mq.topology import Topology
from services.dispatch_hub.http_api import AUTH
from tests.support.desktop import dispatch_execution, running_hub
from tests.support.monitorctl import run_monitorctl
from tests.support.wait import eventually

Json = dict[str, Any]


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> Json:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=2, brands=1, questions=3, clients=2, due=False)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def client_of(seed: Json, tenant: int = 0, client: int = 0) -> tuple[Json, str, str]:
    t = seed["tenants"][tenant]
    return t, t["clients"][client]["client_id"], t["clients"][client]["token"]


async def post(http: aiohttp.ClientSession, hub: TestServer, path: str, token: str, body: Json) -> tuple[int, Json]:
    async with http.post(str(hub.make_url(path)), json=body, headers={"Authorization": f"Bearer {token}"}) as resp:
        return resp.status, await resp.json()


async def leased_execution(http: aiohttp.ClientSession, hub: TestServer, pool: AsyncConnectionPool[Conn],
                           seed: Json) -> tuple[Json, Json]:
    """A queued execution on the first client of the first tenant, leased by that client: (execution, leased task)."""
    tenant, client, token = client_of(seed)
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=seed["platforms"][0]["ai_platform_id"],
                                      client_id=client)
    _, leased = await post(http, hub, "/api/desktop/monitor/lease", token, {})
    return ex, leased["tasks"][0]


async def connect(http: aiohttp.ClientSession, hub: TestServer, token: str) -> aiohttp.ClientWebSocketResponse:
    # autoclose off: the test reads the server's close frame itself (answering it could race the server's own
    # closing of the transport and raise instead of returning the frame)
    ws = await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers={"Authorization": f"Bearer {token}"},
                               autoclose=False)
    hello = await ws.receive_json(timeout=5)
    assert hello["type"] == "hello", hello
    return ws


async def closed_with(ws: aiohttp.ClientWebSocketResponse, timeout: float = 10.0) -> int | None:
    """Read until the server closes the socket; the code of its close frame."""
    async def drain() -> int | None:
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.CLOSE:
                with contextlib.suppress(Exception):
                    await ws.close()
                return int(msg.data)
            if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                return None

    return await asyncio.wait_for(drain(), timeout)


async def shard_messages(amqp: AbstractRobustConnection, topology: Topology, shard: int) -> list[MonitorResult]:
    """Every message on a shard queue (each was confirmed before its 202: they are all there already)."""
    channel = await amqp.channel()
    declared = await channel.declare_queue(topology.ingest_queue(shard), passive=True)
    count = declared.declaration_result.message_count
    found = []
    async with declared.iterator() as messages:
        for _ in range(count):
            message = await asyncio.wait_for(messages.__anext__(), timeout=5)
            found.append(msgspec.json.decode(message.body, type=MonitorResult))
            await message.ack()
    await channel.close()
    return found


async def test_a_lease_takes_one_result_and_an_identical_retry_gets_the_same_answer(
        settings: Settings, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: Json,
        amqp: AbstractRobustConnection, topology: Topology) -> None:
    tenant, _, token = client_of(seed)
    async with running_hub(settings) as hub:
        ex, task = await leased_execution(http, hub, pool, seed)
        path = f"/api/desktop/tasks/{ex['task_id']}/result"
        body = {"lease_token": task["lease_token"], "status": "succeeded", "answer_text": "Acme is fine.",
                "brand_mentioned": True}
        first = await post(http, hub, path, token, body)
        retry = await post(http, hub, path, token, body)
        other = await post(http, hub, path, token, {**body, "answer_text": "something else"})
        assert first[0] == 202 and retry == first, (first, retry)
        assert other[0] == 409 and other[1]["error"] == "result_already_posted", other
        # Ingest ended the execution meanwhile: the identical retry is still the same 202.
        async with pool.connection() as conn:
            await conn.execute("UPDATE desktop_tasks SET status = 'succeeded' WHERE id = %s", (ex["task_id"],))
        assert await post(http, hub, path, token, body) == first
        shard = shard_for(tenant["tenant_id"], tenant["brands"][0]["brand_id"],
                          date.fromisoformat(task["business_date"]), topology.ingest_shards)
        published = await shard_messages(amqp, topology, shard)
        assert [str(m.result_id) for m in published] == [first[1]["result_id"]]  # published once


async def test_a_preempt_cancel_is_refused_when_no_interrupt_was_requested(
        settings: Settings, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: Json) -> None:
    _, _, token = client_of(seed)
    async with running_hub(settings) as hub:
        ex, task = await leased_execution(http, hub, pool, seed)
        status, body = await post(http, hub, f"/api/desktop/tasks/{ex['task_id']}/cancel", token, {
            "lease_token": task["lease_token"], "reason": "collect_now_preempt", "interrupt_generation": 0})
        assert status == 409 and body["error"] == "no_interrupt_requested" and body["field"] == "reason", body
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT status FROM desktop_tasks WHERE id = %s", (ex["task_id"],))
            assert await cur.fetchone() == {"status": "in_progress"}  # nothing yielded


async def test_a_clients_third_socket_closes_its_oldest(settings: Settings, http: aiohttp.ClientSession,
                                                        seed: Json) -> None:
    _, _, token = client_of(seed)
    _, _, other_token = client_of(seed, tenant=1)
    async with running_hub(settings, hub_max_sockets_per_client=2) as hub:
        first, second = await connect(http, hub, token), await connect(http, hub, token)
        bystander = await connect(http, hub, other_token)
        third = await connect(http, hub, token)
        assert await closed_with(first) == 4409
        for ws in (second, third, bystander):
            await ws.send_str('{"type": "heartbeat"}')
            assert (await ws.receive_json(timeout=5))["type"] == "heartbeat_ack"
            await ws.close()


async def test_upgrades_are_rate_limited_per_client_without_touching_other_clients(
        settings: Settings, http: aiohttp.ClientSession, seed: Json) -> None:
    _, _, token = client_of(seed)
    _, _, other_token = client_of(seed, tenant=1)
    async with running_hub(settings, hub_upgrade_burst_per_client=3, hub_upgrades_per_client_per_s=0.01) as hub:
        for _ in range(3):
            await (await connect(http, hub, token)).close()
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await connect(http, hub, token)
        assert info.value.status == 429
        assert info.value.headers is not None and int(info.value.headers["Retry-After"]) > 0
        await (await connect(http, hub, other_token)).close()  # another client is unaffected


async def test_upgrades_are_rate_limited_per_address_before_any_token_lookup(
        settings: Settings, http: aiohttp.ClientSession, seed: Json) -> None:
    _, _, token = client_of(seed)
    async with running_hub(settings, hub_upgrade_burst_per_address=2, hub_upgrades_per_address_per_s=0.01) as hub:
        lookups = hub.app[AUTH].lookups
        for bad in ("dct_made-up-1", "dct_made-up-2"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await connect(http, hub, bad)
            assert info.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await connect(http, hub, token)
        assert info.value.status == 429
        assert hub.app[AUTH].lookups == lookups + 2  # the third was refused before its token was looked up


async def _upgrade(http: aiohttp.ClientSession, hub: TestServer, token: str, forwarded_for: str) -> int:
    """The status of a WebSocket upgrade carrying this X-Forwarded-For (101, or the refusal's)."""
    headers = {"Authorization": f"Bearer {token}", "X-Forwarded-For": forwarded_for}
    try:
        ws = await http.ws_connect(str(hub.make_url("/api/desktop/ws")), headers=headers)
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status
    await ws.close()
    return 101


async def test_clients_behind_a_trusted_proxy_get_their_own_upgrade_budgets(
        settings: Settings, http: aiohttp.ClientSession, seed: Json) -> None:
    _, _, token = client_of(seed)
    # The test's connections come from 127.0.0.1: here, the ingress. Each client behind it has a budget of 1.
    async with running_hub(settings, hub_upgrade_burst_per_address=1, hub_upgrades_per_address_per_s=0.01,
                           hub_trusted_proxies="127.0.0.1/32") as hub:
        assert await _upgrade(http, hub, token, "198.51.100.1") == 101
        assert await _upgrade(http, hub, token, "203.0.113.9, 198.51.100.2") == 101  # another client
        assert await _upgrade(http, hub, token, "198.51.100.1") == 429  # the first one's budget is spent
        # What a client writes left of the address the proxy appended changes nothing.
        assert await _upgrade(http, hub, token, "203.0.113.10, 198.51.100.2") == 429
    # Not a trusted proxy: X-Forwarded-For is ignored, every upgrade counts against the peer's one budget.
    async with running_hub(settings, hub_upgrade_burst_per_address=1, hub_upgrades_per_address_per_s=0.01) as hub:
        assert await _upgrade(http, hub, token, "198.51.100.1") == 101
        assert await _upgrade(http, hub, token, "198.51.100.2") == 429


async def test_unknown_tokens_are_cached_as_unknown(settings: Settings, http: aiohttp.ClientSession,
                                                    seed: Json) -> None:
    async with running_hub(settings) as hub:
        before = hub.app[AUTH].lookups
        for _ in range(20):
            status, body = await post(http, hub, "/api/desktop/monitor/lease", "dct_not-a-real-token", {})
            assert status == 401 and body["error"] == "unauthorized"
        assert hub.app[AUTH].lookups == before + 1


async def test_disable_enable_and_rotate_bite_within_seconds(
        settings: Settings, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: Json) -> None:
    _, client, token = client_of(seed)
    _, other_client, other_token = client_of(seed, tenant=1)
    async with running_hub(settings, hub_revocation_check_s=0.5, hub_auth_cache_s=0.5) as hub:
        ws, bystander = await connect(http, hub, token), await connect(http, hub, other_token)
        assert (await post(http, hub, "/api/desktop/monitor/lease", token, {}))[0] == 200  # cached as enabled
        done = await asyncio.to_thread(run_monitorctl, settings, "client", "disable", client)
        assert done.returncode == 0, done.stderr
        assert msgspec.json.decode(done.stdout) == {"client_id": client, "disabled": True, "changed": True}
        assert await closed_with(ws) == 4403

        async def refused() -> Json | None:
            status, body = await post(http, hub, "/api/desktop/monitor/lease", token, {})
            return body if status == 401 else None

        assert (await eventually(refused, timeout=5, message="disabled client refused"))["error"] == "client_disabled"
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await connect(http, hub, token)

        async def offline() -> bool | None:
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT online FROM desktop_clients WHERE id = %s", (client,))
                return True if await cur.fetchone() == {"online": False} else None

        await eventually(offline, timeout=5, message="marked offline once its last socket closed")
        again = await asyncio.to_thread(run_monitorctl, settings, "client", "disable", client)
        assert msgspec.json.decode(again.stdout)["changed"] is False  # idempotent

        enabled = await asyncio.to_thread(run_monitorctl, settings, "client", "enable", client)
        assert enabled.returncode == 0 and msgspec.json.decode(enabled.stdout)["changed"] is True
        ws = await connect(http, hub, token)

        rotated = await asyncio.to_thread(run_monitorctl, settings, "client", "rotate-token", client)
        assert rotated.returncode == 0, rotated.stderr
        new_token = msgspec.json.decode(rotated.stdout)["token"]
        assert await closed_with(ws) == 4401

        async def old_refused() -> bool | None:
            status, _ = await post(http, hub, "/api/desktop/monitor/lease", token, {})
            return True if status == 401 else None

        await eventually(old_refused, timeout=5, message="the old token refused")
        await (await connect(http, hub, new_token)).close()
        # the other tenant's client never noticed
        await bystander.send_str('{"type": "heartbeat"}')
        assert (await bystander.receive_json(timeout=5))["type"] == "heartbeat_ack"
        await bystander.close()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT routing_key, count(*) AS n FROM outbox WHERE routing_key LIKE 'client.%%' "
                                 "AND convert_from(payload, 'UTF8')::jsonb->>'client_id' = %s GROUP BY routing_key",
                                 (client,))
        events = {r["routing_key"]: r["n"] for r in await cur.fetchall()}
    assert events.get("client.disabled") == 1 and events.get("client.enabled") == 1
    assert events.get("client.token_rotated") == 1
    assert other_client not in str(events)


async def test_a_disabled_clients_heartbeats_are_ignored(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                         seed: Json) -> None:
    from services.dispatch_hub.heartbeats import HeartbeatWriter

    _, client, _ = client_of(seed)
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET disabled_at = now(), last_heartbeat_at = NULL WHERE id = %s",
                           (client,))
    writer = HeartbeatWriter(pool, hub="hub-x", interval_s=1.0, is_connected=lambda _: True)
    writer.touch(uuid.UUID(client))
    writer.report_health(uuid.UUID(client), {"openai": "healthy"})
    await writer.flush()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT online, last_heartbeat_at, platform_health FROM desktop_clients "
                                 "WHERE id = %s", (client,))
        assert await cur.fetchone() == {"online": False, "last_heartbeat_at": None, "platform_health": {}}
