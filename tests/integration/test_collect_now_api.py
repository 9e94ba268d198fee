"""collect-now-api against real Postgres: contract 4, docs/architecture.md §10, §13.1, §13.5, §15.3."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import LifecycleEvent
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn, connect
from libs.dispatch_settings import set_setting
from libs.telemetry import metrics
from tests.support.collect_now import (
    World,
    api_client,
    business_task,
    execution,
    fetch_all,
    fetch_one,
    gateway_token,
    make_world,
    set_online,
    today,
)
from tests.support.wait import eventually

Json = dict[str, Any]


def collect_path(brand_id: int | str) -> str:
    return f"/api/tenant/monitoring/brands/{brand_id}/collect-now"


def status_path(request_id: str) -> str:
    return f"/api/tenant/monitoring/collect-requests/{request_id}"


async def busy_client(conn: Conn, world: World, *, brand_index: int = 1) -> dict[str, Any]:
    """Scheduled work of another brand on client 0: two queued, one running; plus work that must stay."""
    tenant = world.tenant
    other = tenant["brands"][brand_index]
    day = await today(conn, world.tenant_id)
    client = world.client_id(0)
    ids = [await business_task(conn, tenant_id=world.tenant_id, brand_id=other["brand_id"], question_id=q,
                               ai_platform_id=p, business_date=day)
           for q in other["question_ids"] for p in world.platform_ids]
    queued = [await execution(conn, monitor_task_id=ids[0], client_id=client),
              await execution(conn, monitor_task_id=ids[1], client_id=client)]
    running = await execution(conn, monitor_task_id=ids[2], client_id=client, status="in_progress")
    retry_queued = await execution(conn, monitor_task_id=ids[3], client_id=client, source="retry_recovery",
                                   lane="retry")
    other_client = await execution(conn, monitor_task_id=ids[4], client_id=world.client_id(1))
    return {"business": ids, "queued": queued, "running": running, "retry_queued": retry_queued,
            "other_client": other_client}


async def test_collect_now_preempts_the_target_clients_scheduled_work(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=2, clients=2)
        await set_online(conn, world.client_id(1), heartbeat_age_s=40)  # stale: never chosen
        work = await busy_client(conn, world)
        day = await today(conn, world.tenant_id)
        brand = world.brand
        # The scanner already created two of the scope's six tasks: one pending, one completed earlier today.
        pending = await business_task(conn, tenant_id=world.tenant_id, brand_id=brand["brand_id"],
                                      question_id=brand["question_ids"][0], ai_platform_id=world.platform_ids[0],
                                      business_date=day)
        done = await business_task(conn, tenant_id=world.tenant_id, brand_id=brand["brand_id"],
                                   question_id=brand["question_ids"][1], ai_platform_id=world.platform_ids[1],
                                   business_date=day, status="completed", attempts=1)
    listener = await connect(settings.database_url)
    await listener.execute("LISTEN dispatch_wakeup")
    accepted_before = metrics.collect_now_accept_count.value()
    preempt_before = metrics.monitor_preempt_request_count.value()
    try:
        async with api_client(settings) as http:
            resp = await http.post(collect_path(world.brand_id), json={}, headers=world.auth())
            body = await resp.json()
            assert resp.status == 202, body
            wake = await anext(aiter(listener.notifies(timeout=5)))
            assert wake.channel == "dispatch_wakeup"
    finally:
        await listener.close()

    client = world.client_id(0)
    assert body["target_client_id"] == str(client)
    assert body["collection_mode"] == "desktop" and body["status"] == "accepted"
    assert (body["affected_task_count"], body["promoted_task_count"]) == (6, 6)
    assert (body["aborted_queued_count"], body["interrupt_requested_count"], body["interrupt_generation"]) == (2, 1, 1)
    assert body["idempotent_replay"] is False
    assert metrics.collect_now_accept_count.value() == accepted_before + 1
    assert metrics.monitor_preempt_request_count.value() == preempt_before + 1
    request_id = uuid.UUID(body["request_id"])

    async with pool.connection() as conn:
        # Queued scheduled executions cancelled, their dispatch attempt given back (a yield, not a failure).
        for task_id, business_id in zip(work["queued"], work["business"][:2], strict=True):
            row = await fetch_one(conn, "SELECT status, interrupt_reason, interrupt_generation, finished_at "
                                        "FROM desktop_tasks WHERE id = %s", task_id)
            assert row["status"] == "aborted" and row["interrupt_reason"] == "collect_now_preempt"
            assert row["interrupt_generation"] == 1 and row["finished_at"] is not None
            business = await fetch_one(conn, "SELECT status, dispatch_attempts, dispatch_lane "
                                              "FROM monitoring_collect_tasks WHERE id = %s", business_id)
            assert business == {"status": "pending", "dispatch_attempts": 0, "dispatch_lane": "normal"}
        # The running one is asked to yield with the new generation; it keeps running until its safe point.
        running = await fetch_one(conn, "SELECT status, control_flags, interrupt_generation, interrupted_at, "
                                        "interrupt_reason FROM desktop_tasks WHERE id = %s", work["running"])
        assert running["status"] == "in_progress" and running["interrupt_generation"] == 1
        replacement = running["control_flags"].pop("replacement_task_id")  # the high execution to come
        assert running["control_flags"] == {"interrupt_requested": True, "interrupt_generation": 1,
                                            "collect_request_id": str(request_id)}
        assert await fetch_one(conn, "SELECT count(*) AS n FROM monitoring_collect_tasks WHERE brand_id = %s "
                                     "AND next_execution_id = %s", world.brand_id, replacement) == {"n": 1}
        assert running["interrupted_at"] is not None and running["interrupt_reason"] == "collect_now_preempt"
        # Untouched: retry work on the client, and scheduled work on the other client.
        for untouched in (work["retry_queued"], work["other_client"]):
            row = await fetch_one(conn, "SELECT status, interrupt_generation, control_flags FROM desktop_tasks "
                                        "WHERE id = %s", untouched)
            assert row == {"status": "queued", "interrupt_generation": 0, "control_flags": {}}
        gen = await fetch_one(conn, "SELECT interrupt_generation FROM desktop_clients WHERE id = %s", client)
        assert gen["interrupt_generation"] == 1

        # Scope: six tasks, one row per business key, promoted in place; the four missing ones created manual.
        scope = await fetch_all(conn, "SELECT id, question_id, ai_platform_id, status, trigger_source, dispatch_lane, "
                                      "dispatch_priority, target_client_id, collect_request_id, interrupt_generation, "
                                      "execution_owner, dispatch_attempts, ingest_shard_key "
                                      "FROM monitoring_collect_tasks WHERE brand_id = %s ORDER BY id",
                                world.brand_id)
        assert len(scope) == 6
        assert len({(t["question_id"], t["ai_platform_id"]) for t in scope}) == 6
        assert {t["id"] for t in scope} >= {pending, done}
        assert sorted(t["trigger_source"] for t in scope) == ["automatic"] * 2 + ["manual"] * 4
        for task in scope:
            assert task["status"] == "pending" and task["dispatch_lane"] == "high"
            assert task["dispatch_priority"] == 5000 and task["target_client_id"] == client
            assert task["collect_request_id"] == request_id and task["interrupt_generation"] == 1
            assert task["execution_owner"] == "desktop_tasks" and task["dispatch_attempts"] == 0
            assert task["ingest_shard_key"] == f"{world.tenant_id}:{world.brand_id}:{day.isoformat()}"

        request = await fetch_one(conn, "SELECT *, ttl_expires_at - created_at AS ttl FROM monitoring_collect_requests")
        assert request["id"] == request_id and request["status"] == "accepted"
        assert request["requested_task_count"] == 6 and request["target_client_id"] == client
        assert request["aborted_queued_count"] == 2 and request["interrupt_requested_count"] == 1
        assert request["ttl"].total_seconds() == 300
        assert sorted(request["request_scope"]["monitor_task_ids"]) == sorted(t["id"] for t in scope)
        assert (request["request_scope"]["affected_task_count"], request["request_scope"]["created_task_count"]) == (
            6, 4)

        # Outbox: a TaskControl per cancelled / interrupted execution on the client's control key, and the
        # lifecycle event that wakes the coordinator.
        rows = await fetch_all(conn, "SELECT exchange, routing_key, message_type, payload, ordering_key, tenant_id "
                                     "FROM outbox ORDER BY id")
        controls = [r for r in rows if r["message_type"] == "task_control"]
        assert {(r["exchange"], r["routing_key"], r["ordering_key"], r["tenant_id"]) for r in controls} == {
            ("desktop.task.dispatch", f"monitor.control.{client}", f"client:{client}", world.tenant_id)}
        decoded = [msgspec.json.decode(bytes(r["payload"]), type=TaskControl) for r in controls]
        assert sorted((str(m.task_id), m.control) for m in decoded) == sorted(
            [(str(t), "cancelled") for t in work["queued"]] + [(str(work["running"]), "interrupt_requested")])
        assert all(m.interrupt_generation == 1 and m.collect_request_id == request_id
                   and m.reason == "collect_now_preempt" for m in decoded)
        lifecycle = [msgspec.json.decode(bytes(r["payload"]), type=LifecycleEvent) for r in rows
                     if r["message_type"] == "lifecycle"]
        assert [(e.event, e.collect_request_id, e.client_id, e.reason) for e in lifecycle] == [
            ("collect_now.accepted", request_id, client, "collect_now_preempt")]


async def test_double_click_supersedes_the_first_request(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=2, clients=2, keywords_per_brand=2)
        work = await busy_client(conn, world)
        await conn.execute("UPDATE desktop_clients SET interrupt_generation = 5 WHERE id = %s", (world.client_id(0),))
        await set_online(conn, world.client_id(1), heartbeat_age_s=60)
        await set_setting(conn, "max_active_requests_per_tenant", 1)
    async with api_client(settings) as http:
        first = await (await http.post(collect_path(world.brand_id), json={"keyword_id": world.brand["keyword_ids"][0]},
                                       headers=world.auth())).json()
        resp = await http.post(collect_path(world.brand_id), json={}, headers=world.auth())
        second = await resp.json()
    # The superseding request for the same client is not an extra active one, so limit 1 still lets it in.
    assert resp.status == 202, second
    assert (first["interrupt_generation"], second["interrupt_generation"]) == (6, 7)
    assert second["superseded_request_id"] == first["request_id"]
    assert (first["promoted_task_count"], second["promoted_task_count"]) == (3, 6)
    assert (first["aborted_queued_count"], second["aborted_queued_count"]) == (2, 0)
    # Re-marked with the newer generation: the client acts on 7 only, the interrupt of 6 is stale.
    assert (first["interrupt_requested_count"], second["interrupt_requested_count"]) == (1, 1)
    async with pool.connection() as conn:
        requests = {str(r["id"]): r for r in await fetch_all(conn, "SELECT * FROM monitoring_collect_requests")}
        assert requests[first["request_id"]]["status"] == "superseded"
        assert str(requests[first["request_id"]]["superseded_by_request_id"]) == second["request_id"]
        assert requests[first["request_id"]]["finished_at"] is not None
        assert requests[second["request_id"]]["status"] == "accepted"
        running = await fetch_one(conn, "SELECT interrupt_generation, control_flags FROM desktop_tasks WHERE id = %s",
                                  work["running"])
        assert running["interrupt_generation"] == 7
        assert running["control_flags"]["collect_request_id"] == second["request_id"]
        tasks = await fetch_all(conn, "SELECT collect_request_id, interrupt_generation, superseded_by_request_id "
                                      "FROM monitoring_collect_tasks WHERE brand_id = %s", world.brand_id)
        assert len(tasks) == 6
        assert {(str(t["collect_request_id"]), t["interrupt_generation"], t["superseded_by_request_id"])
                for t in tasks} == {(second["request_id"], 7, None)}
        controls = [msgspec.json.decode(bytes(r["payload"]), type=TaskControl) for r in await fetch_all(
            conn, "SELECT payload FROM outbox WHERE message_type = 'task_control' ORDER BY id")]
        assert [(c.control, c.interrupt_generation) for c in controls] == [
            ("cancelled", 6), ("cancelled", 6), ("interrupt_requested", 6), ("interrupt_requested", 7)]


async def test_the_same_click_within_the_window_is_an_idempotent_replay(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=2)
    async with api_client(settings) as http:
        body = {"keyword_id": world.brand["keyword_ids"][0],
                "question_ids": list(reversed(world.brand["question_ids"]))}
        replies = await asyncio.gather(*(http.post(collect_path(world.brand_id), json=body, headers=world.auth())
                                         for _ in range(4)))
        results = [(r.status, await r.json()) for r in replies]
        # The same scope in another order is the same scope.
        again = await http.post(collect_path(world.brand_id), headers=world.auth(),
                                json={**body, "question_ids": world.brand["question_ids"]})
        results.append((again.status, await again.json()))
        # Another user of the tenant is not a replay (and supersedes on the same client).
        other = await http.post(collect_path(world.brand_id), json=body, headers=world.auth(user_id=999))
        other_body = await other.json()
    assert sorted(status for status, _ in results) == [200, 200, 200, 200, 202]
    assert len({b["request_id"] for _, b in results}) == 1
    assert [b["idempotent_replay"] for s, b in results if s == 200] == [True] * 4
    assert all(b["interrupt_generation"] == 1 and b["promoted_task_count"] == 6 for _, b in results)
    assert other.status == 202 and other_body["request_id"] != results[0][1]["request_id"]
    assert other_body["interrupt_generation"] == 2
    async with pool.connection() as conn:
        rows = await fetch_all(conn, "SELECT requested_by_user_id FROM monitoring_collect_requests ORDER BY created_at")
        assert [r["requested_by_user_id"] for r in rows] == [world.tenant["user_id"], 999]
        lifecycle = await fetch_all(conn, "SELECT payload FROM outbox WHERE message_type = 'lifecycle' ORDER BY id")
        events = [msgspec.json.decode(bytes(r["payload"]), type=LifecycleEvent) for r in lifecycle]
        # Nothing was cancelled or interrupted: no preemption reason.
        assert [(e.event, e.reason) for e in events] == [("collect_now.accepted", None)] * 2
        # Outside the window it is a new request.
        await conn.execute("UPDATE monitoring_collect_requests SET created_at = created_at - interval '6 minutes'")
    async with api_client(settings) as http:
        late = await http.post(collect_path(world.brand_id), json=body, headers=world.auth())
        assert late.status == 202 and (await late.json())["idempotent_replay"] is False
        # Within the window, the same user and brand with another scope is a new request too.
        narrower = await http.post(collect_path(world.brand_id), headers=world.auth(),
                                   json={**body, "question_ids": world.brand["question_ids"][:1]})
        assert narrower.status == 202 and (await narrower.json())["idempotent_replay"] is False
        replayed = await http.post(collect_path(world.brand_id), headers=world.auth(),
                                   json={**body, "question_ids": world.brand["question_ids"][:1]})
        assert replayed.status == 200
        assert (await replayed.json())["request_id"] == (await narrower.json())["request_id"]


async def test_replay_when_the_database_is_on_another_day_than_the_api(settings: Settings, pool) -> None:
    """READS is given the scope hashes of the dates the API expects; a business date outside them (clocks a day
    apart) is read again with its own hash, so the second click is still the first one's replay."""
    from datetime import UTC, datetime

    from tests.support.clock import FakeClock

    far_from_today = FakeClock(now=datetime(2000, 1, 3, 12, tzinfo=UTC))  # expects 2000-01-01 to 2000-01-05
    async with pool.connection() as conn:
        world = await make_world(conn, questions=2)
    async with api_client(settings, clock=far_from_today) as http:
        body = {"question_ids": world.brand["question_ids"][:1]}
        first = await http.post(collect_path(world.brand_id), json=body, headers=world.auth())
        second = await http.post(collect_path(world.brand_id), json=body, headers=world.auth())
        assert (first.status, second.status) == (202, 200)
        assert (await second.json())["request_id"] == (await first.json())["request_id"]


async def test_rate_limits_answer_429_with_a_reason(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, online=False, questions=3, keywords_per_brand=3)
        await set_setting(conn, "max_active_requests_per_tenant", 1)
    keywords = world.brand["keyword_ids"]
    async with api_client(settings) as http:
        first = await http.post(collect_path(world.brand_id), json={"keyword_id": keywords[0]}, headers=world.auth())
        assert first.status == 202
        limited = await http.post(collect_path(world.brand_id), json={"keyword_id": keywords[1]},
                                  headers=world.auth())
        body = await limited.json()
        assert limited.status == 429
        assert body["error"] == "too_many_active_requests" and 290 <= body["retry_after_s"] <= 300
        async with pool.connection() as conn:
            await set_setting(conn, "max_active_requests_per_tenant", 10)
            await set_setting(conn, "max_requests_per_user_per_hour", 2)
        await http.app[_settings_cache_key()].reload()
        second = await http.post(collect_path(world.brand_id), json={"keyword_id": keywords[1]}, headers=world.auth())
        assert second.status == 202
        third = await http.post(collect_path(world.brand_id), json={"keyword_id": keywords[2]}, headers=world.auth())
        body = await third.json()
        assert third.status == 429
        assert body["error"] == "too_many_requests" and 3500 <= body["retry_after_s"] <= 3600
        # A replay is never rate limited.
        replay = await http.post(collect_path(world.brand_id), json={"keyword_id": keywords[0]}, headers=world.auth())
        assert replay.status == 200
    async with pool.connection() as conn:
        assert len(await fetch_all(conn, "SELECT 1 FROM monitoring_collect_requests")) == 2


def _settings_cache_key() -> Any:
    from services.collect_now_api.handlers import SETTINGS_CACHE
    return SETTINGS_CACHE


async def test_no_online_client_accepts_the_request_unbound(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, online=False, questions=1, clients=1)
        await set_online(conn, world.client_id(0), heartbeat_age_s=31)  # online flag, but heartbeat too old
    async with api_client(settings) as http:
        resp = await http.post(collect_path(world.brand_id), json={"target_client_id": str(world.client_id(0))},
                               headers=world.auth())
        body = await resp.json()
        status = await (await http.get(status_path(body["request_id"]), headers=world.auth())).json()
    assert resp.status == 202
    assert body["target_client_id"] is None and body["interrupt_generation"] == 0
    assert body["promoted_task_count"] == 3 and "no desktop client is online" in body["message"]
    assert status["status"] == "accepted" and status["target_client_id"] is None
    assert status["ttl_remaining_ms"] > 290_000 and status["started"] is False
    async with pool.connection() as conn:
        tasks = await fetch_all(conn, "SELECT dispatch_lane, target_client_id, trigger_source "
                                      "FROM monitoring_collect_tasks")
        assert tasks == [{"dispatch_lane": "high", "target_client_id": None, "trigger_source": "manual"}] * 3
        assert await fetch_all(conn, "SELECT 1 FROM outbox WHERE message_type = 'task_control'") == []
        gen = await fetch_one(conn, "SELECT interrupt_generation FROM desktop_clients")
        assert gen["interrupt_generation"] == 0


async def test_target_client_choice(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, tenants=2, questions=1, clients=3)
        busy, free, logged_out = world.client_id(0), world.client_id(1), world.client_id(2)
        await set_online(conn, logged_out, platform_health='{"openai": "login_required", "gemini": "captcha"}')
        await set_online(conn, free, platform_health='{"openai": "healthy", "gemini": "login_required"}')
        day = await today(conn, world.tenant_id)
        other_brand = world.brand
        task = await business_task(conn, tenant_id=world.tenant_id, brand_id=other_brand["brand_id"],
                                   question_id=other_brand["question_ids"][0], ai_platform_id=world.platform_ids[0],
                                   business_date=day)
        await execution(conn, monitor_task_id=task, client_id=busy, status="in_progress", source="collect_now",
                        lane="high")
        foreign_client = uuid.UUID(world.seed["tenants"][1]["clients"][0]["client_id"])
    async with api_client(settings) as http:
        best = await (await http.post(collect_path(world.brand_id), json={"preempt": False},
                                      headers=world.auth())).json()
        assert best["target_client_id"] == str(free)  # most free capacity among the healthy ones
        explicit = await (await http.post(collect_path(world.brand_id), json={
            "target_client_id": str(busy), "ai_platform_ids": world.platform_ids[:1]}, headers=world.auth())).json()
        assert explicit["target_client_id"] == str(busy)
        # Another tenant's client is never used (nor revealed): the caller's best client is chosen instead.
        foreign = await (await http.post(collect_path(world.brand_id), json={
            "target_client_id": str(foreign_client), "ai_platform_ids": world.platform_ids[1:2]},
            headers=world.auth())).json()
        assert foreign["target_client_id"] == str(free)
        assert "requested client is not available" in foreign["message"]
    async with pool.connection() as conn:
        gens = await fetch_one(conn, "SELECT interrupt_generation FROM desktop_clients WHERE id = %s", foreign_client)
        assert gens["interrupt_generation"] == 0


async def test_another_tenants_token_gets_404_and_no_data(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, tenants=2, questions=1)
    async with api_client(settings) as http:
        mine = await (await http.post(collect_path(world.brand_id), json={}, headers=world.auth())).json()
        foreign_post = await http.post(collect_path(world.brand_id), json={}, headers=world.auth(tenant_index=1))
        foreign_get = await http.get(status_path(mine["request_id"]), headers=world.auth(tenant_index=1))
        unknown = await http.get(status_path(str(uuid.uuid4())), headers=world.auth())
        no_token = await http.post(collect_path(world.brand_id), json={})
        bad_token = await http.get(status_path(mine["request_id"]), headers={"Authorization": "Bearer not.a.jwt"})
        wrong_key = gateway_token(world.principal(), "another-secret-of-at-least-32-bytes!")
        forged = await http.get(status_path(mine["request_id"]), headers={"Authorization": f"Bearer {wrong_key}"})
        expired_token = gateway_token(world.principal(), ttl_s=-60)  # past the leeway
        expired = await http.get(status_path(mine["request_id"]), headers={"Authorization": f"Bearer {expired_token}"})
        foreign_post_body = await foreign_post.text()
        foreign_get_body = await foreign_get.text()
        for resp in (no_token, bad_token, forged, expired):
            assert resp.status == 401
            assert (await resp.json())["error"] in {"unauthorized", "invalid_token", "token_expired"}
        assert (await expired.json())["error"] == "token_expired"
    assert foreign_post.status == 404 and foreign_get.status == 404 and unknown.status == 404
    assert mine["request_id"] not in foreign_get_body
    # The problem names the brand, never the tenant (its own request id, a random UUID, and status left aside).
    foreign_problem = msgspec.json.decode(foreign_post_body)
    told = msgspec.json.encode({k: v for k, v in foreign_problem.items()
                                if k not in ("request_id", "instance", "status")}).decode()
    assert "brand" in told and str(world.tenant_id) not in told
    async with pool.connection() as conn:
        requests = await fetch_all(conn, "SELECT tenant_id FROM monitoring_collect_requests")
        assert requests == [{"tenant_id": world.tenant_id}]
        other_tenant_tasks = await fetch_all(conn, "SELECT 1 FROM monitoring_collect_tasks WHERE tenant_id = %s",
                                             world.seed["tenants"][1]["tenant_id"])
        assert other_tenant_tasks == []


@pytest.mark.parametrize(("body", "field", "code"), [
    (b"{not json", None, "invalid_json"),
    (b'{"keyword_id": "abc"}', "keyword_id", "invalid_field"),
    (b'{"keyword_id": -3}', "keyword_id", "invalid_field"),
    (b'{"preempt": "yes"}', "preempt", "invalid_field"),
    (b'{"target_client_id": "not-a-uuid"}', "target_client_id", "invalid_field"),
    (b'{"question_ids": []}', "question_ids", "invalid_field"),
    (b'{"question_ids": [1, "x"]}', "question_ids[1]", "invalid_field"),
    (b'[1, 2]', None, "invalid_field"),
])
async def test_malformed_bodies_get_400_naming_the_field(settings: Settings, pool, body: bytes, field: str | None,
                                                         code: str) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=1)
    async with api_client(settings) as http:
        resp = await http.post(collect_path(world.brand_id), data=body,
                               headers={**world.auth(), "Content-Type": "application/json"})
        reply = await resp.json()
    assert resp.status == 400, reply
    assert reply["error"] == code and reply.get("field") == field
    async with pool.connection() as conn:
        assert await fetch_all(conn, "SELECT 1 FROM monitoring_collect_requests") == []


async def test_fields_that_do_not_fit_the_brand_and_oversize_bodies(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, tenants=2, brands=2, questions=1)
    other_brand = world.tenant["brands"][1]
    other_tenants_brand = world.seed["tenants"][1]["brands"][0]
    async with api_client(settings) as http:
        # Well-formed, naming something that is not there (another brand's, another tenant's, none): 404, not 400.
        cases = [
            ({"keyword_id": other_brand["keyword_ids"][0]}, "keyword_id"),
            ({"keyword_id": other_tenants_brand["keyword_ids"][0]}, "keyword_id"),
            ({"question_ids": other_brand["question_ids"]}, "question_ids"),
            ({"question_ids": other_tenants_brand["question_ids"]}, "question_ids"),
            ({"ai_platform_ids": [999_999]}, "ai_platform_ids"),
        ]
        for body, field in cases:
            resp = await http.post(collect_path(world.brand_id), json=body, headers=world.auth())
            problem = await resp.json()
            assert (resp.status, problem["error"], problem.get("field")) == (404, "not_found", field), problem
            assert resp.content_type == "application/problem+json" and problem["status"] == 404
        bad_path = await http.post(collect_path("abc"), json={}, headers=world.auth())
        assert (bad_path.status, (await bad_path.json())["field"]) == (400, "brand_id")
        bad_id = await http.get(status_path("nope"), headers=world.auth())
        assert (bad_id.status, (await bad_id.json())["field"]) == (400, "request_id")
        huge = await http.post(collect_path(world.brand_id), data=b'{"question_ids": [' + b"1, " * 40_000 + b"1]}",
                               headers={**world.auth(), "Content-Type": "application/json"})
        assert huge.status == 413 and (await huge.json())["error"] == "payload_too_large"
        empty = await http.post(collect_path(world.brand_id), headers=world.auth())  # no body: the defaults
        assert empty.status == 202


async def test_request_status_reports_progress(settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=2, clients=2)
        await busy_client(conn, world)
    async with api_client(settings) as http:
        accepted = await (await http.post(collect_path(world.brand_id), json={
            "ai_platform_ids": world.platform_ids[:2], "question_ids": world.brand["question_ids"][:1],
            "target_client_id": str(world.client_id(0))},
                                          headers=world.auth())).json()
        before = await (await http.get(status_path(accepted["request_id"]), headers=world.auth())).json()
        async with pool.connection() as conn:
            # As the coordinator and hub would: one task dispatched and leased, the request running.
            task_ids = [r["id"] for r in await fetch_all(
                conn, "SELECT id FROM monitoring_collect_tasks WHERE collect_request_id = %s ORDER BY id",
                uuid.UUID(accepted["request_id"]))]
            await execution(conn, monitor_task_id=task_ids[0], client_id=world.client_id(0), status="in_progress",
                            source="collect_now", lane="high", phase="INPUTTING",
                            collect_request_id=uuid.UUID(accepted["request_id"]))
            await conn.execute("UPDATE monitoring_collect_requests SET status = 'running', dispatched_task_count = 1, "
                               "first_dispatched_at = now()")
        after = await (await http.get(status_path(accepted["request_id"]), headers=world.auth())).json()
    assert before["status"] == "accepted" and before["preempted"] is True and before["started"] is False
    assert before["requested_task_count"] == 2 and before["aborted_queued_count"] == 2
    assert before["interrupt_requested_count"] == 1 and before["first_dispatched_at"] is None
    assert 0 < before["ttl_remaining_ms"] <= 300_000
    assert [(t["status"], t["lane"], t["execution_status"]) for t in before["tasks"]] == [("pending", "high", None)] * 2
    assert after["status"] == "running" and after["started"] is True and after["first_dispatched_at"] is not None
    assert (after["tasks"][0]["execution_status"], after["tasks"][0]["execution_phase"]) == ("in_progress", "INPUTTING")
    assert after["tasks"][1]["execution_status"] is None


async def test_wait_for_first_dispatch_returns_once_the_coordinator_dispatched(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=1)
    async with api_client(settings) as http:
        click = asyncio.create_task(http.post(collect_path(world.brand_id), json={"wait_for_first_dispatch": True},
                                              headers=world.auth()))

        async def request_row() -> list[dict[str, Any]]:
            async with pool.connection() as conn:
                return await fetch_all(conn, "SELECT id FROM monitoring_collect_requests")

        await eventually(request_row, message="the request committed")
        assert not click.done()  # still waiting for the dispatch
        async with pool.connection() as conn:  # as the coordinator does (contract 2)
            await conn.execute("UPDATE monitoring_collect_requests SET status = 'dispatching', "
                               "dispatched_task_count = 1, first_dispatched_at = now()")
        resp = await asyncio.wait_for(click, 10)
        body = await resp.json()
    assert resp.status == 202 and body["status"] == "dispatching"


async def test_a_burst_from_one_tenant_answers_429_and_never_blocks_another_tenant(settings: Settings, pool) -> None:
    """The tenant's lock is waited for a second at most, and a tenant has at most two clicks in flight per
    process (more wait for a turn without a connection): a burst answers 429 `tenant_busy` while another
    tenant's click goes through at once."""
    async with pool.connection() as conn:
        world = await make_world(conn, tenants=2, brands=2, questions=1)
    holder = await connect(settings.database_url)
    try:
        # Another replica's click of tenant 0, stuck inside its transaction, holds the tenant's lock.
        await holder.execute("BEGIN")
        await holder.execute("SELECT pg_advisory_xact_lock(hashtextextended('collect_now.tenant:' || %s::text, 0))",
                             (str(world.tenant_id),))
        async with api_client(settings) as http:
            brands = [b["brand_id"] for b in world.tenant["brands"]]
            burst = [http.post(collect_path(brands[i % 2]), json={"keyword_id": None}, headers=world.auth())
                     for i in range(4)]
            other = world.seed["tenants"][1]
            other_click = http.post(collect_path(other["brands"][0]["brand_id"]), json={}, headers=world.auth(1))
            answers = await asyncio.gather(*burst, other_click)
            codes = [(r.status, (await r.json()).get("error")) for r in answers]
        # two waited a second for the lock, the other two a second for their turn (without a connection), then the lock
        assert sorted(codes[:4]) == [(429, "tenant_busy")] * 4, codes
        assert codes[4] == (202, None), codes
    finally:
        await holder.close()
    async with pool.connection() as conn:
        rows = await fetch_all(conn, "SELECT count(*) AS n FROM monitoring_collect_requests WHERE tenant_id = %s",
                               world.tenant_id)
    assert rows[0]["n"] == 0


async def test_the_tenant_gate_and_lock_wait_follow_their_settings(settings: Settings, pool) -> None:
    """COLLECT_NOW_TENANT_MAX_IN_FLIGHT, COLLECT_NOW_TENANT_WAIT_MS and COLLECT_NOW_LOCK_WAIT_MS, read at start-up:
    one click in flight and a 100 ms turn, so of two concurrent clicks one waits for the (held) tenant lock and the
    other gives up waiting for its turn; then a 50 ms lock wait answers well before the default second."""
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=1)
    holder = await connect(settings.database_url)
    try:
        await holder.execute("BEGIN")
        await holder.execute("SELECT pg_advisory_xact_lock(hashtextextended('collect_now.tenant:' || %s::text, 0))",
                             (str(world.tenant_id),))
        brands = [b["brand_id"] for b in world.tenant["brands"]]
        one_at_a_time = replace(settings, collect_now_tenant_max_in_flight=1, collect_now_tenant_wait_ms=100,
                                collect_now_lock_wait_ms=600)
        async with api_client(one_at_a_time) as http:
            answers = await asyncio.gather(*(http.post(collect_path(b), json={}, headers=world.auth()) for b in brands))
            bodies = [(r.status, await r.json()) for r in answers]
        assert all(status == 429 and body["error"] == "tenant_busy" for status, body in bodies), bodies
        assert sorted("holds its lock" in body["message"] for _, body in bodies) == [False, True], bodies
        async with api_client(replace(settings, collect_now_lock_wait_ms=50)) as http:
            started = time.monotonic()
            async with http.post(collect_path(brands[0]), json={}, headers=world.auth()) as resp:
                body = await resp.json()
            waited = time.monotonic() - started
        assert resp.status == 429 and "holds its lock" in body["message"], body
        assert waited < 0.9, waited  # the default would have waited a whole second for the lock
    finally:
        await holder.close()


async def test_a_click_after_the_database_dropped_the_pools_connections_is_accepted(settings: Settings,
                                                                                   pool) -> None:
    """A restart, failover or terminated backends leave collect-now-api's pool holding dead connections: the click
    that meets one retries on a fresh connection (the pool's idle ones checked first) and is accepted once."""
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=1)
    brands = [b["brand_id"] for b in world.tenant["brands"]]
    async with api_client(settings) as http:
        first = await http.post(collect_path(brands[0]), json={}, headers=world.auth())
        assert first.status == 202, await first.text()
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity "
                                     "WHERE datname = current_database() AND application_name = 'collect-now-api'")
            killed = await cur.fetchone()
        assert killed is not None and killed["n"] >= 1
        second = await http.post(collect_path(brands[1]), json={}, headers=world.auth())
        body = await second.json()
        assert second.status == 202 and body["status"] == "accepted", body
    async with pool.connection() as conn:
        rows = await fetch_all(conn, "SELECT brand_id, count(*) AS n FROM monitoring_collect_requests "
                                     "WHERE tenant_id = %s GROUP BY brand_id ORDER BY brand_id", world.tenant_id)
    assert rows == [{"brand_id": brands[0], "n": 1}, {"brand_id": brands[1], "n": 1}]
