"""The desktop protocol on a lease of the legacy path (libs/tasks/legacy.py), on real Postgres and RabbitMQ: the same
lease / extend / cancel / result calls as for desktop_tasks work, merged in one dispatch order, fenced on the business
row, tenant- and client-isolated, and a lease taking one result."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.domain.lanes import lane_weight
from libs.tasks import legacy
from services.collect_now_api import queries as collect_now_queries
from tests.integration.test_hub_api import http, hub, lease, post, seed
from tests.support.db import one
from tests.support.desktop import dispatch_execution, insert_ready_task

__all__ = ["http", "hub", "seed"]  # the fixtures of test_hub_api, shared


async def offer_legacy(pool: AsyncConnectionPool[Conn], tenant: dict[str, Any], client_id: str, *,
                       question_index: int, lane: str = "normal", priority: int = 100) -> dict[str, Any]:
    """A legacy business task offered to `client_id` as the coordinator's write does it (legacy.offer)."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT min(id) AS id FROM ai_platforms")
        platform = (await cur.fetchone() or {})["id"]
        task_id = await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=question_index,
                                          platform_id=platform)
        await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = 'legacy', dispatch_lane = %s, "
                           "dispatch_priority = %s WHERE id = %s", (lane, priority, task_id))
        cur = await conn.execute("SELECT * FROM monitoring_collect_tasks WHERE id = %s", (task_id,))
        task = await cur.fetchone()
        assert task is not None
        lease_id = uuid.uuid4()
        async with conn.transaction():
            await legacy.offer(conn, [{
                "id": lease_id, "monitor_task_id": task_id, "tenant_id": task["tenant_id"],
                "workspace_id": task["workspace_id"], "target_client_id": uuid.UUID(client_id),
                "ai_platform_id": task["ai_platform_id"], "brand_id": task["brand_id"],
                "question_id": task["question_id"], "business_date": task["business_date"], "lane": lane,
                "lane_weight": lane_weight("monitor", lane), "priority": priority, "interrupt_generation": 0,
                "collect_request_id": None, "enqueued_at": task["enqueued_at"]}], ts=datetime.now(UTC))
    return {"task_id": lease_id, "monitor_task_id": task_id}


async def business(pool: AsyncConnectionPool[Conn], task_id: int) -> dict[str, Any]:
    return await one(pool, "SELECT status, dispatch_lane, leased_to_executor, legacy_lease_id, lease_token_hash, "
                           "lease_expires_at, dispatch_attempts FROM monitoring_collect_tasks WHERE id = %s", task_id)


async def test_one_lease_call_serves_both_paths_in_dispatch_order(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    platform = seed["platforms"][0]["ai_platform_id"]
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 3")
        execution = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client["client_id"],
                                             question_index=0)
    high = await offer_legacy(pool, tenant, client["client_id"], question_index=1, lane="high", priority=20000)
    normal = await offer_legacy(pool, tenant, client["client_id"], question_index=2)
    leased = await lease(http, hub, client["token"], max_tasks=3)
    # The high legacy offer first, then the execution and the normal offer by priority and age.
    assert leased[0]["task_id"] == str(high["task_id"]) and leased[0]["execution_owner"] == "legacy"
    owners = {t["task_id"]: t["execution_owner"] for t in leased}
    assert owners == {str(high["task_id"]): "legacy", str(normal["task_id"]): "legacy",
                      str(execution["task_id"]): "desktop_tasks"}
    row = await business(pool, high["monitor_task_id"])
    assert row["status"] == "leased" and str(row["leased_to_executor"]) == client["client_id"]
    assert row["lease_token_hash"] is not None and row["lease_expires_at"] is not None
    history = await one(pool, "SELECT status, lease_epoch, execution_phase FROM legacy_leases WHERE id = %s",
                        high["task_id"])
    assert history == {"status": "in_progress", "lease_epoch": 1, "execution_phase": "PREPARING"}


async def test_a_legacy_lease_is_fenced_on_the_business_row_and_takes_one_result(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant, other_tenant = seed["tenants"]
    client, neighbour = tenant["clients"]
    offered = await offer_legacy(pool, tenant, client["client_id"], question_index=0)
    (task,) = await lease(http, hub, client["token"])
    path = f"/api/desktop/tasks/{task['task_id']}"
    # Another client of the tenant, another tenant's client, a made-up token: refused.
    status, body = await post(http, hub, f"{path}/extend", neighbour["token"], {"lease_token": task["lease_token"]})
    assert (status, body["error"]) == (404, "not_found")
    status, body = await post(http, hub, f"{path}/extend", other_tenant["clients"][0]["token"],
                              {"lease_token": task["lease_token"]})
    assert (status, body["error"]) == (404, "not_found")
    status, body = await post(http, hub, f"{path}/extend", client["token"], {"lease_token": "lt.1.forged"})
    assert (status, body["error"]) == (409, "stale_lease")
    # A preempt acknowledgement nobody asked for is refused (no interrupt requested).
    status, body = await post(http, hub, f"{path}/cancel", client["token"], {
        "lease_token": task["lease_token"], "reason": "collect_now_preempt", "interrupt_generation": 0})
    assert (status, body["error"]) == (409, "no_interrupt_requested")
    status, body = await post(http, hub, f"{path}/extend", client["token"],
                              {"lease_token": task["lease_token"], "execution_phase": "WAITING"})
    assert status == 200 and body["interrupt_requested"] is False
    result = {"lease_token": task["lease_token"], "status": "succeeded", "answer_text": "ok"}
    status, first = await post(http, hub, f"{path}/result", client["token"], result)
    assert status == 202
    assert (await business(pool, offered["monitor_task_id"]))["status"] in ("received", "pending", "completed")
    status, again = await post(http, hub, f"{path}/result", client["token"], result)
    assert status == 202 and again["result_id"] == first["result_id"]
    status, body = await post(http, hub, f"{path}/result", client["token"], {**result, "answer_text": "other"})
    assert (status, body["error"]) == (409, "result_already_posted")


async def test_a_client_cancel_ends_the_lease_and_retries_the_task(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    offered = await offer_legacy(pool, tenant, client["client_id"], question_index=0)
    async with pool.connection() as conn:  # the coordinator counted the dispatch
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_attempts = 1 WHERE id = %s",
                           (offered["monitor_task_id"],))
    (task,) = await lease(http, hub, client["token"])
    status, _ = await post(http, hub, f"/api/desktop/tasks/{task['task_id']}/cancel", client["token"], {
        "lease_token": task["lease_token"], "reason": "browser crashed", "interrupt_generation": 0})
    assert status == 200
    row = await business(pool, offered["monitor_task_id"])
    assert row["status"] == "pending" and row["dispatch_lane"] == "retry"
    assert row["leased_to_executor"] is None and row["legacy_lease_id"] is None and row["lease_token_hash"] is None
    history = await one(pool, "SELECT status, interrupt_reason FROM legacy_leases WHERE id = %s", offered["task_id"])
    assert history == {"status": "aborted", "interrupt_reason": "browser crashed"}
    # The old token is fenced off for good.
    status, body = await post(http, hub, f"/api/desktop/tasks/{task['task_id']}/extend", client["token"],
                              {"lease_token": task["lease_token"]})
    assert (status, body["error"]) == (409, "stale_lease")


async def test_a_reconnecting_client_is_replayed_its_legacy_offers_and_interrupts(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    """What a client missed while away on the legacy path comes with its hello, as on desktop_tasks: the offers it has
    not pulled (task_available, lane order) and the pulled leases asked to yield (task_control)."""
    from tests.integration.test_hub_websocket import connect, receive

    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    pulled = await offer_legacy(pool, tenant, client["client_id"], question_index=0)
    (leased,) = await lease(http, hub, client["token"], max_tasks=1)
    assert leased["task_id"] == str(pulled["task_id"])
    normal = await offer_legacy(pool, tenant, client["client_id"], question_index=1)
    high = await offer_legacy(pool, tenant, client["client_id"], question_index=2, lane="high", priority=20000)
    async with pool.connection() as conn, conn.transaction():  # a click's writes: the generation, then the interrupt
        params = {"client_id": uuid.UUID(client["client_id"]), "tenant_id": tenant["tenant_id"],
                  "request_id": str(uuid.uuid4())}
        await conn.execute(collect_now_queries.INCREMENT_GENERATION, params)
        cur = await conn.execute(legacy.INTERRUPT_SCHEDULED_LEASES, params)
        assert [r["id"] for r in await cur.fetchall()] == [pulled["task_id"]]
    ws = await connect(http, hub, client["token"])
    hello = await receive(ws)
    assert (hello["type"], hello["replayed_available"], hello["replayed_controls"]) == ("hello", 2, 1), hello
    replay = [await receive(ws) for _ in range(3)]
    assert [(e["type"], e["task_id"]) for e in replay] == [
        ("task_available", str(high["task_id"])), ("task_available", str(normal["task_id"])),
        ("task_control", str(pulled["task_id"]))]
    assert replay[0]["lane"] == "high" and replay[2]["control"] == "interrupt_requested"
    await ws.close()
