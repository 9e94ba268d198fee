"""reconciler: leader-elected; runs each reconcile job on its own schedule (services/reconciler/jobs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aio_pika.abc import AbstractRobustConnection
from aiohttp import web
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn, make_pool
from libs.http import add_readiness_check, make_app
from libs.leader import LeaderLock
from libs.mq.connection import connect as mq_connect
from libs.mq.topology import Topology
from libs.runtime import SETTINGS, add_pool_check, background, base_app, serve
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.lifecycle import consume_lifecycle
from services.reconciler.runner import JobScheduler

POOL = web.AppKey("pool", AsyncConnectionPool[Conn])
BROKER = web.AppKey("broker", AbstractRobustConnection)
CONFIG = web.AppKey("reconciler_config", ReconcilerConfig)


def build(settings: Settings, config: ReconcilerConfig | None = None) -> web.Application:
    app = base_app(settings, make_app())
    app[CONFIG] = config or ReconcilerConfig.from_env()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        # One connection per concurrently running job at most; jobs are short, so 4 is plenty.
        pool = make_pool(settings, name="reconciler", min_size=1, max_size=4)
        await pool.open(wait=True, timeout=30)
        broker = await mq_connect(settings.amqp_url, name=f"reconciler-{settings.instance_id}")
        app[POOL] = pool
        app[BROKER] = broker
        add_pool_check(app, pool)

        async def broker_ready() -> None:
            if broker.is_closed:
                raise ConnectionError("broker connection closed")

        add_readiness_check(app, "rabbitmq", broker_ready)
        yield
        await broker.close()
        await pool.close()

    async def lead(stop: asyncio.Event) -> None:
        settings = app[SETTINGS]
        scheduler = JobScheduler(app[POOL], app[CONFIG], JOBS.values())
        topology = Topology(settings.mq_prefix, settings.ingest_shards)
        async with asyncio.TaskGroup() as group:
            group.create_task(scheduler.run(stop), name="reconcile-jobs")
            group.create_task(consume_lifecycle(app[BROKER], topology, scheduler, stop), name="reconcile-lifecycle")

    async def leader(stop: asyncio.Event) -> None:
        await LeaderLock(app[SETTINGS].database_url, "reconciler").run(stop, lead)

    app.cleanup_ctx.append(resources)
    background(app, "reconciler", leader)
    return app


def main() -> None:
    serve("reconciler", build)
