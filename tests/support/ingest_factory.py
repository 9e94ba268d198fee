"""Test and benchmark data for result ingest: business tasks with in-progress executions, MonitorResults.

Bulk inserts (generate_series / unnest) so benchmarks can create tens of thousands of executions fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from typing import Protocol

import aio_pika
import msgspec
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import MonitorResult
from libs.contracts.http import Citation
from libs.db.pool import Conn
from libs.db.write_health import WriterHealth
from libs.domain.shard import ingest_shard_key, shard_for
from libs.mq.connection import connect
from libs.mq.topology import Topology, declare_ingest
from services.ingest_shard_workers.consumer import IngestConfig, IngestWorker


@dataclass(frozen=True)
class World:
    tenant_id: int
    workspace_id: int
    brand_ids: list[int]
    # brand_id -> its question ids
    question_ids: dict[int, list[int]]
    platform_ids: list[int]
    client_id: uuid.UUID


@dataclass(frozen=True)
class Execution:
    task_id: uuid.UUID
    monitor_task_id: int
    lease_epoch: int
    tenant_id: int
    workspace_id: int
    brand_id: int
    question_id: int
    ai_platform_id: int
    business_date: date
    client_id: uuid.UUID
    collect_request_id: uuid.UUID | None = None


async def make_world(conn: Conn, *, brands: int = 1, questions: int = 2, platforms: int = 2) -> World:
    """A tenant with brands x questions, `platforms` AI platforms and one desktop client."""
    cur = await conn.execute("INSERT INTO tenants (name) VALUES ('ingest-test') RETURNING id")
    tenant_id = int((await cur.fetchone())["id"])  # type: ignore[index]
    workspace_id = tenant_id * 10
    cur = await conn.execute(
        "INSERT INTO ai_platforms (code, name) SELECT 'p' || %(tag)s || '-' || g, 'Platform ' || g "
        "FROM generate_series(1, %(n)s) g RETURNING id", {"tag": uuid.uuid4().hex[:8], "n": platforms})
    platform_ids = sorted(int(r["id"]) for r in await cur.fetchall())
    cur = await conn.execute(
        "INSERT INTO brands (tenant_id, workspace_id, name) SELECT %(t)s, %(w)s, 'brand ' || g "
        "FROM generate_series(1, %(n)s) g RETURNING id", {"t": tenant_id, "w": workspace_id, "n": brands})
    brand_ids = sorted(int(r["id"]) for r in await cur.fetchall())
    question_ids: dict[int, list[int]] = {}
    for brand_id in brand_ids:
        cur = await conn.execute(
            "INSERT INTO monitoring_questions (tenant_id, brand_id, text) SELECT %(t)s, %(b)s, 'question ' || g "
            "FROM generate_series(1, %(n)s) g RETURNING id", {"t": tenant_id, "b": brand_id, "n": questions})
        question_ids[brand_id] = sorted(int(r["id"]) for r in await cur.fetchall())
    client_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO desktop_clients (id, tenant_id, workspace_id, user_id, token_hash, online, last_heartbeat_at) "
        "VALUES (%(id)s, %(t)s, %(w)s, 1, %(h)s, true, now())",
        {"id": client_id, "t": tenant_id, "w": workspace_id, "h": hashlib.sha256(client_id.bytes).hexdigest()})
    return World(tenant_id, workspace_id, brand_ids, question_ids, platform_ids, client_id)


_INSERT_TASKS = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, dispatch_lane, dispatch_priority, dispatch_attempts, last_dispatched_at, ingest_shard_key,
    execution_owner, collect_request_id, trigger_source, target_client_id)
SELECT %(t)s, %(w)s, k.brand_id, k.question_id, k.platform_id, %(d)s, 'pending', %(lane)s, %(priority)s, 1, now(),
       k.shard_key, 'desktop_tasks', %(request)s, %(trigger)s, %(client)s
FROM unnest(%(brand_ids)s::bigint[], %(question_ids)s::bigint[], %(platform_ids)s::bigint[], %(shard_keys)s::text[])
     WITH ORDINALITY AS k(brand_id, question_id, platform_id, shard_key, ord)
ORDER BY k.ord
RETURNING id, brand_id, question_id, ai_platform_id
"""

_INSERT_EXECUTIONS = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
    source, scheduler_group_key, monitor_task_id, brand_id, question_id, ai_platform_id, business_date,
    collect_request_id, lease_token_hash, lease_epoch, leased_at, lease_expires_at, execution_phase, started_at,
    result_received_at)
SELECT e.id, 'monitor', %(t)s, %(w)s, %(client)s, 'in_progress', %(priority)s, %(lane)s, %(weight)s, %(source)s,
       'qid:' || e.question_id, e.monitor_task_id, e.brand_id, e.question_id, e.platform_id, %(d)s, %(request)s,
       repeat('0', 64), %(epoch)s, now(), now() + interval '2 minutes', 'WAITING', now(), now()
FROM unnest(%(ids)s::uuid[], %(monitor_task_ids)s::bigint[], %(brand_ids)s::bigint[], %(question_ids)s::bigint[],
            %(platform_ids)s::bigint[]) AS e(id, monitor_task_id, brand_id, question_id, platform_id)
"""

_INSERT_ATTEMPTS = """
INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, lease_epoch, status)
SELECT e.id, e.monitor_task_id, %(t)s, %(client)s, %(epoch)s, 'in_progress'
FROM unnest(%(ids)s::uuid[], %(monitor_task_ids)s::bigint[]) AS e(id, monitor_task_id)
"""


async def make_executions(conn: Conn, world: World, *, business_date: date, brand_id: int | None = None,
                          count: int | None = None, collect_request_id: uuid.UUID | None = None,
                          lease_epoch: int = 1) -> list[Execution]:
    """Business tasks (pending, desktop_tasks path) each with an in-progress execution and its attempt.

    One per (question, platform) of the brand (or of every brand), optionally the first `count`.
    """
    brands = [brand_id] if brand_id is not None else world.brand_ids
    keys = [(b, qid, p) for b in brands for qid in world.question_ids[b] for p in world.platform_ids]
    if count is not None:
        if count > len(keys):
            raise ValueError(f"only {len(keys)} business keys available, {count} asked")
        keys = keys[:count]
    high = collect_request_id is not None
    cur = await conn.execute(_INSERT_TASKS, {
        "t": world.tenant_id, "w": world.workspace_id, "d": business_date,
        "lane": "high" if high else "normal", "priority": 5000 if high else 100, "request": collect_request_id,
        "trigger": "manual" if high else "automatic", "client": world.client_id if high else None,
        "brand_ids": [k[0] for k in keys], "question_ids": [k[1] for k in keys], "platform_ids": [k[2] for k in keys],
        "shard_keys": [ingest_shard_key(world.tenant_id, k[0], business_date) for k in keys]})
    rows = await cur.fetchall()
    ids = [uuid.uuid4() for _ in rows]
    params = {
        "t": world.tenant_id, "w": world.workspace_id, "client": world.client_id, "d": business_date,
        "priority": 5000 if high else 100, "lane": "high" if high else "normal", "weight": 70 if high else 40,
        "source": "collect_now" if high else "daily_schedule", "request": collect_request_id, "epoch": lease_epoch,
        "ids": ids, "monitor_task_ids": [r["id"] for r in rows], "brand_ids": [r["brand_id"] for r in rows],
        "question_ids": [r["question_id"] for r in rows], "platform_ids": [r["ai_platform_id"] for r in rows]}
    await conn.execute(_INSERT_EXECUTIONS, params)
    await conn.execute(_INSERT_ATTEMPTS, params)
    return [Execution(task_id=tid, monitor_task_id=int(r["id"]), lease_epoch=lease_epoch, tenant_id=world.tenant_id,
                      workspace_id=world.workspace_id, brand_id=int(r["brand_id"]), question_id=int(r["question_id"]),
                      ai_platform_id=int(r["ai_platform_id"]), business_date=business_date, client_id=world.client_id,
                      collect_request_id=collect_request_id)
            for tid, r in zip(ids, rows, strict=True)]


async def redispatch(conn: Conn, execution: Execution) -> Execution:
    """End `execution` as expired (as the reconciler would) and start a new in-progress one for its task."""
    await conn.execute("UPDATE desktop_tasks SET status = 'aborted', finished_at = now() WHERE id = %s",
                       (execution.task_id,))
    new = replace(execution, task_id=uuid.uuid4())
    await conn.execute(
        "INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, "
        "lane_weight, source, monitor_task_id, brand_id, question_id, ai_platform_id, business_date, lease_epoch) "
        "VALUES (%s, 'monitor', %s, %s, %s, 'in_progress', 50, 'retry', 20, 'retry_recovery', %s, %s, %s, %s, %s, %s)",
        (new.task_id, new.tenant_id, new.workspace_id, new.client_id, new.monitor_task_id, new.brand_id,
         new.question_id, new.ai_platform_id, new.business_date, new.lease_epoch))
    return new


async def make_collect_request(conn: Conn, world: World, brand_id: int, *, requested: int,
                               created_ago: timedelta = timedelta(seconds=2)) -> uuid.UUID:
    request_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO monitoring_collect_requests (id, tenant_id, workspace_id, brand_id, requested_by_user_id, "
        "target_client_id, scope_hash, request_scope, status, requested_task_count, dispatched_task_count, "
        "ttl_expires_at, created_at) VALUES (%(id)s, %(t)s, %(w)s, %(b)s, 1, %(c)s, %(h)s, '{}'::jsonb, 'running', "
        "%(n)s, %(n)s, now() + interval '5 minutes', now() - %(ago)s)",
        {"id": request_id, "t": world.tenant_id, "w": world.workspace_id, "b": brand_id, "c": world.client_id,
         "h": request_id.hex, "n": requested, "ago": created_ago})
    return request_id


def make_result(execution: Execution, *, shards: int, status: str = "succeeded", brand_mentioned: bool = True,
                citations: Sequence[str] = ("https://example.com/a", "https://news.example.org/b"),
                answer: str = "an answer", error: str | None = None) -> MonitorResult:
    now = datetime.now(UTC)
    return MonitorResult(
        result_id=uuid.uuid4(), task_id=execution.task_id, monitor_task_id=execution.monitor_task_id,
        lease_epoch=execution.lease_epoch, tenant_id=execution.tenant_id, workspace_id=execution.workspace_id,
        brand_id=execution.brand_id, question_id=execution.question_id, ai_platform_id=execution.ai_platform_id,
        collector_type="desktop", run_mode="daily", business_date=execution.business_date,
        client_id=execution.client_id, status=status,  # type: ignore[arg-type]
        answer_text=answer if status == "succeeded" else None,
        citations=[Citation(url=url, title=f"title {i}", position=i) for i, url in enumerate(citations)]
        if status == "succeeded" else [],
        brand_mentioned=brand_mentioned, error=error if status == "failed" else None,
        started_at=now - timedelta(seconds=20), finished_at=now, received_at=now,
        collect_request_id=execution.collect_request_id,
        shard=shard_for(execution.tenant_id, execution.brand_id, execution.business_date, shards))


async def publish_results(channel: AbstractChannel, topology: Topology, results: Sequence[MonitorResult | bytes], *,
                          shard: int | None = None, concurrency: int = 1) -> None:
    """Publish with confirms to `shard.{k}` (k from the result, or `shard` for raw bodies), in order
    when concurrency is 1."""
    exchange = await channel.get_exchange(topology.result_exchange, ensure=False)

    async def one(item: MonitorResult | bytes) -> None:
        if isinstance(item, bytes):
            body, key, message_id = item, shard, uuid.uuid4().hex
        else:
            body, key, message_id = msgspec.json.encode(item), item.shard, str(item.result_id)
        await exchange.publish(aio_pika.Message(body=body, content_type="application/json", message_id=message_id,
                                                delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                               routing_key=f"shard.{key}")

    if concurrency <= 1:
        for item in results:
            await one(item)
        return
    for start in range(0, len(results), concurrency):
        await asyncio.gather(*(one(item) for item in results[start:start + concurrency]))


def shard_of(execution: Execution, shards: int) -> int:
    return shard_for(execution.tenant_id, execution.brand_id, execution.business_date, shards)


@contextlib.asynccontextmanager
async def running_ingest(pool: AsyncConnectionPool[Conn], settings: Settings, topology: Topology,
                         instance_id: str = "ingest-a", batch_size: int = 50,
                         write_health: WriterHealth | None = None,
                         db_outage_hold_s: float = 1200.0) -> AsyncIterator[IngestWorker]:
    connection = await connect(settings.amqp_url, name=instance_id)
    async with connection.channel() as channel:
        await declare_ingest(channel, topology)
    worker = IngestWorker(connection, topology, pool, IngestConfig(
        instance_id=instance_id, batch_size=batch_size, prefetch=2 * batch_size, db_outage_hold_s=db_outage_hold_s),
        write_health=write_health)
    async with running_worker(connection, worker):
        yield worker


class ConsumerWorker(Protocol):
    subscribed: asyncio.Event

    async def run(self, stop: asyncio.Event) -> None: ...


@contextlib.asynccontextmanager
async def running_worker(connection: AbstractRobustConnection, worker: ConsumerWorker) -> AsyncIterator[None]:
    """Run a consumer worker until the block ends (it has subscribed when the block starts); then stop it and
    close its broker connection."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.subscribed.wait(), 10)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await connection.close()


async def fetch(pool: AsyncConnectionPool[Conn], query: str, *args: object) -> list[dict[str, object]]:
    async with pool.connection() as conn:
        cur = await conn.execute(query, args or None)
        return list(await cur.fetchall())


async def publish(amqp: AbstractRobustConnection, topology: Topology, results: list[MonitorResult | bytes],
                  shard: int | None = None, concurrency: int = 1) -> None:
    async with amqp.channel() as channel:
        await publish_results(channel, topology, results, shard=shard, concurrency=concurrency)
