"""Collect-now latency through the whole chain, with real processes:

click (HTTP POST collect-now) -> collect-now-api transaction (outbox row + NOTIFY) -> coordinator
dispatch (woken by NOTIFY) -> outbox-pump -> RabbitMQ -> dispatch-hub -> `task_available` on the
target client's WebSocket -> pull-lease. Measured idle, and with 50 simulated clients connected and
working through a 10,000-task normal backlog.

    .venv/bin/python -m bench collect_now            (--quick for a smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import msgspec

from bench.common import bench_environment, summary
from libs.config import Settings
from libs.contracts.wire import TaskAvailable
from libs.db.pool import connect
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from libs.mq.topology import Topology
from tests.support.stack import DISPATCH_SERVICES, Stack, running_stack
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions

JWT_SECRET = "bench-collect-now-gateway-secret-0123456789"

_BACKLOG = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner, enqueued_at)
SELECT q.tenant_id, b.workspace_id, q.brand_id, q.id, tp.ai_platform_id, d::date, 'pending', 100, 'normal',
       q.tenant_id || ':' || q.brand_id || ':' || d::date, 'desktop_tasks', now() - random() * interval '1 hour'
FROM monitoring_questions q
JOIN brands b ON b.id = q.brand_id
JOIN tenant_platforms tp ON tp.tenant_id = q.tenant_id
CROSS JOIN generate_series(current_date - %(days)s + 1, current_date, interval '1 day') d
WHERE q.tenant_id = ANY(%(tenants)s)
ON CONFLICT DO NOTHING
"""


async def _prepare(settings: Settings, *, clicks: int, load: bool) -> dict[str, Any]:
    conn = await connect(settings.database_url)
    try:
        probe = await seed_demo(conn, tenants=1, brands=1, questions=clicks, clients=1, platforms=("openai",),
                                due=False)
        background: dict[str, Any] = {"tenants": []}
        if load:
            background = await seed_demo(conn, tenants=10, brands=1, questions=10, clients=5, due=False)
            tenants = [t["tenant_id"] for t in background["tenants"]]
            cur = await conn.execute(_BACKLOG, {"tenants": tenants, "days": 34})
            print(f"  backlog: {cur.rowcount} ready normal tasks across {len(tenants)} tenants", flush=True)
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1000, max_queue_depth = 1000 "
                           "WHERE tenant_id = %s", (probe["tenants"][0]["tenant_id"],))
        await conn.execute("UPDATE platform_settings SET max_concurrent = 1000")
        for key, value in {"max_active_requests_per_tenant": 10_000, "max_requests_per_user_per_hour": 10_000,
                           "cluster_dispatch_per_minute": 20_000, "tenant_dispatch_per_minute": 300}.items():
            await set_setting(conn, key, value)
    finally:
        await conn.close()
    return {"probe": probe["tenants"][0], "background": background}


async def _measure(settings: Settings, stack: Stack, world: dict[str, Any],
                   clicks: int) -> tuple[list[float], list[float]]:
    probe = world["probe"]
    client = probe["clients"][0]
    brand = probe["brands"][0]
    jwt = stack.jwt(probe)
    hub, api = stack.hub_url, stack.api_url
    to_socket: list[float] = []
    to_lease: list[float] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(
            f"{hub}/api/desktop/ws", headers={"Authorization": f"Bearer {client['token']}"}) as ws:
        assert msgspec.json.decode((await ws.receive()).data)["type"] == "hello"
        for question_id in brand["question_ids"][:clicks]:
            clicked = time.perf_counter()
            async with http.post(f"{api}/api/tenant/monitoring/brands/{brand['brand_id']}/collect-now",
                                 json={"target_client_id": client["client_id"], "question_ids": [question_id]},
                                 headers={"Authorization": f"Bearer {jwt}"}) as resp:
                assert resp.status in (200, 201, 202), await resp.text()
            while True:
                event = msgspec.json.decode((await ws.receive(timeout=10)).data)
                if event.get("type") == "task_available" and event.get("lane") == "high":
                    break
            to_socket.append((time.perf_counter() - clicked) * 1000)
            async with http.post(f"{hub}/api/desktop/monitor/lease", json={"max_tasks": 1},
                                 headers={"Authorization": f"Bearer {client['token']}"}) as resp:
                tasks = (await resp.json())["tasks"]
            to_lease.append((time.perf_counter() - clicked) * 1000)
            for task in tasks:
                async with http.post(f"{hub}/api/desktop/tasks/{task['task_id']}/result", json={
                        "lease_token": task["lease_token"], "status": "succeeded", "answer_text": "bench"},
                        headers={"Authorization": f"Bearer {client['token']}"}) as resp:
                    assert resp.status == 202
            await asyncio.sleep(0.05)  # clicks are human-paced; keep them apart
        hub_hop = await _hub_hop(settings, ws, client["client_id"], samples=max(clicks, 50))
    print(f"  hub hop (broker publish -> socket, ms): {summary(hub_hop)}", flush=True)
    return to_socket, to_lease


async def _hub_hop(settings: Settings, ws: aiohttp.ClientWebSocketResponse, client_id: str, *,
                   samples: int) -> list[float]:
    """The hub's own share: an event published straight to the dispatch exchange -> on the socket."""
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    connection = await aio_pika.connect_robust(settings.amqp_url)
    hops: list[float] = []
    try:
        channel = await connection.channel()
        exchange = await channel.get_exchange(topology.dispatch_exchange)
        for _ in range(samples):
            event = TaskAvailable(kind="monitor", task_id=uuid.uuid4(), target_client_id=uuid.UUID(client_id),
                                  priority=5000, lane="high", updated_at=datetime.now(UTC))
            sent = time.perf_counter()
            await exchange.publish(aio_pika.Message(msgspec.json.encode(event)),
                                   routing_key=f"monitor.high.{client_id}")
            while True:
                received = msgspec.json.decode((await ws.receive(timeout=10)).data)
                if received.get("task_id") == str(event.task_id):
                    break
            hops.append((time.perf_counter() - sent) * 1000)
    finally:
        await connection.close()
    return hops


_BREAKDOWN = """
SELECT
  (SELECT array_agg(extract(epoch FROM first_dispatched_at - created_at) * 1000)
   FROM monitoring_collect_requests WHERE tenant_id = %(tenant)s AND first_dispatched_at IS NOT NULL) AS to_dispatch,
  (SELECT array_agg(extract(epoch FROM published_at - created_at) * 1000)
   FROM outbox WHERE tenant_id = %(tenant)s AND routing_key LIKE 'monitor.high.%%' AND published_at IS NOT NULL)
   AS to_publish
"""


async def _breakdown(settings: Settings, name: str, tenant_id: int) -> None:
    """Where the time goes: click -> coordinator dispatch (request row), dispatch commit -> broker confirm."""
    conn = await connect(settings.database_url)
    try:
        cur = await conn.execute(_BREAKDOWN, {"tenant": tenant_id})
        row = await cur.fetchone()
    finally:
        await conn.close()
    if row and row["to_dispatch"]:
        values = [float(v) for v in row["to_dispatch"]]
        print(f"  {name}: click -> dispatched by the coordinator (ms): {summary(values)}", flush=True)
    if row and row["to_publish"]:
        values = [float(v) for v in row["to_publish"]]
        print(f"  {name}: dispatch -> published by the pump (ms):      {summary(values)}", flush=True)


async def _scenario(name: str, *, clicks: int, load: bool) -> None:
    async with bench_environment(shards=16) as base:
        settings = replace(base, gateway_jwt_secret=JWT_SECRET)
        print(f"  {name}: preparing data", flush=True)
        world = await _prepare(settings, clicks=clicks, load=load)
        print(f"  {name}: starting {', '.join(DISPATCH_SERVICES)}", flush=True)
        with tempfile.TemporaryDirectory() as logs:
            async with running_stack(settings, Path(logs), DB_POOL_MAX=6) as stack:
                await _run_scenario(name, stack, world, clicks=clicks, load=load)


async def _run_scenario(name: str, stack: Stack, world: dict[str, Any], *, clicks: int, load: bool) -> None:
    settings = stack.settings
    fleet: list[SimClient] = []
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        if load:
            # Realistic desktop pacing (a task takes seconds), so the load is the backlog, the
            # dispatching and 50 sockets, not a CPU-bound simulator sharing the benchmark's cores.
            timings = TIMING_PROFILES["demo"].scaled(0.5)
            for tenant in world["background"]["tenants"]:
                for c in tenant["clients"]:
                    fleet.append(SimClient(SimOptions(hub_url=stack.hub_url, token=c["token"],
                                                      timings=timings), session=session))
            for sim in fleet:
                await sim.start()
            await asyncio.sleep(5)  # let the fleet connect and dispatch reach its steady state
        try:
            to_socket, to_lease = await _measure(settings, stack, world, clicks)
        except TimeoutError:
            for service in ("dispatch-coordinator", "collect-now-api"):
                print(f"----- {service} log tail\n{stack.procs[service].logs()[-3000:]}")
            raise
        print(f"  {name}: click -> task_available on the socket (ms): {summary(to_socket)}", flush=True)
        print(f"  {name}: click -> lease (ms):                        {summary(to_lease)}", flush=True)
        await _breakdown(settings, name, world["probe"]["tenant_id"])
        if load:
            connected = sum(1 for sim in fleet if sim.connected.is_set())
            executed = sum(len(sim.stats.executed) for sim in fleet)
            print(f"  {name}: {connected} clients connected; they executed {executed} normal tasks meanwhile",
                  flush=True)
    finally:
        await asyncio.gather(*(sim.stop() for sim in fleet), return_exceptions=True)
        await session.close()


async def run(args: argparse.Namespace) -> None:
    clicks = 15 if args.quick else 100
    await _scenario("idle", clicks=clicks, load=False)
    await _scenario("50 clients + 10k backlog", clicks=clicks, load=True)
