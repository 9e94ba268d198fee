"""Rows in the states the reconciler repairs, inserted directly (reference data from libs.demo)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import msgspec

from libs.auth import TenantPrincipal
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.domain.lanes import lane_weight
from libs.domain.shard import ingest_shard_key


@dataclass
class World:
    tenant_id: int
    workspace_id: int
    user_id: int
    brand_id: int
    question_ids: list[int]
    platform_ids: dict[str, int]
    clients: list[uuid.UUID]
    tokens: list[str] = field(default_factory=list)

    @property
    def platform_id(self) -> int:
        return next(iter(self.platform_ids.values()))

    def principal(self) -> TenantPrincipal:
        return TenantPrincipal(self.tenant_id, self.workspace_id, self.user_id)


async def make_world(conn: Conn, *, clients: int = 2, questions: int = 3, platforms: tuple[str, ...] = ("openai",),
                     time_zone: str = "UTC") -> World:
    out = await seed_demo(conn, clients=clients, questions=questions, platforms=platforms, due=False,
                          time_zone=time_zone)
    tenant = out["tenants"][0]
    return World(tenant_id=tenant["tenant_id"], workspace_id=tenant["workspace_id"], user_id=tenant["user_id"],
                 brand_id=tenant["brands"][0]["brand_id"], question_ids=tenant["brands"][0]["question_ids"],
                 platform_ids={p["code"]: p["ai_platform_id"] for p in out["platforms"]},
                 clients=[uuid.UUID(c["client_id"]) for c in tenant["clients"]],
                 tokens=[c["token"] for c in tenant["clients"]])


async def heartbeat(conn: Conn, client_id: uuid.UUID, *, seconds_ago: float, online: bool = True) -> None:
    await conn.execute(
        "UPDATE desktop_clients SET online = %(online)s, connected_hub = 'test-hub',"
        " last_heartbeat_at = now() - make_interval(secs => %(ago)s) WHERE id = %(id)s",
        {"online": online, "ago": seconds_ago, "id": client_id})


async def insert_task(conn: Conn, world: World, *, question_index: int = 0, platform: str | None = None,
                      status: str = "pending", lane: str = "normal", priority: int | None = None,
                      business_date: date | None = None, target_client_id: uuid.UUID | None = None,
                      dispatch_attempts: int = 0, collect_request_id: uuid.UUID | None = None,
                      execution_owner: str = "desktop_tasks", last_dispatched: bool = False,
                      legacy_lease_expires_in: float | None = None) -> int:
    platform_id = world.platform_ids[platform] if platform else world.platform_id
    day = business_date or today()
    cur = await conn.execute(
        """
        INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id,
            business_date, status, dispatch_lane, dispatch_priority, target_client_id, dispatch_attempts,
            collect_request_id, execution_owner, ingest_shard_key, trigger_source, last_dispatched_at,
            leased_to_executor, lease_token_hash, leased_at, lease_expires_at)
        VALUES (%(tenant)s, %(ws)s, %(brand)s, %(question)s, %(platform)s, %(day)s, %(status)s, %(lane)s,
                %(priority)s, %(target)s, %(attempts)s, %(request)s, %(owner)s, %(shard_key)s, %(trigger)s,
                CASE WHEN %(dispatched)s THEN now() END,
                CASE WHEN %(legacy_in)s::float8 IS NOT NULL THEN gen_random_uuid() END,
                CASE WHEN %(legacy_in)s::float8 IS NOT NULL THEN 'h' END,
                CASE WHEN %(legacy_in)s::float8 IS NOT NULL THEN now() END,
                now() + make_interval(secs => %(legacy_in)s::float8))
        RETURNING id
        """,
        {"tenant": world.tenant_id, "ws": world.workspace_id, "brand": world.brand_id,
         "question": world.question_ids[question_index], "platform": platform_id, "day": day, "status": status,
         "lane": lane, "priority": priority if priority is not None else (5000 if lane == "high" else 100),
         "target": target_client_id, "attempts": dispatch_attempts, "request": collect_request_id,
         "owner": execution_owner, "shard_key": ingest_shard_key(world.tenant_id, world.brand_id, day),
         "trigger": "manual" if collect_request_id else "automatic", "dispatched": last_dispatched,
         "legacy_in": legacy_lease_expires_in})
    row = await cur.fetchone()
    assert row is not None
    return int(row["id"])


async def insert_moded_task(conn: Conn, world: World, *, question_index: int, mode: str,
                            platform: str = "openai") -> int:
    """A business task of a plan that runs in `mode` (§10.5: the plan names its platform mode)."""
    cur = await conn.execute(
        "INSERT INTO monitoring_plans (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, "
        "next_run_at, platform_mode) VALUES (%s, %s, %s, %s, %s, now() + interval '1 day', %s) "
        "ON CONFLICT (tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode) "
        "DO UPDATE SET platform_mode = EXCLUDED.platform_mode RETURNING id",
        (world.tenant_id, world.workspace_id, world.brand_id, world.question_ids[question_index],
         world.platform_ids[platform], mode))
    plan = await cur.fetchone()
    assert plan is not None
    task = await insert_task(conn, world, question_index=question_index, platform=platform, dispatch_attempts=1)
    await conn.execute("UPDATE monitoring_collect_tasks SET plan_id = %s WHERE id = %s", (plan["id"], task))
    return task


async def insert_execution(conn: Conn, world: World, monitor_task_id: int, client_id: uuid.UUID, *,
                           status: str = "in_progress", lane: str = "normal", lease_expires_in: float = 60,
                           lease_epoch: int = 1, result_received_ago: float | None = None,
                           interrupted_ago: float | None = None, interrupt_generation: int = 0,
                           collect_request_id: uuid.UUID | None = None, source: str | None = None) -> uuid.UUID:
    """An execution row (with its attempt when it was leased) for business task `monitor_task_id`."""
    task_id = uuid.uuid4()
    leased = status in ("in_progress", "unknown")
    flags: dict[str, Any] = {}
    if interrupted_ago is not None:
        flags = {"interrupt_requested": True, "interrupt_generation": interrupt_generation,
                 "collect_request_id": str(collect_request_id) if collect_request_id else None}
    await conn.execute(
        """
        INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane,
            lane_weight, source, scheduler_group_key, monitor_task_id, control_flags, interrupt_generation,
            interrupted_at, interrupt_reason, brand_id, question_id, ai_platform_id, business_date,
            collect_request_id, lease_token_hash, lease_epoch, leased_at, lease_expires_at, execution_phase,
            result_received_at, started_at)
        SELECT %(id)s, 'monitor', t.tenant_id, t.workspace_id, %(client)s, %(status)s, t.dispatch_priority, %(lane)s,
               %(weight)s, %(source)s, 'qid:' || t.question_id, t.id, %(flags)s, %(gen)s,
               CASE WHEN %(int_ago)s::float8 IS NOT NULL THEN now() - make_interval(secs => %(int_ago)s::float8) END,
               CASE WHEN %(int_ago)s::float8 IS NOT NULL THEN 'collect_now_preempt' END,
               t.brand_id, t.question_id, t.ai_platform_id, t.business_date, %(request)s,
               CASE WHEN %(leased)s THEN 'hash' END, CASE WHEN %(leased)s THEN %(epoch)s ELSE 0 END,
               CASE WHEN %(leased)s THEN now() - interval '30 seconds' END,
               CASE WHEN %(leased)s THEN now() + make_interval(secs => %(lease_in)s) END,
               CASE WHEN %(leased)s THEN 'WAITING' END,
               CASE WHEN %(rr_ago)s::float8 IS NOT NULL THEN now() - make_interval(secs => %(rr_ago)s::float8) END,
               CASE WHEN %(leased)s THEN now() - interval '30 seconds' END
        FROM monitoring_collect_tasks t WHERE t.id = %(monitor_task_id)s
        """,
        {"id": task_id, "client": client_id, "status": status, "lane": lane,
         "weight": lane_weight("monitor", lane),
         "source": source or ("collect_now" if lane == "high" else "retry_recovery" if lane == "retry"
                              else "daily_schedule"),
         "flags": msgspec.json.encode(flags).decode(), "gen": interrupt_generation, "int_ago": interrupted_ago,
         "request": collect_request_id, "leased": leased, "epoch": lease_epoch, "lease_in": lease_expires_in,
         "rr_ago": result_received_ago, "monitor_task_id": monitor_task_id})
    if leased:
        await conn.execute(
            "INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, lease_epoch,"
            " interrupt_generation, started_at) VALUES (%s, %s, %s, %s, %s, %s, now() - interval '30 seconds')",
            (task_id, monitor_task_id, world.tenant_id, client_id, lease_epoch, interrupt_generation))
    return task_id


async def insert_request(conn: Conn, world: World, *, client_id: uuid.UUID | None, status: str = "accepted",
                         ttl_in: float = 300, created_ago: float = 0, requested: int = 1,
                         dispatched: int = 0) -> uuid.UUID:
    request_id = uuid.uuid4()
    await conn.execute(
        """
        INSERT INTO monitoring_collect_requests (id, tenant_id, workspace_id, brand_id, requested_by_user_id,
            target_client_id, scope_hash, request_scope, status, requested_task_count, dispatched_task_count,
            first_dispatched_at, ttl_expires_at, created_at)
        VALUES (%(id)s, %(tenant)s, %(ws)s, %(brand)s, %(user)s, %(client)s, %(scope)s, '{}'::jsonb, %(status)s,
                %(requested)s, %(dispatched)s, CASE WHEN %(dispatched)s > 0 THEN now() END,
                now() + make_interval(secs => %(ttl_in)s), now() - make_interval(secs => %(created_ago)s))
        """,
        {"id": request_id, "tenant": world.tenant_id, "ws": world.workspace_id, "brand": world.brand_id,
         "user": world.user_id, "client": client_id, "scope": uuid.uuid4().hex, "status": status,
         "requested": requested, "dispatched": dispatched, "ttl_in": ttl_in, "created_ago": created_ago})
    return request_id


async def insert_run(conn: Conn, monitor_task_id: int, *, status: str, desktop_task_id: uuid.UUID | None) -> None:
    """A question_monitor_runs row for the business key of `monitor_task_id` (what ingest writes)."""
    await conn.execute(
        """
        INSERT INTO question_monitor_runs (tenant_id, workspace_id, brand_id, question_id, ai_platform_id,
            collector_type, run_mode, business_date, status, desktop_task_id, finished_at)
        SELECT tenant_id, workspace_id, brand_id, question_id, ai_platform_id, collector_type, run_mode,
               business_date, %(status)s, %(dt)s, now()
        FROM monitoring_collect_tasks WHERE id = %(id)s
        """, {"status": status, "dt": desktop_task_id, "id": monitor_task_id})


async def row(conn: Conn, query: str, *params: Any) -> dict[str, Any]:
    cur = await conn.execute(query, params)
    found = await cur.fetchone()
    assert found is not None, query
    return dict(found)


async def business(conn: Conn, monitor_task_id: int) -> dict[str, Any]:
    return await row(conn, "SELECT * FROM monitoring_collect_tasks WHERE id = %s", monitor_task_id)


async def execution(conn: Conn, task_id: uuid.UUID) -> dict[str, Any]:
    return await row(conn, "SELECT * FROM desktop_tasks WHERE id = %s", task_id)


async def attempt(conn: Conn, task_id: uuid.UUID) -> dict[str, Any]:
    return await row(conn, "SELECT * FROM desktop_task_attempts WHERE task_id = %s ORDER BY lease_epoch DESC LIMIT 1",
                     task_id)


async def outbox_messages(conn: Conn, routing_prefix: str = "") -> list[dict[str, Any]]:
    """Decoded outbox payloads (with `routing_key`) in id order, optionally filtered by routing-key prefix."""
    cur = await conn.execute("SELECT routing_key, payload FROM outbox WHERE routing_key LIKE %s ORDER BY id",
                             (routing_prefix + "%",))
    out = []
    for r in await cur.fetchall():
        body = msgspec.json.decode(bytes(r["payload"]))
        body["routing_key"] = r["routing_key"]
        out.append(body)
    return out


def yesterday() -> date:
    return today() - timedelta(days=1)


def today() -> date:
    return datetime.now(UTC).date()


async def insert_legacy_lease(conn: Conn, world: World, monitor_task_id: int, client_id: uuid.UUID, *,
                              status: str = "in_progress", lease_expires_in: float = 60.0, lane: str = "normal",
                              result_received_ago: float | None = None, created_ago: float = 0.0) -> uuid.UUID:
    """A live lease of the legacy path on a business task (libs/tasks/legacy.py): the history row, and the business
    row leased to `client_id` (offered when `status` is 'queued', pulled when 'in_progress')."""
    lease_id = uuid.uuid4()
    pulled = status == "in_progress"
    await conn.execute(
        """
        INSERT INTO legacy_leases (id, monitor_task_id, tenant_id, workspace_id, target_client_id, ai_platform_id,
                                   brand_id, question_id, business_date, lane, lane_weight, priority, status,
                                   lease_epoch, lease_token_hash, leased_at, result_received_at, enqueued_at,
                                   created_at, execution_phase)
        SELECT %(id)s, t.id, t.tenant_id, t.workspace_id, %(client)s, t.ai_platform_id, t.brand_id, t.question_id,
               t.business_date, %(lane)s, %(weight)s, t.dispatch_priority, %(status)s, %(epoch)s,
               CASE WHEN %(pulled)s THEN 'h' END, CASE WHEN %(pulled)s THEN now() END,
               now() - make_interval(secs => %(received_ago)s::float8), t.enqueued_at,
               now() - make_interval(secs => %(created_ago)s), CASE WHEN %(pulled)s THEN 'WAITING' END
        FROM monitoring_collect_tasks t WHERE t.id = %(task)s
        """,
        {"id": lease_id, "client": client_id, "lane": lane, "weight": lane_weight("monitor", lane),
         "status": status, "epoch": 1 if pulled else 0, "pulled": pulled, "received_ago": result_received_ago,
         "task": monitor_task_id, "created_ago": created_ago})
    await conn.execute(
        """
        UPDATE monitoring_collect_tasks
        SET status = CASE WHEN %(received)s THEN 'received' ELSE 'leased' END, leased_to_executor = %(client)s,
            legacy_lease_id = %(id)s, lease_token_hash = CASE WHEN %(pulled)s THEN 'h' END,
            leased_at = CASE WHEN %(pulled)s THEN now() END,
            lease_expires_at = CASE WHEN %(pulled)s THEN now() + make_interval(secs => %(expires_in)s) END
        WHERE id = %(task)s
        """,
        {"id": lease_id, "client": client_id, "pulled": pulled, "expires_in": lease_expires_in,
         "task": monitor_task_id, "received": result_received_ago is not None})
    return lease_id


async def legacy_lease(conn: Conn, lease_id: uuid.UUID) -> dict[str, Any]:
    return await row(conn, "SELECT * FROM legacy_leases WHERE id = %s", lease_id)
