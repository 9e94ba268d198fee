"""Scenario builders for collect-now tests: demo data, online clients, scheduled work on a client."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import date
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from libs.auth import TenantPrincipal, issue_gateway_jwt
from libs.clock import Clock
from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.domain.lanes import lane_weight
from libs.domain.shard import ingest_shard_key

# >= 32 bytes: PyJWT warns about shorter HMAC keys, and the test suite turns warnings into errors.
JWT_SECRET = "collect-now-tests-gateway-secret-0123456789"
# What the test gateway's tokens name and the services under test require (outside DEV_MODE both are required).
GATEWAY_AUDIENCE = "collect-now-api"
GATEWAY_ISSUER = "tenant-api-gateway-tests"


def with_jwt_secret(settings: Settings) -> Settings:
    return replace(settings, gateway_jwt_secret=JWT_SECRET,
                   gateway_jwt_audience=settings.gateway_jwt_audience or GATEWAY_AUDIENCE,
                   gateway_jwt_issuer=settings.gateway_jwt_issuer or GATEWAY_ISSUER)


def gateway_token(principal: TenantPrincipal, key: str = JWT_SECRET, **claims: Any) -> str:
    """A token as the test gateway issues it: the audience and issuer the services under test expect."""
    return issue_gateway_jwt(key, principal, **{"audience": GATEWAY_AUDIENCE, "issuer": GATEWAY_ISSUER, **claims})


@dataclass
class World:
    seed: dict[str, Any]

    @property
    def tenant(self) -> dict[str, Any]:
        return dict(self.seed["tenants"][0])

    @property
    def tenant_id(self) -> int:
        return int(self.tenant["tenant_id"])

    @property
    def brand(self) -> dict[str, Any]:
        return dict(self.tenant["brands"][0])

    @property
    def brand_id(self) -> int:
        return int(self.brand["brand_id"])

    def client_id(self, index: int = 0) -> uuid.UUID:
        return uuid.UUID(self.tenant["clients"][index]["client_id"])

    @property
    def platform_ids(self) -> list[int]:
        return [int(p["ai_platform_id"]) for p in self.seed["platforms"]]

    def principal(self, tenant_index: int = 0, user_id: int | None = None) -> TenantPrincipal:
        tenant = self.seed["tenants"][tenant_index]
        return TenantPrincipal(tenant["tenant_id"], tenant["workspace_id"], user_id or tenant["user_id"])

    def auth(self, tenant_index: int = 0, user_id: int | None = None) -> dict[str, str]:
        token = gateway_token(self.principal(tenant_index, user_id))
        return {"Authorization": f"Bearer {token}"}


async def make_world(conn: Conn, *, online: bool = True, **seed: Any) -> World:
    world = World(await seed_demo(conn, **seed))
    if online:
        for tenant in world.seed["tenants"]:
            for client in tenant["clients"]:
                await set_online(conn, uuid.UUID(client["client_id"]))
    return world


async def set_online(conn: Conn, client_id: uuid.UUID, *, online: bool = True, heartbeat_age_s: int = 0,
                     platform_health: str = "{}") -> None:
    await conn.execute(
        "UPDATE desktop_clients SET online = %(online)s, platform_health = %(health)s::jsonb, "
        "last_heartbeat_at = now() - make_interval(secs => %(age)s) WHERE id = %(id)s",
        {"online": online, "age": heartbeat_age_s, "id": client_id, "health": platform_health})


async def today(conn: Conn, tenant_id: int) -> date:
    cur = await conn.execute("SELECT (now() AT TIME ZONE time_zone)::date AS d FROM tenants WHERE id = %s",
                             (tenant_id,))
    row = await cur.fetchone()
    assert row is not None
    return row["d"]  # type: ignore[no-any-return]


async def business_task(conn: Conn, *, tenant_id: int, brand_id: int, question_id: int, ai_platform_id: int,
                        business_date: date, status: str = "pending", lane: str = "normal", priority: int = 100,
                        attempts: int = 0) -> int:
    """A task as the scheduler's scanner creates it (trigger_source automatic, desktop_tasks owner)."""
    cur = await conn.execute(
        "INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, "
        " business_date, status, dispatch_lane, dispatch_priority, dispatch_attempts, ingest_shard_key, "
        " execution_owner, enqueued_at) "
        "VALUES (%(t)s, %(t)s, %(b)s, %(q)s, %(p)s, %(d)s, %(s)s, %(lane)s, %(prio)s, %(att)s, %(key)s, "
        " 'desktop_tasks', now() - interval '10 minutes') RETURNING id",
        {"t": tenant_id, "b": brand_id, "q": question_id, "p": ai_platform_id, "d": business_date, "s": status,
         "lane": lane, "prio": priority, "att": attempts, "key": ingest_shard_key(tenant_id, brand_id, business_date)})
    row = await cur.fetchone()
    assert row is not None
    return int(row["id"])


async def execution(conn: Conn, *, monitor_task_id: int, client_id: uuid.UUID, status: str = "queued",
                    source: str = "daily_schedule", lane: str = "normal", phase: str | None = None,
                    collect_request_id: uuid.UUID | None = None) -> uuid.UUID:
    """An execution as the coordinator dispatches it (and, for in_progress, as the hub leases it)."""
    task_id = uuid.uuid4()
    cur = await conn.execute("SELECT * FROM monitoring_collect_tasks WHERE id = %s", (monitor_task_id,))
    task = await cur.fetchone()
    assert task is not None
    leased = status == "in_progress"
    await conn.execute(
        "INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, "
        " lane_weight, source, scheduler_group_key, monitor_task_id, brand_id, question_id, ai_platform_id, "
        " business_date, collect_request_id, lease_epoch, leased_at, lease_expires_at, execution_phase, "
        " lease_token_hash) "
        "VALUES (%(id)s, 'monitor', %(t)s, %(w)s, %(c)s, %(s)s, %(prio)s, %(lane)s, %(lw)s, %(src)s, %(g)s, %(m)s, "
        " %(b)s, %(q)s, %(p)s, %(d)s, %(r)s, %(epoch)s, CASE WHEN %(leased)s THEN now() END, "
        " CASE WHEN %(leased)s THEN now() + interval '2 minutes' END, %(phase)s, "
        " CASE WHEN %(leased)s THEN 'x' END)",
        {"id": task_id, "t": task["tenant_id"], "w": task["workspace_id"], "c": client_id, "s": status,
         "prio": task["dispatch_priority"], "lane": lane, "lw": lane_weight("monitor", lane), "src": source,
         "g": f"qid:{task['question_id']}", "m": monitor_task_id, "b": task["brand_id"], "q": task["question_id"],
         "p": task["ai_platform_id"], "d": task["business_date"], "r": collect_request_id,
         "epoch": 1 if leased else 0, "leased": leased, "phase": phase or ("WAITING" if leased else None)})
    await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_attempts = dispatch_attempts + 1, "
                       "last_dispatched_at = now() WHERE id = %s", (monitor_task_id,))
    if leased:
        await conn.execute(
            "INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, lease_epoch) "
            "VALUES (%s, %s, %s, %s, 1)", (task_id, monitor_task_id, task["tenant_id"], client_id))
    return task_id


async def fetch_all(conn: Conn, query: str, *params: Any) -> list[dict[str, Any]]:
    cur = await conn.execute(query, params or None)
    return list(await cur.fetchall())


async def fetch_one(conn: Conn, query: str, *params: Any) -> dict[str, Any]:
    rows = await fetch_all(conn, query, *params)
    assert len(rows) == 1, rows
    return rows[0]


@contextlib.asynccontextmanager
async def api_client(settings: Settings, *, clock: Clock | None = None) -> AsyncIterator[TestClient[Any, Any]]:
    """The real collect-now-api app (its own pool, start-up and shutdown hooks) on a local port; `clock`: the one
    its clicks reckon business dates by (default: the system's)."""
    from services.collect_now_api.handlers import CLOCK
    from services.collect_now_api.main import build

    app = build(with_jwt_secret(settings))
    if clock is not None:
        app[CLOCK] = clock
    client: TestClient[Any, Any] = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
