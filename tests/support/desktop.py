"""Test helpers for the desktop path: business tasks and executions as the coordinator would create
them, and an in-process dispatch-hub."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import date
from typing import Any

from aiohttp.test_utils import TestServer

from libs.config import Settings
from libs.db.pool import Conn
from libs.domain.lanes import lane_weight
from libs.domain.shard import ingest_shard_key

_INSERT_BUSINESS = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner, dispatch_attempts,
    collect_request_id, target_client_id, enqueued_at)
VALUES (%(tenant_id)s, %(workspace_id)s, %(brand_id)s, %(question_id)s, %(ai_platform_id)s, %(business_date)s,
    'pending', %(priority)s, %(lane)s, %(shard_key)s, 'desktop_tasks', %(attempts)s, %(request_id)s,
    %(target)s, now() - make_interval(secs => %(age_s)s))
RETURNING id, enqueued_at
"""

_INSERT_EXECUTION = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
    source, scheduler_group_key, monitor_task_id, interrupt_generation, enqueued_at, brand_id, question_id,
    ai_platform_id, business_date, collect_request_id, control_flags)
VALUES (%(id)s, %(kind)s, %(tenant_id)s, %(workspace_id)s, %(client_id)s, 'queued', %(priority)s, %(lane)s,
    %(lane_weight)s, %(source)s, %(group)s, %(monitor_task_id)s, %(generation)s, %(enqueued_at)s, %(brand_id)s,
    %(question_id)s, %(ai_platform_id)s, %(business_date)s, %(request_id)s, '{}'::jsonb)
"""


async def dispatch_execution(
    conn: Conn, *, tenant: dict[str, Any], platform_id: int, client_id: uuid.UUID | str, question_index: int = 0,
    lane: str = "normal", priority: int | None = None, age_s: float = 0.0, generation: int = 0,
    request_id: uuid.UUID | None = None, business_date: date | None = None, source: str | None = None,
) -> dict[str, Any]:
    """A pending business task plus its queued execution on `client_id` (what the coordinator writes)."""
    brand = tenant["brands"][0]
    question_id = brand["question_ids"][question_index]
    day = business_date or date.today()
    prio = priority if priority is not None else {"high": 5000, "normal": 100, "normal_boosted": 1000,
                                                  "retry": 50}[lane]
    cur = await conn.execute(_INSERT_BUSINESS, {
        "tenant_id": tenant["tenant_id"], "workspace_id": tenant["workspace_id"], "brand_id": brand["brand_id"],
        "question_id": question_id, "ai_platform_id": platform_id, "business_date": day, "priority": prio,
        "lane": lane, "shard_key": ingest_shard_key(tenant["tenant_id"], brand["brand_id"], day), "attempts": 1,
        "request_id": request_id, "target": client_id if lane == "high" else None, "age_s": age_s})
    row = await cur.fetchone()
    assert row is not None
    task_id = uuid.uuid4()
    await conn.execute(_INSERT_EXECUTION, {
        "id": task_id, "kind": "monitor", "tenant_id": tenant["tenant_id"], "workspace_id": tenant["workspace_id"],
        "client_id": client_id, "priority": prio, "lane": lane, "lane_weight": lane_weight("monitor", lane),
        "source": source or ("collect_now" if lane == "high" else "retry_recovery" if lane == "retry"
                             else "daily_schedule"),
        "group": f"qid:{question_id}", "monitor_task_id": row["id"], "generation": generation,
        "enqueued_at": row["enqueued_at"], "brand_id": brand["brand_id"], "question_id": question_id,
        "ai_platform_id": platform_id, "business_date": day, "request_id": request_id})
    return {"task_id": task_id, "monitor_task_id": row["id"], "question_id": question_id}


async def insert_collect_request(conn: Conn, *, tenant: dict[str, Any], client_id: uuid.UUID | str,
                                 generation: int) -> uuid.UUID:
    request_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO monitoring_collect_requests (id, tenant_id, workspace_id, brand_id, requested_by_user_id, "
        "target_client_id, scope_hash, request_scope, interrupt_generation, ttl_expires_at) "
        "VALUES (%(id)s, %(t)s, %(w)s, %(b)s, %(u)s, %(c)s, 'x', '{}'::jsonb, %(g)s, now() + interval '5 minutes')",
        {"id": request_id, "t": tenant["tenant_id"], "w": tenant["workspace_id"], "b": tenant["brands"][0]["brand_id"],
         "u": tenant["user_id"], "c": client_id, "g": generation})
    return request_id


async def request_interrupt(conn: Conn, *, task_id: uuid.UUID, generation: int,
                            request_id: uuid.UUID | None = None) -> None:
    """What collect-now writes on a running scheduled execution (contract 4)."""
    await conn.execute(
        "UPDATE desktop_tasks SET control_flags = jsonb_build_object('interrupt_requested', true, "
        "'interrupt_generation', %(g)s::bigint, 'collect_request_id', %(r)s::text), interrupt_generation = %(g)s, "
        "interrupted_at = now(), interrupt_reason = 'collect_now_preempt' WHERE id = %(id)s",
        {"g": generation, "r": str(request_id) if request_id else None, "id": task_id})


@asynccontextmanager
async def running_hub(settings: Settings, **overrides: Any) -> AsyncIterator[TestServer]:
    """The real dispatch-hub app, in process, on a free port."""
    from services.dispatch_hub.main import build

    hub_settings = replace(settings, instance_id=f"hub-{uuid.uuid4().hex[:8]}", **overrides)
    server = TestServer(build(hub_settings), host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def insert_ready_task(conn: Conn, *, tenant: dict[str, Any], brand_index: int, question_index: int,
                            platform_id: int, age_s: float = 60.0) -> int:
    """A ready scheduled business task (what the scanner creates from a due plan), not yet dispatched."""
    brand = tenant["brands"][brand_index]
    day = date.today()
    cur = await conn.execute(
        "INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, "
        "business_date, status, dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner, enqueued_at) "
        "VALUES (%(t)s, %(w)s, %(b)s, %(q)s, %(p)s, %(d)s, 'pending', 100, 'normal', %(k)s, 'desktop_tasks', "
        "now() - make_interval(secs => %(age)s)) RETURNING id",
        {"t": tenant["tenant_id"], "w": tenant["workspace_id"], "b": brand["brand_id"],
         "q": brand["question_ids"][question_index], "p": platform_id, "d": day,
         "k": ingest_shard_key(tenant["tenant_id"], brand["brand_id"], day), "age": age_s})
    row = await cur.fetchone()
    assert row is not None
    return int(row["id"])
