"""dispatch-hub desktop HTTP API on real Postgres and RabbitMQ: lease order, fencing, generations,
result confirm, auth isolation, malformed bodies, 410, OpenAPI conformance, write-health timing of the calls."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import date
from typing import Any

import aiohttp
import jsonschema
import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import MonitorResult
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn, connect
from libs.demo import seed_demo
from libs.domain.shard import shard_for
from libs.mq.topology import Topology
from libs.telemetry import metrics
from services.dispatch_hub.http_api import CONTEXT
from tests.support.desktop import dispatch_execution, insert_collect_request, request_interrupt, running_hub
from tests.support.tcpproxy import TcpProxy
from tests.support.wait import eventually


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=2, brands=1, questions=5, clients=2, due=False)


@pytest.fixture
async def hub(settings: Settings, amqp: AbstractRobustConnection) -> AsyncIterator[TestServer]:
    async with running_hub(settings) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def url(server: TestServer, path: str) -> str:
    return str(server.make_url(path))


async def post(http: aiohttp.ClientSession, server: TestServer, path: str, token: str | None,
               body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **(auth(token) if token else {})}
    data = raw if raw is not None else msgspec.json.encode(body if body is not None else {})
    async with http.post(url(server, path), data=data, headers=headers) as resp:
        return resp.status, await resp.json()


async def lease(http: aiohttp.ClientSession, server: TestServer, token: str,
                max_tasks: int = 1) -> list[dict[str, Any]]:
    status, body = await post(http, server, "/api/desktop/monitor/lease", token, {"max_tasks": max_tasks})
    assert status == 200, body
    tasks: list[dict[str, Any]] = body["tasks"]
    return tasks


def _first(seed: dict[str, Any], tenant: int = 0, client: int = 0) -> tuple[dict[str, Any], str, str, int]:
    t = seed["tenants"][tenant]
    c = t["clients"][client]
    return t, c["client_id"], c["token"], seed["platforms"][0]["ai_platform_id"]


async def test_lease_order_concurrency_and_bookkeeping(hub: TestServer, http: aiohttp.ClientSession,
                                                      pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant, client, token, platform = _first(seed)
    async with pool.connection() as conn:
        request_id = await insert_collect_request(conn, tenant=tenant, client_id=client, generation=1)
        retry = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, lane="retry",
                                         question_index=0, age_s=900)
        old_normal = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                              question_index=1, age_s=600)
        new_normal = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                              question_index=2, age_s=10)
        boosted = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                           question_index=3, priority=150, age_s=5)
        high = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, lane="high",
                                        question_index=4, generation=1, request_id=request_id)
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 4 WHERE id = %s", (client,))

    first = await lease(http, hub, token, max_tasks=3)
    second = await lease(http, hub, token, max_tasks=3)
    # Concurrency 4: three then one; the oldest-enqueued normal wins a priority tie; retry is last and left over.
    assert [t["task_id"] for t in first] == [str(high["task_id"]), str(boosted["task_id"]),
                                             str(old_normal["task_id"])]
    assert [t["task_id"] for t in second] == [str(new_normal["task_id"])]
    assert await lease(http, hub, token, max_tasks=3) == []
    top = first[0]
    assert top["lane"] == "high" and top["interrupt_generation"] == 1 and top["lease_epoch"] == 1
    assert top["brand"]["brand_id"] == tenant["brands"][0]["brand_id"] and top["question"]["text"]
    assert top["platform"] == {"ai_platform_id": platform, "code": seed["platforms"][0]["code"]}
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, execution_phase, lease_epoch, lease_token_hash IS NOT NULL AS h "
                                 "FROM desktop_tasks WHERE id = %s", (high["task_id"],))
        assert await cur.fetchone() == {"status": "in_progress", "execution_phase": "PREPARING", "lease_epoch": 1,
                                        "h": True}
        cur = await conn.execute("SELECT status FROM desktop_tasks WHERE id = %s", (retry["task_id"],))
        assert (await cur.fetchone()) == {"status": "queued"}
        cur = await conn.execute("SELECT count(*) AS n FROM desktop_task_attempts WHERE client_id = %s", (client,))
        assert (await cur.fetchone()) == {"n": 4}
        cur = await conn.execute("SELECT status FROM monitoring_collect_requests WHERE id = %s", (request_id,))
        assert (await cur.fetchone()) == {"status": "running"}
        cur = await conn.execute("SELECT count(*) AS n FROM outbox WHERE routing_key = 'task.leased'")
        assert (await cur.fetchone()) == {"n": 4}


async def test_fencing_stale_lease_and_isolation(hub: TestServer, http: aiohttp.ClientSession,
                                                 pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant, client, token, platform = _first(seed)
    _, _, other_token, _ = _first(seed, tenant=1)
    _, _, sibling_token, _ = _first(seed, tenant=0, client=1)
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client)
    (task,) = await lease(http, hub, token)
    path = f"/api/desktop/tasks/{ex['task_id']}"
    status, body = await post(http, hub, f"{path}/extend", token, {"lease_token": task["lease_token"],
                                                                  "execution_phase": "NAVIGATING"})
    assert status == 200 and body["interrupt_requested"] is False
    # Another tenant's client and a sibling client of the same tenant: 404, nothing revealed.
    for foreign in (other_token, sibling_token):
        for action in ("extend", "cancel", "result"):
            status, body = await post(http, hub, f"{path}/{action}", foreign, {
                "lease_token": task["lease_token"], "reason": "x", "interrupt_generation": 0, "status": "failed"})
            assert (status, body["error"]) == (404, "not_found"), (action, body)
    # The lease expires and is taken again: the old token is fenced off everywhere.
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_tasks SET status = 'queued', lease_token_hash = NULL WHERE id = %s",
                           (ex["task_id"],))
    (again,) = await lease(http, hub, token)
    assert again["lease_epoch"] == 2
    for action, extra in (("extend", {}), ("result", {"status": "succeeded"}),
                          ("cancel", {"reason": "user_cancelled", "interrupt_generation": 0})):
        status, body = await post(http, hub, f"{path}/{action}", token, {"lease_token": task["lease_token"], **extra})
        assert (status, body["error"]) == (409, "stale_lease"), (action, body)
    # A forged token carrying the right epoch is refused too.
    forged = again["lease_token"].rsplit(".", 1)[0] + ".forged"
    status, body = await post(http, hub, f"{path}/extend", token, {"lease_token": forged})
    assert (status, body["error"]) == (409, "stale_lease")
    status, body = await post(http, hub, f"{path}/extend", token, {"lease_token": again["lease_token"]})
    assert status == 200
    status, body = await post(http, hub, f"/api/desktop/tasks/{uuid.uuid4()}/extend", token,
                              {"lease_token": again["lease_token"]})
    assert (status, body["error"]) == (404, "not_found")


async def test_preempt_cancel_generation_rules(hub: TestServer, http: aiohttp.ClientSession,
                                               pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant, client, token, platform = _first(seed)
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, age_s=300)
    (task,) = await lease(http, hub, token)
    async with pool.connection() as conn:
        request_id = await insert_collect_request(conn, tenant=tenant, client_id=client, generation=3)
        await request_interrupt(conn, task_id=ex["task_id"], generation=3, request_id=request_id)
    path = f"/api/desktop/tasks/{ex['task_id']}"
    status, body = await post(http, hub, f"{path}/extend", token, {"lease_token": task["lease_token"],
                                                                  "execution_phase": "INPUTTING",
                                                                  "safe_point_interval_ms": 420})
    assert status == 200 and body["interrupt_requested"] is True and body["interrupt_generation"] == 3
    mismatches = metrics.interrupt_generation_mismatch_count.value()
    status, body = await post(http, hub, f"{path}/cancel", token, {
        "lease_token": task["lease_token"], "reason": "collect_now_preempt", "interrupt_generation": 2})
    assert status == 409 and body["error"] == "stale_generation" and body["current_generation"] == 3
    assert metrics.interrupt_generation_mismatch_count.value() == mismatches + 1
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT payload FROM outbox WHERE routing_key = %s", (f"monitor.control.{client}",))
        (resent,) = [msgspec.json.decode(r["payload"], type=TaskControl) for r in await cur.fetchall()]
    assert resent.control == "interrupt_requested" and resent.interrupt_generation == 3
    assert resent.task_id == ex["task_id"] and resent.collect_request_id == request_id

    successes = metrics.monitor_preempt_success_count.value()
    induced = metrics.collect_now_preempt_induced_retry_count.value()
    latency_count = _hist_count("monitor_preempt_latency_ms")
    status, body = await post(http, hub, f"{path}/cancel", token, {
        "lease_token": task["lease_token"], "reason": "collect_now_preempt", "interrupt_generation": 3,
        "execution_phase": "INPUTTING", "safe_point_interval_ms": 380})
    assert (status, body) == (200, {"status": "aborted"})
    assert metrics.monitor_preempt_success_count.value() == successes + 1
    # INPUTTING: started work was thrown away, so the scheduled task runs again because of the preemption.
    assert metrics.collect_now_preempt_induced_retry_count.value() == induced + 1
    assert _hist_count("monitor_preempt_latency_ms") == latency_count + 1
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, interrupt_reason FROM desktop_tasks WHERE id = %s", (ex["task_id"],))
        assert await cur.fetchone() == {"status": "aborted", "interrupt_reason": "collect_now_preempt"}
        cur = await conn.execute("SELECT status, dispatch_attempts, dispatch_lane, enqueued_at < now() - interval "
                                 "'4 minutes' AS kept FROM monitoring_collect_tasks WHERE id = %s",
                                 (ex["monitor_task_id"],))
        # A yield: back to pending, same lane and enqueued_at, the dispatch attempt given back.
        assert await cur.fetchone() == {"status": "pending", "dispatch_attempts": 0, "dispatch_lane": "normal",
                                        "kept": True}
        cur = await conn.execute("SELECT status, abort_reason FROM desktop_task_attempts WHERE task_id = %s",
                                 (ex["task_id"],))
        assert await cur.fetchone() == {"status": "aborted", "abort_reason": "collect_now_preempt"}
        cur = await conn.execute("SELECT first_preempt_at IS NOT NULL AS p FROM monitoring_collect_requests "
                                 "WHERE id = %s", (request_id,))
        assert await cur.fetchone() == {"p": True}
        cur = await conn.execute("SELECT count(*) AS n FROM outbox WHERE routing_key = 'task.aborted'")
        assert await cur.fetchone() == {"n": 1}
    # Once aborted, the token is dead.
    status, body = await post(http, hub, f"{path}/extend", token, {"lease_token": task["lease_token"]})
    assert (status, body["error"]) == (409, "stale_lease")
    safe_points = _hist_count("safe_point_interval_ms", platform=seed["platforms"][0]["code"])
    assert safe_points >= 2
    # ... and into the histogram every replica shares (what the reconciler tunes timeouts from)
    await hub.app[CONTEXT].safe_points.flush(pool)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT client_id::text AS client, le_ms, sum(n)::int AS n "
                                 "FROM safe_point_client_histogram WHERE ai_platform_id = %s "
                                 "GROUP BY 1, 2 ORDER BY 1, 2", (platform,))
        # 420 and 380 ms, counted for the client that reported them (the tuning bounds any one client's weight)
        assert await cur.fetchall() == [{"client": str(client), "le_ms": 500, "n": 2}]


async def test_cancel_for_other_reason_consumes_the_attempt(hub: TestServer, http: aiohttp.ClientSession,
                                                            pool: AsyncConnectionPool[Conn],
                                                            seed: dict[str, Any]) -> None:
    tenant, client, token, platform = _first(seed)
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client)
    (task,) = await lease(http, hub, token)
    status, _ = await post(http, hub, f"/api/desktop/tasks/{ex['task_id']}/cancel", token, {
        "lease_token": task["lease_token"], "reason": "login_required", "interrupt_generation": 0})
    assert status == 200
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, dispatch_attempts, dispatch_lane FROM monitoring_collect_tasks "
                                 "WHERE id = %s", (ex["monitor_task_id"],))
        assert await cur.fetchone() == {"status": "pending", "dispatch_attempts": 1, "dispatch_lane": "retry"}


async def test_result_is_202_only_after_the_confirm(hub: TestServer, http: aiohttp.ClientSession,
                                                    pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
                                                    amqp: AbstractRobustConnection, topology: Topology) -> None:
    tenant, client, token, platform = _first(seed)
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client)
    (task,) = await lease(http, hub, token)
    status, body = await post(http, hub, f"/api/desktop/tasks/{ex['task_id']}/result", token, {
        "lease_token": task["lease_token"], "status": "succeeded", "answer_text": "Acme is a solid choice.",
        "brand_mentioned": True, "citations": [{"url": "https://example.com/review", "title": "Review",
                                                "position": 1}],
        "started_at": "2026-01-01T00:00:00Z", "finished_at": "2026-01-01T00:00:05Z"})
    assert status == 202 and body["accepted"] is True
    # Already on the shard queue by the time we got the 202.
    shard = shard_for(tenant["tenant_id"], tenant["brands"][0]["brand_id"],
                      date.fromisoformat(task["business_date"]), topology.ingest_shards)
    channel = await amqp.channel()
    queue = await channel.get_queue(topology.ingest_queue(shard), ensure=False)
    async with queue.iterator() as messages:
        # The message is already queued (the 202 came after the confirm): it arrives at once.
        message = await asyncio.wait_for(messages.__anext__(), timeout=5)
        await message.ack()
    result = msgspec.json.decode(message.body, type=MonitorResult)
    assert result.task_id == ex["task_id"] and result.lease_epoch == 1 and result.shard == shard
    assert result.client_id == uuid.UUID(client) and result.brand_mentioned and len(result.citations) == 1
    assert str(result.result_id) == body["result_id"]
    await channel.close()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, result_received_at IS NOT NULL AS r FROM desktop_tasks "
                                 "WHERE id = %s", (ex["task_id"],))
        # Still in progress: ingest ends the execution when it applies the result.
        assert await cur.fetchone() == {"status": "in_progress", "r": True}


async def test_result_503_when_the_broker_is_unavailable(settings: Settings, http: aiohttp.ClientSession,
                                                        pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
                                                        amqp: AbstractRobustConnection) -> None:
    tenant, client, token, platform = _first(seed)
    parsed = aiohttp.helpers.URL(settings.amqp_url)
    proxy = TcpProxy(parsed.host or "127.0.0.1", parsed.port or 5672)
    await proxy.start()
    proxied = str(parsed.with_port(proxy.port))
    try:
        async with running_hub(settings, amqp_url=proxied) as hub:
            async with pool.connection() as conn:
                ex = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client)
            (task,) = await lease(http, hub, token)
            await proxy.cut()
            status, body = await post(http, hub, f"/api/desktop/tasks/{ex['task_id']}/result", token, {
                "lease_token": task["lease_token"], "status": "failed", "error": "timeout"})
            assert status == 503 and body["error"] == "broker_unavailable"
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT result_received_at FROM desktop_tasks WHERE id = %s",
                                         (ex["task_id"],))
                assert await cur.fetchone() == {"result_received_at": None}
            await proxy.restore()

            async def accepted() -> bool:
                status, _ = await post(http, hub, f"/api/desktop/tasks/{ex['task_id']}/result", token, {
                    "lease_token": task["lease_token"], "status": "failed", "error": "timeout"})
                return status == 202

            await eventually(accepted, timeout=20, interval=0.5, message="result accepted after the broker returned")
    finally:
        await proxy.close()


async def test_auth_gone_and_malformed_bodies(hub: TestServer, http: aiohttp.ClientSession,
                                              seed: dict[str, Any]) -> None:
    _, _, token, _ = _first(seed)
    status, body = await post(http, hub, "/api/desktop/monitor/lease", None)
    assert (status, body["error"]) == (401, "unauthorized")
    status, body = await post(http, hub, "/api/desktop/monitor/lease", "dct_nope")
    assert (status, body["error"]) == (401, "unauthorized")
    async with http.get(url(hub, "/api/desktop/events"), headers=auth(token)) as resp:
        assert resp.status == 410 and (await resp.json())["error"] == "gone"
    task = f"/api/desktop/tasks/{uuid.uuid4()}"
    cases: list[tuple[str, Any, str | None]] = [
        ("/api/desktop/monitor/lease", {"max_tasks": 0}, "max_tasks"),
        (f"{task}/extend", {"lease_token": 5}, "lease_token"),
        (f"{task}/extend", {"lease_token": "t", "execution_phase": "DANCING"}, "execution_phase"),
        (f"{task}/cancel", {"lease_token": "t", "reason": "x"}, "interrupt_generation"),
        (f"{task}/cancel", {"lease_token": "t", "reason": "x", "interrupt_generation": -1}, "interrupt_generation"),
        (f"{task}/result", {"lease_token": "t", "status": "maybe"}, "status"),
        (f"{task}/result", {"lease_token": "t", "status": "succeeded", "citations": [{"title": "no url"}]},
         "citations[0].url"),
    ]
    for path, payload, field in cases:
        status, body = await post(http, hub, path, token, payload)
        assert status == 400 and body["field"] == field, (path, body)
    status, body = await post(http, hub, f"{task}/extend", token, raw=b"{not json")
    assert (status, body["error"]) == (400, "invalid_json")


async def test_openapi_document_matches_real_responses(hub: TestServer, http: aiohttp.ClientSession,
                                                       pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant, client, token, platform = _first(seed)
    async with http.get(url(hub, "/openapi.json")) as resp:
        document = await resp.json()
    assert document["openapi"].startswith("3.")
    components = document["components"]

    def check(path: str, method: str, status: int, body: Any) -> None:
        responses = document["paths"][path][method]["responses"]
        assert str(status) in responses, (path, status)
        # Answers are JSON, errors RFC 9457 problems.
        media = "application/problem+json" if status >= 400 else "application/json"
        schema = responses[str(status)]["content"][media]["schema"]
        jsonschema.validate(body, {**schema, "components": components})

    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client)
        ex2 = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, question_index=1)
    status, body = await post(http, hub, "/api/desktop/monitor/lease", token, {"max_tasks": 2})
    check("/api/desktop/monitor/lease", "post", status, body)
    tokens = {t["task_id"]: t["lease_token"] for t in body["tasks"]}
    base = "/api/desktop/tasks/{task_id}"
    status, body = await post(http, hub, f"/api/desktop/tasks/{ex['task_id']}/extend", token,
                              {"lease_token": tokens[str(ex["task_id"])], "execution_phase": "WAITING"})
    check(f"{base}/extend", "post", status, body)
    status, body = await post(http, hub, f"/api/desktop/tasks/{ex['task_id']}/result", token,
                              {"lease_token": tokens[str(ex["task_id"])], "status": "succeeded", "answer_text": "ok"})
    check(f"{base}/result", "post", status, body)
    status, body = await post(http, hub, f"/api/desktop/tasks/{ex2['task_id']}/cancel", token,
                              {"lease_token": tokens[str(ex2["task_id"])], "reason": "user",
                               "interrupt_generation": 0})
    check(f"{base}/cancel", "post", status, body)
    status, body = await post(http, hub, f"/api/desktop/tasks/{ex2['task_id']}/cancel", token,
                              {"lease_token": tokens[str(ex2["task_id"])], "reason": "user",
                               "interrupt_generation": 0})
    check(f"{base}/cancel", "post", status, body)
    status, body = await post(http, hub, f"/api/desktop/tasks/{ex2['task_id']}/extend", token, {"lease_token": 1})
    check(f"{base}/extend", "post", status, body)
    status, body = await post(http, hub, "/api/desktop/monitor/lease", None)
    check("/api/desktop/monitor/lease", "post", status, body)
    async with http.get(url(hub, "/api/desktop/events")) as resp:
        check("/api/desktop/events", "get", resp.status, await resp.json())


def _hist_count(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(f"{name}_count", labels or None)
    return value or 0.0


async def test_a_posted_result_frees_the_clients_slot(hub: TestServer, http: aiohttp.ClientSession,
                                                      pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant, client, token, platform = _first(seed)
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1 WHERE id = %s", (client,))
        first = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, age_s=10)
        second = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                          question_index=1)
    (task,) = await lease(http, hub, token)
    assert task["task_id"] == str(first["task_id"])
    assert await lease(http, hub, token) == []
    status, _ = await post(http, hub, f"/api/desktop/tasks/{task['task_id']}/result", token,
                           {"lease_token": task["lease_token"], "status": "succeeded", "answer_text": "done"})
    assert status == 202
    # The first execution stays in_progress until ingest applies the result, but the client is free.
    (following,) = await lease(http, hub, token)
    assert following["task_id"] == str(second["task_id"])


async def test_extend_cancel_and_result_writes_count_in_the_hubs_write_health(
        settings: Settings, amqp: AbstractRobustConnection, http: aiohttp.ClientSession,
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant, client, token, platform = _first(seed)
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 3 WHERE id = %s", (client,))
        done, dropped, contended = [
            (await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                      question_index=i, age_s=30 - i))["task_id"] for i in range(3)]
    # A short lock wait, so a call that meets a locked row fails on lock_timeout (a conflict) quickly.
    async with running_hub(settings, db_lock_timeout_ms=200) as hub:
        health = hub.app[CONTEXT].write_health
        tokens = {t["task_id"]: t["lease_token"] for t in await lease(http, hub, token, max_tasks=3)}

        async def counted(action: str, task_id: uuid.UUID, body: dict[str, Any]) -> tuple[int, int, int]:
            """The call's status and the (writes, conflicts) it added to the hub's write health."""
            writes, conflicts = health.stats.counts(time.monotonic())
            status, _ = await post(http, hub, f"/api/desktop/tasks/{task_id}/{action}", token,
                                   {"lease_token": tokens[str(task_id)], **body})
            now_writes, now_conflicts = health.stats.counts(time.monotonic())
            return status, now_writes - writes, now_conflicts - conflicts

        extend = {"execution_phase": "NAVIGATING"}
        cancel = {"reason": "user", "interrupt_generation": 0}
        result = {"status": "succeeded", "answer_text": "ok"}
        assert await counted("extend", done, extend) == (200, 1, 0)
        assert await counted("result", done, result) == (202, 2, 0)  # the claim, then the received mark
        assert await counted("cancel", dropped, cancel) == (200, 1, 0)
        holder = await connect(settings.database_url)
        try:
            await holder.execute("BEGIN")
            await holder.execute("SELECT id FROM desktop_tasks WHERE id = %s FOR UPDATE", (contended,))
            for action, body in (("extend", extend), ("cancel", cancel), ("result", result)):
                assert await counted(action, contended, body) == (503, 1, 1), action  # lock_timeout: a conflict
        finally:
            await holder.execute("ROLLBACK")
            await holder.close()
        assert await counted("result", contended, result) == (202, 2, 0)
        # ... and what the coordinator reads: this replica's row in writer_health.
        writes, conflicts = health.stats.counts(time.monotonic())
        assert (writes, conflicts) == (1 + 1 + 2 + 1 + 3 + 2, 3)  # the lease first
        await health.publish(pool)
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT writes, conflicts FROM writer_health WHERE writer = 'hub' "
                                     "AND instance = %s", (health.instance,))
            assert await cur.fetchone() == {"writes": writes, "conflicts": conflicts}


async def test_the_lease_carries_the_mode_its_plan_runs_in(hub: TestServer, http: aiohttp.ClientSession,
                                                           pool: AsyncConnectionPool[Conn],
                                                           seed: dict[str, Any]) -> None:
    """§10.5 per-mode timeouts: the client learns the mode (OpenAI quick / deep reasoning) with its lease."""
    tenant, client, token, platform = _first(seed)
    async with pool.connection() as conn:
        deep = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, lane="high")
        plain = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                         question_index=1)
        await conn.execute("UPDATE monitoring_plans SET platform_mode = 'deep_reasoning' "
                           "WHERE question_id = %s AND ai_platform_id = %s",
                           (tenant["brands"][0]["question_ids"][0], platform))
        await conn.execute("UPDATE monitoring_collect_tasks t SET plan_id = pl.id FROM monitoring_plans pl "
                           "WHERE t.id = ANY(%s) AND pl.tenant_id = t.tenant_id AND pl.brand_id = t.brand_id "
                           "AND pl.question_id = t.question_id AND pl.ai_platform_id = t.ai_platform_id",
                           ([deep["monitor_task_id"], plain["monitor_task_id"]],))
    tasks = await lease(http, hub, token, max_tasks=2)
    modes = {t["task_id"]: t["platform"].get("mode") for t in tasks}  # no mode: the key is left out
    assert modes == {str(deep["task_id"]): "deep_reasoning", str(plain["task_id"]): None}
