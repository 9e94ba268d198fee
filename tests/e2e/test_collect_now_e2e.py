"""Collect-now end to end (issue 6 scenarios a-f, e2): real outbox-pump, dispatch-coordinator,
dispatch-hub, collect-now-api and ingest-shard-workers processes, Postgres, RabbitMQ, and simulated
desktop clients (tools.desktop_sim) over real WebSockets."""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import TaskAvailable, TaskControl
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from libs.domain.lanes import lane_weight
from libs.mq.topology import DISPATCH
from libs.outbox import enqueue
from tests.support.db import fetch as rows
from tests.support.db import one
from tests.support.desktop import dispatch_execution, insert_ready_task
from tests.support.stack import Stack, running_stack
from tests.support.tcpproxy import TcpProxy
from tests.support.wait import eventually
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions

FAST = TIMING_PROFILES["fast"]
# The hub flushes heartbeats and pings sockets often, so a client's coming and going shows quickly.
HUB_ENV: dict[str, str | int] = {"HUB_HEARTBEAT_FLUSH_S": "0.3", "HUB_PING_INTERVAL_S": "1"}

pytestmark = pytest.mark.timeout(120)


async def seed_world(pool: AsyncConnectionPool[Conn], *, clients: int = 2, tenants: int = 1,
                     scheduled: bool = True) -> dict[str, Any]:
    """Two brands: brand 0 has ready scheduled work (as the scanner leaves it), brand 1 is what the user
    collects now. Plans are not due, so the scanner stays out of the way."""
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=tenants, brands=2, questions=4, clients=clients, platforms=("openai",),
                               due=False)
        tenant = seed["tenants"][0]
        for index in range(3 if scheduled else 0):
            await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=index,
                                    platform_id=seed["platforms"][0]["ai_platform_id"], age_s=60 - index)
        # Room on the platform for several executions, so a client can hold queued scheduled work.
        await conn.execute("UPDATE platform_settings SET max_concurrent = 20")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1")
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000}.items():
            await set_setting(conn, key, value)
    return seed


def sim(stack: Stack, token: str, *, scale: float = 1.0, hub: str | None = None, **options: Any) -> SimClient:
    return SimClient(SimOptions(hub_url=hub or stack.hub_url, token=token, timings=FAST.scaled(scale),
                                heartbeat_interval_s=1.0, ws_ping_interval_s=2.0, idle_poll_s=1.0, seed=7,
                                **options))


async def test_a_c_e2_collect_now_preempts_a_busy_client(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                        tmp_path: Path) -> None:
    seed = await seed_world(pool)
    tenant = seed["tenants"][0]
    (a_id, a_token), (b_id, b_token) = [(c["client_id"], c["token"]) for c in tenant["clients"]]
    scheduled_brand, clicked_brand = (b["brand_id"] for b in tenant["brands"])
    async with pool.connection() as conn:
        # (c) client B has scheduled work of its own (queued for it already) ...
        b_work = await dispatch_execution(conn, tenant=tenant, platform_id=seed["platforms"][0]["ai_platform_id"],
                                          client_id=b_id, question_index=3)
        # ... and a publish task on the busy client A must not be touched either.
        publish_id = uuid.uuid4()
        await conn.execute(
            "INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, priority, lane, "
            "lane_weight, source) VALUES (%s, 'publish', %s, %s, %s, 12000, 'normal', %s, 'publish')",
            (publish_id, tenant["tenant_id"], tenant["workspace_id"], a_id, lane_weight("publish", "normal")))
    async with running_stack(settings, tmp_path, **HUB_ENV) as stack:
        # A alone is online while the scheduled work is dispatched, so it holds one running and two queued.
        busy = sim(stack, a_token, scale=12)   # ~3 s per scheduled task: long enough to be caught running
        other = sim(stack, b_token, scale=12)
        async with busy, contextlib.AsyncExitStack() as cleanup:
            cleanup.push_async_callback(other.stop)
            async def a_running_with_queue() -> bool:
                started = [t for t in busy.active_task_ids
                           if busy.active_phase(t) in ("AUTHENTICATING", "INPUTTING", "SUBMITTING", "WAITING")]
                queued = await rows(pool, "SELECT id FROM desktop_tasks WHERE target_client_id = %s AND "
                                          "status = 'queued' AND kind = 'monitor'", uuid.UUID(a_id))
                return bool(started) and bool(queued)

            await eventually(a_running_with_queue, timeout=30, interval=0.05,
                             message=f"client A running a scheduled task with more queued\n{stack.logs()}")
            await other.start()
            await eventually(lambda: bool(other.stats.leased), timeout=15, message="B working on its task")
            running_id = busy.active_task_ids[0]
            running_before = await one(pool, "SELECT monitor_task_id FROM desktop_tasks WHERE id = %s",
                                       uuid.UUID(running_id))
            business_before = await one(pool, "SELECT dispatch_attempts FROM monitoring_collect_tasks WHERE id = %s",
                                        running_before["monitor_task_id"])
            queued_before = {r["id"] for r in await rows(
                pool, "SELECT id FROM desktop_tasks WHERE target_client_id = %s AND status = 'queued' "
                      "AND kind = 'monitor'", uuid.UUID(a_id))}
            b_active_before = {r["id"] for r in await rows(
                pool, "SELECT id FROM desktop_tasks WHERE target_client_id = %s AND status IN "
                      "('queued', 'in_progress')", uuid.UUID(b_id))}
            executed_before = len(busy.stats.executed)

            accepted = await stack.collect_now(tenant, clicked_brand, {"target_client_id": a_id, "preempt": True})
            generation = accepted["interrupt_generation"]
            assert accepted["target_client_id"] == a_id
            assert accepted["aborted_queued_count"] == len(queued_before) and accepted["interrupt_requested_count"] == 1
            request_id = uuid.UUID(accepted["request_id"])

            async def request_done() -> bool:
                row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s", request_id)
                return row["status"] == "succeeded"

            await eventually(request_done, timeout=40, message=f"collect-now request succeeded\n{stack.logs()}")

            # (a) the running scheduled task yielded at a safe point with the click's generation.
            assert (running_id, generation) in busy.stats.aborted
            aborted = await one(pool, "SELECT status, interrupt_reason, execution_phase FROM desktop_tasks "
                                      "WHERE id = %s", uuid.UUID(running_id))
            assert aborted["status"] == "aborted" and aborted["interrupt_reason"] == "collect_now_preempt"
            # (a) its queued scheduled executions were cancelled at once.
            for row in await rows(pool, "SELECT status, interrupt_reason FROM desktop_tasks WHERE id = ANY(%s)",
                                  list(queued_before)):
                assert row == {"status": "aborted", "interrupt_reason": "collect_now_preempt"}
            # (a) the high tasks were leased and executed first, results accepted (202).
            after_click = busy.stats.executed[executed_before:]
            requested = len(tenant["brands"][1]["question_ids"])  # x 1 platform
            lanes = [lane for _, lane in after_click]
            assert lanes[:requested] == ["high"] * requested, lanes
            runs = await rows(pool, "SELECT status FROM question_monitor_runs WHERE brand_id = %s", clicked_brand)
            assert len(runs) == requested and all(r["status"] == "succeeded" for r in runs)
            assert await stack.metric("dispatch-hub", "monitor_preempt_success_count") >= 1
            assert await stack.metric("dispatch-hub", "monitor_preempt_latency_ms_count") >= 1

            # (c) the other client's work and the publish task were untouched.
            for row in await rows(pool, "SELECT status, interrupt_reason FROM desktop_tasks WHERE id = ANY(%s)",
                                  list(b_active_before)):
                assert row["interrupt_reason"] is None, row
            assert (await one(pool, "SELECT status FROM desktop_tasks WHERE id = %s", publish_id))["status"] == "queued"
            assert not [t for t, _ in other.stats.aborted]
            b_row = await one(pool, "SELECT interrupt_reason, status FROM desktop_tasks WHERE id = %s",
                              b_work["task_id"])
            assert b_row["interrupt_reason"] is None and b_row["status"] != "aborted"

            # (e2) the preempted scheduled task is completed later, its dispatch_attempts unchanged.
            async def preempted_completed() -> dict[str, Any] | None:
                row = await one(pool, "SELECT status, dispatch_attempts FROM monitoring_collect_tasks WHERE id = %s",
                                running_before["monitor_task_id"])
                return row if row["status"] == "completed" else None

            done = await eventually(preempted_completed, timeout=40,
                                    message=f"preempted task completed later\n{stack.logs()}")
            assert done["dispatch_attempts"] == business_before["dispatch_attempts"]
            assert scheduled_brand != clicked_brand


async def test_b_double_click_supersedes_and_the_old_generation_is_ignored(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    seed = await seed_world(pool, clients=1)
    tenant = seed["tenants"][0]
    a_id, a_token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    clicked = tenant["brands"][1]
    async with running_stack(settings, tmp_path, **HUB_ENV) as stack:
        busy = sim(stack, a_token, scale=20)   # WAITING lasts 2 s: both clicks land before the next safe point
        async with busy:
            async def waiting() -> bool:
                return any(busy.active_phase(t) == "WAITING" for t in busy.active_task_ids)

            await eventually(waiting, timeout=30, interval=0.02, message=f"a task in WAITING\n{stack.logs()}")
            running_id = busy.active_task_ids[0]
            first = await stack.collect_now(tenant, clicked["brand_id"],
                                               {"target_client_id": a_id, "question_ids": clicked["question_ids"][:1]})
            second = await stack.collect_now(tenant, clicked["brand_id"],
                                                {"target_client_id": a_id, "question_ids": clicked["question_ids"]})
            assert second["interrupt_generation"] == first["interrupt_generation"] + 1

            async def acknowledged() -> bool:
                return any(t == running_id for t, _ in busy.stats.aborted)

            await eventually(acknowledged, timeout=20, message=f"preempted task acknowledged\n{stack.logs()}")
            # Scale 20 was for the clicks to land while a task waits; the tasks the client takes from now on (the
            # second click's scope, one at a time) run at the fast profile's pace.
            busy.options.timings = FAST
            # Only the newest interrupt was honoured: the abort carries the second generation.
            assert (running_id, second["interrupt_generation"]) in busy.stats.aborted
            first_row = await one(pool, "SELECT status, superseded_by_request_id FROM monitoring_collect_requests "
                                        "WHERE id = %s", uuid.UUID(first["request_id"]))
            assert first_row == {"status": "superseded", "superseded_by_request_id": uuid.UUID(second["request_id"])}
            # A late copy of the first interrupt reaching the client is ignored by generation (§14.4).
            mismatches = busy.stats.interrupt_generation_mismatch_count
            async with pool.connection() as conn, conn.transaction():
                await enqueue(conn, exchange=DISPATCH, routing_key=f"monitor.control.{a_id}", notify=True,
                              ordering_key=f"client:{a_id}", tenant_id=tenant["tenant_id"], message=TaskControl(
                                  kind="monitor", task_id=uuid.UUID(running_id), target_client_id=uuid.UUID(a_id),
                                  control="interrupt_requested", reason="collect_now_preempt",
                                  interrupt_generation=first["interrupt_generation"], updated_at=datetime.now(UTC)))

            async def ignored() -> bool:
                return busy.stats.interrupt_generation_mismatch_count > mismatches

            await eventually(ignored, timeout=10, message="stale interrupt counted and ignored")

            async def second_done() -> bool:
                row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s",
                                uuid.UUID(second["request_id"]))
                return row["status"] == "succeeded"

            await eventually(second_done, timeout=40, message=f"second request succeeded\n{stack.logs()}")


async def test_d_disconnected_client_gets_the_event_on_reconnect(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                                tmp_path: Path) -> None:
    seed = await seed_world(pool, clients=1, scheduled=False)
    tenant = seed["tenants"][0]
    a_id, a_token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    async with running_stack(settings, tmp_path, **HUB_ENV) as stack:
        port = int(stack.hub_url.rsplit(":", 1)[1])
        proxy = TcpProxy("127.0.0.1", port)
        await proxy.start()
        client = sim(stack, a_token, hub=f"http://127.0.0.1:{proxy.port}", reconnect_max_s=0.5)
        try:
            async with client:
                await eventually(lambda: client.stats.hellos == 1, timeout=10, message="connected")
                await proxy.cut()

                async def offline() -> bool:
                    return (await one(pool, "SELECT online FROM desktop_clients WHERE id = %s",
                                      uuid.UUID(a_id)))["online"] is False

                await eventually(offline, timeout=10, message="hub saw the client go")
                # Dispatched while the client is away: the broker event finds no binding anywhere.
                async with pool.connection() as conn, conn.transaction():
                    platform_id = seed["platforms"][0]["ai_platform_id"]
                    ex = await dispatch_execution(conn, tenant=tenant, platform_id=platform_id, client_id=a_id,
                                                  lane="high", generation=0)
                    await enqueue(conn, exchange=DISPATCH, routing_key=f"monitor.high.{a_id}", notify=True,
                                  ordering_key=f"client:{a_id}", tenant_id=tenant["tenant_id"], message=TaskAvailable(
                                      kind="monitor", task_id=ex["task_id"], target_client_id=uuid.UUID(a_id),
                                      priority=5000, lane="high", updated_at=datetime.now(UTC),
                                      monitor_task_id=ex["monitor_task_id"]))

                async def published() -> bool:
                    row = await one(pool, "SELECT status FROM outbox WHERE routing_key = %s", f"monitor.high.{a_id}")
                    return row["status"] == "published"

                await eventually(published, timeout=10, message="event published while the client was away")
                assert str(ex["task_id"]) not in client.stats.event_arrivals
                await proxy.restore()   # the client's backoff loop reconnects by itself

                async def executed() -> bool:
                    return any(t == str(ex["task_id"]) for t, _ in client.stats.executed)

                await eventually(executed, timeout=20, message=f"replayed task executed\n{stack.logs()}")
                assert client.stats.connects >= 2 and client.stats.hellos >= 2
                replayed = [e for e in client.stats.events if e.get("task_id") == str(ex["task_id"])]
                assert replayed and replayed[0]["type"] == "task_available"
        finally:
            await proxy.close()


async def test_e_f_isolation_stale_leases_and_malformed_input(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                              tmp_path: Path) -> None:
    seed = await seed_world(pool, clients=1, tenants=2, scheduled=False)
    mine, theirs = seed["tenants"]
    token, their_token = mine["clients"][0]["token"], theirs["clients"][0]["token"]
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=mine, platform_id=seed["platforms"][0]["ai_platform_id"],
                                      client_id=mine["clients"][0]["client_id"])
    async with running_stack(settings, tmp_path, **HUB_ENV) as stack, aiohttp.ClientSession() as http:
        def bearer(value: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {value}"}

        # (e) tenant API: another tenant's JWT sees neither the brand nor the request.
        accepted = await stack.collect_now(mine, mine["brands"][1]["brand_id"], {"preempt": False})
        async with http.get(f"{stack.api_url}/api/tenant/monitoring/collect-requests/{accepted['request_id']}",
                            headers=bearer(stack.jwt(theirs))) as resp:
            assert resp.status in (403, 404) and "tasks" not in await resp.json()
        body = await stack.collect_now(theirs, mine["brands"][1]["brand_id"], {}, expect=(403, 404))
        # A problem names only the HTTP request's own id (its X-Request-Id), never a collect-now request.
        assert body["error"] == "not_found" and body["request_id"] != accepted["request_id"]
        assert body["instance"] == f"urn:monitoring-dispatch:request:{body['request_id']}"
        # (e) desktop API: another tenant's client token gets 404 and no data; a stale lease is refused.
        async def lease_once() -> list[dict[str, Any]] | None:
            """The lease, as a client makes it: a 503 (busy: it met the pass's lock on the client under load, or
            database_unavailable) is to be retried, anything else must be the answer."""
            async with http.post(f"{stack.hub_url}/api/desktop/monitor/lease", json={"max_tasks": 1},
                                 headers=bearer(token)) as resp:
                answer = await resp.json()
                if resp.status == 503:
                    return None
                assert resp.status == 200, (resp.status, answer)
                return list(answer["tasks"])

        (leased,) = await eventually(lease_once, message="a lease call answered 200")
        task_path = f"{stack.hub_url}/api/desktop/tasks/{leased['task_id']}"
        async with http.post(f"{task_path}/extend", json={"lease_token": leased["lease_token"]},
                             headers=bearer(their_token)) as resp:
            assert resp.status == 404 and (await resp.json())["error"] == "not_found"
        async with http.post(f"{task_path}/cancel", json={"lease_token": leased["lease_token"], "reason": "user",
                                                          "interrupt_generation": 0}, headers=bearer(token)) as resp:
            assert resp.status == 200
        for action, extra in (("extend", {}), ("result", {"status": "succeeded", "answer_text": "late"})):
            async with http.post(f"{task_path}/{action}", json={"lease_token": leased["lease_token"], **extra},
                                 headers=bearer(token)) as resp:
                assert resp.status == 409 and (await resp.json())["error"] == "stale_lease", action
        assert leased["task_id"] == str(ex["task_id"])
        # (f) malformed bodies name the field; malformed WebSocket events get an error event naming it.
        clicked_url = f"{stack.api_url}/api/tenant/monitoring/brands/{mine['brands'][1]['brand_id']}/collect-now"
        async with http.post(clicked_url, json={"keyword_id": "seven"}, headers=bearer(stack.jwt(mine))) as resp:
            assert resp.status == 400 and (await resp.json())["field"] == "keyword_id"
        async with http.post(f"{task_path}/result", json={"lease_token": "x", "status": "maybe"},
                             headers=bearer(token)) as resp:
            assert resp.status == 400 and (await resp.json())["field"] == "status"
        async with http.ws_connect(f"{stack.hub_url}/api/desktop/ws", headers=bearer(token)) as ws:
            assert msgspec.json.decode((await ws.receive(timeout=5)).data)["type"] == "hello"
            await ws.send_str('{"type": "heartbeat", "execution_phase": "DANCING"}')
            while True:
                event = msgspec.json.decode((await ws.receive(timeout=5)).data)
                if event["type"] == "error":
                    break
            assert event["field"] == "execution_phase"
        async with http.get(f"{stack.hub_url}/api/desktop/events", headers=bearer(token)) as resp:
            assert resp.status == 410
