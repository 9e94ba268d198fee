"""Collect-now latency through the whole chain, with real processes:

click (HTTP POST collect-now) -> collect-now-api transaction (outbox row + NOTIFY) -> coordinator
dispatch (woken by NOTIFY; it publishes its own high event after its commit, or an outbox-pump does)
-> RabbitMQ -> dispatch-hub -> `task_available` on the target client's WebSocket -> pull-lease. Measured
idle, and with 50 simulated clients connected and working through a 10,000-task normal backlog.

    .venv/bin/python -m bench collect_now            (--quick for a smoke run)
    .venv/bin/python -m bench collect_now --tracing  (every service traces 100% into a local trace sink)
    .venv/bin/python -m bench collect_now --legacy   (the clicking tenant on the legacy path: rollout 0, so its
                                                      clicks create legacy tasks, offered and leased on the business
                                                      row; the background fleet's backlog stays on desktop_tasks)
    .venv/bin/python -m bench collect_now --push     (each scenario twice, back to back: the probe pulls, then it
                                                      asks for push-lease and its task_available carries the lease;
                                                      push-lease on in the services both times, the fleet pulls)

Per click: -> task_available on the socket; -> lease in hand (pull: the lease call's answer; push: the event itself);
-> running (the first extend, NAVIGATING, answered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import aio_pika
import aiohttp
import msgspec

from bench.common import bench_environment, summary
from libs.config import Settings
from libs.contracts.wire import CAPABILITIES_HEADER, PUSH_LEASE, TaskAvailable
from libs.db.pool import Conn, connect
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from libs.mq.hub_routing import hub_routing_key
from libs.mq.topology import Topology
from tests.support.procs import die_with_parent, free_port
from tests.support.stack import DISPATCH_SERVICES, Stack, running_stack

JWT_SECRET = "bench-collect-now-gateway-secret-0123456789"
PUSH_ENV = {"PUSH_LEASE_ENABLED": "1", "PUSH_LEASE_SECRET": "bench-push-lease-secret-0123456789abcdef"}

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


async def open_limits_for_probe(conn: Conn, probe_tenant_id: int) -> None:
    """Limits out of the probe's way (its clicks measure latency, not the rate limits), then ANALYZE: a production
    database has statistics (autovacuum)."""
    await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1000, max_queue_depth = 1000 "
                       "WHERE tenant_id = %s", (probe_tenant_id,))
    await conn.execute("UPDATE platform_settings SET max_concurrent = 1000")
    for key, value in {"max_active_requests_per_tenant": 10_000, "max_requests_per_user_per_hour": 10_000,
                       "cluster_dispatch_per_minute": 20_000, "tenant_dispatch_per_minute": 300}.items():
        await set_setting(conn, key, value)
    await conn.execute("ANALYZE")


async def _prepare(settings: Settings, *, clicks: int, load: bool, legacy: bool = False) -> dict[str, Any]:
    conn = await connect(settings.database_url)
    try:
        if legacy:  # tasks created from now on take the legacy path (the backlog below is inserted as desktop_tasks)
            await set_setting(conn, "rollout_percentage", 0)
        probe = await seed_demo(conn, tenants=1, brands=1, questions=clicks, clients=1, platforms=("openai",),
                                due=False)
        background: dict[str, Any] = {"tenants": []}
        if load:
            background = await seed_demo(conn, tenants=10, brands=1, questions=10, clients=5, due=False)
            tenants = [t["tenant_id"] for t in background["tenants"]]
            cur = await conn.execute(_BACKLOG, {"tenants": tenants, "days": 34})
            print(f"  backlog: {cur.rowcount} ready normal tasks across {len(tenants)} tenants", flush=True)
        await open_limits_for_probe(conn, probe["tenants"][0]["tenant_id"])
    finally:
        await conn.close()
    return {"probe": probe["tenants"][0], "background": background}


@dataclass(frozen=True, slots=True)
class Click:
    """One click's wall-clock marks (the same clock the services stamp the database with)."""

    request_id: str
    task_id: str
    clicked: float
    accepted: float  # the 202 received
    on_socket: float  # the high task_available received


@dataclass(slots=True)
class Latencies:
    to_socket: list[float]
    to_lease: list[float]
    to_running: list[float]
    # From the task_available on the socket: what the lease mode itself costs, apart from the dispatch before it.
    socket_to_lease: list[float] = field(default_factory=list)
    socket_to_running: list[float] = field(default_factory=list)


async def _measure(settings: Settings, stack: Stack, world: dict[str, Any], clicks: int, *,
                   push: bool = False) -> tuple[Latencies, list[Click]]:
    probe = world["probe"]
    client = probe["clients"][0]
    brand = probe["brands"][0]
    jwt = stack.jwt(probe)
    hub, api = stack.hub_url, stack.api_url
    latencies = Latencies([], [], [])
    marks: list[Click] = []
    auth = {"Authorization": f"Bearer {client['token']}"}
    async with aiohttp.ClientSession() as http, http.ws_connect(
            f"{hub}/api/desktop/ws", headers={**auth, **({CAPABILITIES_HEADER: PUSH_LEASE} if push else {})}) as ws:
        hello = msgspec.json.decode((await ws.receive()).data)
        assert hello["type"] == "hello" and (PUSH_LEASE in hello.get("capabilities", [])) == push, hello
        for question_id in brand["question_ids"][:clicks]:
            clicked, clicked_wall = time.perf_counter(), time.time()
            async with http.post(f"{api}/api/tenant/monitoring/brands/{brand['brand_id']}/collect-now",
                                 json={"target_client_id": client["client_id"], "question_ids": [question_id]},
                                 headers={"Authorization": f"Bearer {jwt}"}) as resp:
                assert resp.status in (200, 201, 202), await resp.text()
                request_id = (await resp.json())["request_id"]
            accepted_wall = time.time()
            while True:
                event = msgspec.json.decode((await ws.receive(timeout=10)).data)
                if event.get("type") == "task_available" and event.get("lane") == "high":
                    break
            on_socket = time.perf_counter()
            latencies.to_socket.append((on_socket - clicked) * 1000)
            marks.append(Click(request_id, event["task_id"], clicked_wall, accepted_wall, time.time()))
            if push:  # the lease came with the event
                assert event.get("lease_token"), event
                tasks = [event]
            else:
                async with http.post(f"{hub}/api/desktop/monitor/lease", json={"max_tasks": 1}, headers=auth) as resp:
                    tasks = (await resp.json())["tasks"]
            latencies.to_lease.append((time.perf_counter() - clicked) * 1000)
            latencies.socket_to_lease.append((time.perf_counter() - on_socket) * 1000)
            for task in tasks:
                async with http.post(f"{hub}/api/desktop/tasks/{task['task_id']}/extend", json={
                        "lease_token": task["lease_token"], "execution_phase": "NAVIGATING"}, headers=auth) as resp:
                    assert resp.status == 200, await resp.text()
                latencies.to_running.append((time.perf_counter() - clicked) * 1000)
                latencies.socket_to_running.append((time.perf_counter() - on_socket) * 1000)
                async with http.post(f"{hub}/api/desktop/tasks/{task['task_id']}/result", json={
                        "lease_token": task["lease_token"], "status": "succeeded", "answer_text": "bench"},
                        headers=auth) as resp:
                    assert resp.status == 202
            await asyncio.sleep(0.05)  # clicks are human-paced; keep them apart
        hub_hop = await _hub_hop(settings, ws, client["client_id"], samples=max(clicks, 50))
    print(f"  hub hop (broker publish -> socket, ms): {summary(hub_hop)}", flush=True)
    return latencies, marks


async def _hub_hop(settings: Settings, ws: aiohttp.ClientWebSocketResponse, client_id: str, *,
                   samples: int, gap_s: float = 0.0) -> list[float]:
    """The hub's own share: an event published straight to the dispatch exchange -> on the socket (`gap_s` apart:
    a busy hub's share is measured with room between the samples)."""
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    db = await connect(settings.database_url)
    try:  # the key the outbox relay would publish with: towards the client's hub
        cur = await db.execute("SELECT connected_hub FROM desktop_clients WHERE id = %s", (client_id,))
        row = await cur.fetchone()
    finally:
        await db.close()
    key = f"monitor.high.{client_id}"
    if row is not None and row["connected_hub"]:
        key = hub_routing_key(row["connected_hub"], key)
    connection = await aio_pika.connect_robust(settings.amqp_url)
    hops: list[float] = []
    try:
        channel = await connection.channel()
        exchange = await channel.get_exchange(topology.dispatch_exchange)
        for _ in range(samples):
            event = TaskAvailable(kind="monitor", task_id=uuid.uuid4(), target_client_id=uuid.UUID(client_id),
                                  priority=5000, lane="high", updated_at=datetime.now(UTC))
            sent = time.perf_counter()
            await exchange.publish(aio_pika.Message(msgspec.json.encode(event)), routing_key=key)
            while msgspec.json.decode((await ws.receive(timeout=10)).data).get("task_id") != str(event.task_id):
                pass
            hops.append((time.perf_counter() - sent) * 1000)
            if gap_s:
                await asyncio.sleep(gap_s)  # pacing the samples, not waiting for anything
    finally:
        await connection.close()
    return hops


# The high TaskAvailable of a click's task: its outbox row was written by the coordinator's high pass
# (created_at = that transaction's start) and published_at is its publisher's broker-confirm time (the
# coordinator's relay, or a pump when the relay left it to them: `claimed_by` says which).
_DISPATCH_ROW = """
SELECT extract(epoch FROM created_at)::float8 AS dispatched, extract(epoch FROM published_at)::float8 AS confirmed,
       claimed_by LIKE 'dispatch-coordinator:%%' AS relayed
FROM outbox WHERE routing_key LIKE 'monitor.high.%%' AND payload LIKE %(task)s
"""


async def _breakdown(settings: Settings, name: str, marks: list[Click]) -> None:
    """Where a click's time goes, per click from the same wall clock: the collect-now request (HTTP and its
    transaction), then until the coordinator's high pass began, then that pass + commit + the publish until
    the broker confirmed, then the hub to the socket."""
    stages: dict[str, list[float]] = {"click -> 202 (collect-now request)": [],
                                      "click -> coordinator high pass starts": [],
                                      "high pass start -> broker confirm (pass, commit, publish)": [],
                                      "broker confirm -> task_available on the socket": []}
    relayed = 0
    per_click: list[tuple[float, int, tuple[float, ...]]] = []
    conn = await connect(settings.database_url)
    try:
        for mark in marks:
            cur = await conn.execute(_DISPATCH_ROW, {"task": f"%{mark.task_id}%".encode()})
            row = await cur.fetchone()
            if row is None or row["confirmed"] is None:
                continue
            relayed += bool(row["relayed"])
            spans = tuple(span * 1000 for span in (
                mark.accepted - mark.clicked, row["dispatched"] - mark.clicked,
                row["confirmed"] - row["dispatched"], mark.on_socket - row["confirmed"]))
            for stage, span in zip(stages.values(), spans, strict=True):
                stage.append(span)
            per_click.append(((mark.on_socket - mark.clicked) * 1000, len(per_click) + 1, spans))
    finally:
        await conn.close()
    print(f"  {name}: {relayed} of {len(marks)} high events published by the coordinator itself", flush=True)
    for label, values in stages.items():
        print(f"  {name}: {label} (ms): {summary(values)}", flush=True)
    slowest = sorted(per_click, reverse=True)[:3]  # where the tail's time went, stage by stage as above
    print(f"  {name}: slowest clicks (#click total: the four stages above, ms): " + "; ".join(
        f"#{n} {total:.1f}: " + " / ".join(f"{span:.1f}" for span in spans) for total, n, spans in slowest), flush=True)


async def _scenario(name: str, *, clicks: int, load: bool, tracing: bool = False, legacy: bool = False,
                    push: bool | None = None) -> None:
    """`push`: None, push-lease off (the services' default); False / True, push-lease on and the probe pulling /
    asking for it."""
    async with bench_environment(shards=16) as base:
        settings = replace(base, gateway_jwt_secret=JWT_SECRET)
        print(f"  {name}: preparing data", flush=True)
        world = await _prepare(settings, clicks=clicks, load=load, legacy=legacy)
        print(f"  {name}: starting {', '.join(DISPATCH_SERVICES)}", flush=True)
        with tempfile.TemporaryDirectory() as logs:
            async with contextlib.AsyncExitStack() as tracing_sink:
                env: dict[str, str | int] = dict(PUSH_ENV) if push is not None else {}
                if tracing:
                    endpoint, spans = await tracing_sink.enter_async_context(_trace_sink(Path(logs)))
                    env |= {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
                async with running_stack(settings, Path(logs), DB_POOL_MAX=6, **cast(dict[str, Any], env)) as stack:
                    await _run_scenario(name, stack, world, clicks=clicks, load=load, push=bool(push))
                if tracing:  # the services flushed their spans on the way out
                    lines = len(spans.read_text().splitlines()) if spans.exists() else 0
                    print(f"  {name}: tracing on (every request, OTLP/HTTP, default batching) into a local sink "
                          f"process: {lines} spans", flush=True)


@contextlib.asynccontextmanager
async def _trace_sink(folder: Path) -> AsyncIterator[tuple[str, Path]]:
    """`python -m tools.trace_sink` in its own process, as a collector runs beside the services; its OTLP
    endpoint and the file it writes."""
    port, out = free_port(), folder / "traces.jsonl"
    sink = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tools.trace_sink", "--port", str(port), "--out", str(out),
        stdout=asyncio.subprocess.PIPE, preexec_fn=die_with_parent)
    try:
        assert sink.stdout is not None
        await asyncio.wait_for(sink.stdout.readline(), 30)  # its "listening" line
        yield f"http://127.0.0.1:{port}", out
    finally:
        sink.terminate()
        await sink.wait()


async def _start_fleet(stack: Stack, world: dict[str, Any]) -> asyncio.subprocess.Process:
    """The 50 background clients run in their own `desktop-sim` process, as desktops run on other machines:
    the probe's clock in this process then never waits for the fleet's work on the same event loop.
    Realistic desktop pacing (a task takes seconds), so the load is the backlog, the dispatching and
    50 sockets, not a CPU-bound simulator sharing the benchmark's cores."""
    tokens = [c["token"] for tenant in world["background"]["tenants"] for c in tenant["clients"]]
    args = ["--hub", stack.hub_url, "--timings", "demo", "--scale", "0.5", "--stats-interval", "3600"]
    for token in tokens:
        args += ["--token", token]
    fleet = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("desktop-sim")), *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent)
    tenants = [t["tenant_id"] for t in world["background"]["tenants"]]
    conn = await connect(stack.settings.database_url)
    try:
        deadline = time.monotonic() + 60
        while True:  # every client said hello (the hub marks it online)
            cur = await conn.execute("SELECT count(*) AS n FROM desktop_clients WHERE online AND tenant_id = ANY(%s)",
                                     (tenants,))
            row = await cur.fetchone()
            if row is not None and int(row["n"]) >= len(tokens):
                break
            if time.monotonic() > deadline or fleet.returncode is not None:
                raise RuntimeError("the desktop-sim fleet did not connect")
            await asyncio.sleep(0.2)  # polling the database for the fleet's connections
    finally:
        await conn.close()
    return fleet


async def _analyze(settings: Settings) -> None:
    conn = await connect(settings.database_url)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def _stop_fleet(fleet: asyncio.subprocess.Process) -> dict[str, Any]:
    """SIGTERM; the fleet prints its totals on the way out."""
    fleet.terminate()
    out, _ = await asyncio.wait_for(fleet.communicate(), 30)
    stats = [json.loads(line) for line in out.decode().splitlines() if '"fleet stats"' in line]
    return stats[-1] if stats else {}


async def _run_scenario(name: str, stack: Stack, world: dict[str, Any], *, clicks: int, load: bool,
                        push: bool = False) -> None:
    settings = stack.settings
    fleet: asyncio.subprocess.Process | None = None
    try:
        if load:
            fleet = await _start_fleet(stack, world)
            await asyncio.sleep(5)  # let dispatch reach its steady state with the fleet working
            await _analyze(settings)  # ... and its statistics (autovacuum's job in a long-running system)
        try:
            latencies, marks = await _measure(settings, stack, world, clicks, push=push)
        except TimeoutError:
            for service in ("dispatch-coordinator", "collect-now-api"):
                print(f"----- {service} log tail\n{stack.procs[service].logs()[-3000:]}")
            raise
        print(f"  {name}: click -> task_available on the socket (ms): {summary(latencies.to_socket)}", flush=True)
        print(f"  {name}: click -> lease in hand (ms):                {summary(latencies.to_lease)}", flush=True)
        print(f"  {name}: click -> running (first extend answered, ms): {summary(latencies.to_running)}", flush=True)
        print(f"  {name}: task_available -> lease in hand (ms):       {summary(latencies.socket_to_lease)}", flush=True)
        print(f"  {name}: task_available -> running (ms):             {summary(latencies.socket_to_running)}",
              flush=True)
        await _breakdown(settings, name, marks)
    finally:
        if fleet is not None:
            totals = await _stop_fleet(fleet)
            print(f"  {name}: the fleet's {sum(len(t['clients']) for t in world['background']['tenants'])} clients "
                  f"executed {totals.get('executed', '?')} normal tasks meanwhile (leased {totals.get('leased', '?')})",
                  flush=True)


async def run(args: argparse.Namespace) -> None:
    clicks = 15 if args.quick else 100
    tracing = bool(getattr(args, "tracing", False))
    legacy = bool(getattr(args, "legacy", False))
    path = " (legacy path)" if legacy else ""
    if getattr(args, "push", False):  # pull then push, back to back, in each scenario
        for load, label in ((False, "idle"), (True, "50 clients + 10k backlog")):
            for push in (False, True):
                await _scenario(f"{label}, {'push' if push else 'pull'}-lease{path}", clicks=clicks, load=load,
                                tracing=tracing, legacy=legacy, push=push)
        return
    await _scenario(f"idle{path}", clicks=clicks, load=False, tracing=tracing, legacy=legacy)
    await _scenario(f"50 clients + 10k backlog{path}", clicks=clicks, load=True, tracing=tracing, legacy=legacy)
