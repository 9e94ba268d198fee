"""Shared benchmark plumbing: a fresh migrated database, a unique broker prefix, percentiles."""

from __future__ import annotations

import os
import statistics
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
from psycopg import sql
from psycopg.conninfo import make_conninfo

from libs.config import Settings
from libs.db.migrate import migrate
from libs.db.pool import connect
from libs.mq.topology import Topology, delete_all


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> str:
    return (f"n={len(values)} p50={percentile(values, 50):.2f} p90={percentile(values, 90):.2f} "
            f"p99={percentile(values, 99):.2f} max={max(values):.2f} mean={statistics.fmean(values):.2f}")


@asynccontextmanager
async def bench_environment(shards: int = 16) -> AsyncIterator[Settings]:
    admin_url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    amqp_url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    name = f"mon_bench_{uuid.uuid4().hex[:10]}"
    admin = await connect(make_conninfo(admin_url, dbname="postgres"))
    await admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = make_conninfo(admin_url, dbname=name)
    await migrate(url)
    topology = Topology(prefix=f"b{uuid.uuid4().hex[:8]}.", ingest_shards=shards)
    settings = Settings(database_url=url, amqp_url=amqp_url, mq_prefix=topology.prefix, ingest_shards=shards,
                        gateway_jwt_secret="bench-gateway-secret-0123456789abcdef", db_pool_max=6)
    try:
        yield settings
    finally:
        connection = await aio_pika.connect_robust(amqp_url)
        async with connection.channel() as channel:
            await delete_all(channel, topology)
        await connection.close()
        await admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        await admin.close()
