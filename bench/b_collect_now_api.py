"""collect-now-api: click -> 202 latency of the accept transaction (HTTP, one short Postgres transaction).

Idle: one online client, six scope tasks. Busy: 50 online clients, a 10,000-task normal backlog, and
before every click the target client holds 20 queued scheduled executions (all cancelled by the
click) and 2 running ones (asked to yield). Each click comes from another user (no idempotent
replay) and supersedes the previous request on the same client.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from bench.common import bench_environment, summary
from libs.auth import TenantPrincipal
from libs.config import Settings
from libs.db.pool import Conn, make_pool
from libs.demo import seed_demo
from tests.support.collect_now import gateway_token
from tests.support.procs import ServiceProcess, service_env

SECRET = "collect-now-bench-gateway-secret-0123456789"


async def _online(conn: Conn, tenant_id: int) -> None:
    await conn.execute("UPDATE desktop_clients SET online = true, last_heartbeat_at = now() + interval '1 hour' "
                       "WHERE tenant_id = %s", (tenant_id,))


async def _backlog(conn: Conn, tenant_id: int, brand_id: int, size: int) -> None:
    """`size` pending normal tasks of a second brand, as the scanner would create them (business dates vary)."""
    await conn.execute(
        "INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, "
        " business_date, ingest_shard_key, execution_owner) "
        "SELECT %(t)s, %(t)s, %(b)s, q.id, p.id, current_date - g, %(t)s || ':' || %(b)s, 'desktop_tasks' "
        "FROM monitoring_questions q, ai_platforms p, generate_series(1, %(days)s) g WHERE q.brand_id = %(b)s "
        "LIMIT %(size)s", {"t": tenant_id, "b": brand_id, "days": size, "size": size})


async def _load_client(conn: Conn, client_id: uuid.UUID, tenant_id: int, brand_id: int, queued: int,
                       running: int) -> None:
    """Give the client `queued` queued and up to `running` in_progress scheduled executions."""
    await conn.execute(
        "INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, "
        " lane_weight, source, monitor_task_id, brand_id, question_id, ai_platform_id, business_date) "
        "SELECT gen_random_uuid(), 'monitor', t.tenant_id, t.workspace_id, %(c)s, 'queued', 100, 'normal', 40, "
        " 'daily_schedule', t.id, t.brand_id, t.question_id, t.ai_platform_id, t.business_date "
        "FROM monitoring_collect_tasks t WHERE t.tenant_id = %(t)s AND t.brand_id = %(b)s AND t.status = 'pending' "
        " AND NOT EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id) "
        "LIMIT %(n)s", {"c": client_id, "t": tenant_id, "b": brand_id, "n": queued})
    cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE target_client_id = %s "
                             "AND status = 'in_progress'", (client_id,))
    row = await cur.fetchone()
    missing = running - (row["n"] if row else 0)
    if missing > 0:
        await conn.execute(
            "UPDATE desktop_tasks SET status = 'in_progress', lease_epoch = 1, leased_at = now(), "
            " lease_expires_at = now() + interval '1 hour', execution_phase = 'WAITING' "
            "WHERE id IN (SELECT id FROM desktop_tasks WHERE target_client_id = %s AND status = 'queued' LIMIT %s)",
            (client_id, missing))


async def _clicks(settings: Settings, url: str, *, tenant_id: int, brand_id: int, n: int,
                  between: object | None = None, keyed: bool = False, user_base: int = 10_000) -> list[float]:
    latencies: list[float] = []
    pool = make_pool(settings, name="bench", min_size=1, max_size=2)
    await pool.open(wait=True)
    try:
        async with aiohttp.ClientSession(url) as http:
            for i in range(n):
                if between is not None:
                    async with pool.connection() as conn:
                        await between(conn)  # type: ignore[operator]
                token = gateway_token(TenantPrincipal(tenant_id, tenant_id, user_base + i), SECRET)
                headers = {"Authorization": f"Bearer {token}"}
                if keyed:  # a new key per click: the key's lock, lookup and stored answer on every one
                    headers["Idempotency-Key"] = str(uuid.uuid4())
                started = time.perf_counter()
                async with http.post(f"/api/tenant/monitoring/brands/{brand_id}/collect-now", json={},
                                     headers=headers) as resp:
                    await resp.read()
                    assert resp.status == 202, await resp.text()
                latencies.append((time.perf_counter() - started) * 1000)
    finally:
        await pool.close()
    return latencies[min(5, n // 10):]  # drop the warm-up clicks


async def run(args: argparse.Namespace) -> None:
    clicks = 30 if args.quick else 300
    backlog = 1_000 if args.quick else 10_000
    async with bench_environment() as settings:
        pool = make_pool(settings, name="bench-setup", min_size=1, max_size=2)
        await pool.open(wait=True)
        async with pool.connection() as conn:
            await conn.execute("INSERT INTO dispatch_settings (key, value) VALUES "
                               "('max_requests_per_user_per_hour', '1000'), ('max_active_requests_per_tenant', '1000')")
            idle = await seed_demo(conn, questions=2, clients=1)
            busy = await seed_demo(conn, brands=2, questions=50, clients=50)
            for world in (idle, busy):
                await _online(conn, world["tenants"][0]["tenant_id"])
            tenant = busy["tenants"][0]
            await _backlog(conn, tenant["tenant_id"], tenant["brands"][1]["brand_id"], backlog)
            await conn.execute("ANALYZE")  # steady state: autovacuum would have analyzed a table this size
        await pool.close()
        with tempfile.TemporaryDirectory() as logs:
            api = ServiceProcess("collect-now-api", service_env(settings, GATEWAY_JWT_SECRET=SECRET, DB_POOL_MAX=6),
                                 log_dir=Path(logs))
            await asyncio.to_thread(api.start)
            try:
                idle_tenant = idle["tenants"][0]
                result = await _clicks(settings, api.url, tenant_id=idle_tenant["tenant_id"],
                                       brand_id=idle_tenant["brands"][0]["brand_id"], n=clicks)
                print(f"idle  (1 client, 6 scope tasks)                         click->202 ms: {summary(result)}")
                result = await _clicks(settings, api.url, tenant_id=idle_tenant["tenant_id"],
                                       brand_id=idle_tenant["brands"][0]["brand_id"], n=clicks, keyed=True,
                                       user_base=20_000)  # other users: the window replays none of them
                print(f"idle, each click with a new Idempotency-Key            click->202 ms: {summary(result)}")
                busy_tenant = busy["tenants"][0]
                # The client the API chooses: with equal capacity, the freshest heartbeat; pin it explicitly.
                target = uuid.UUID(busy_tenant["clients"][0]["client_id"])

                async def reload(conn: Conn) -> None:
                    await _load_client(conn, target, busy_tenant["tenant_id"], busy_tenant["brands"][1]["brand_id"],
                                       queued=20, running=2)

                async with pool_for(settings) as setup:
                    async with setup.connection() as conn:
                        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 10 WHERE id = %s",
                                           (target,))
                result = await _clicks(settings, api.url, tenant_id=busy_tenant["tenant_id"],
                                       brand_id=busy_tenant["brands"][0]["brand_id"], n=clicks, between=reload)
                print(f"busy  (50 clients, {backlog} backlog, 150 scope tasks, 20 queued cancelled + 2 interrupted "
                      f"per click) click->202 ms: {summary(result)}")
            finally:
                await asyncio.to_thread(api.stop)


def pool_for(settings: Settings):  # type: ignore[no-untyped-def]
    from libs.db.pool import open_pool
    return open_pool(settings, name="bench-setup", min_size=1, max_size=1)
