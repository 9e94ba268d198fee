"""reconciler: leader-elected; runs each reconcile job on its own schedule (services/reconciler/jobs)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from libs.config import Settings
from libs.leader import LeaderLock
from libs.mq.topology import Topology
from libs.runtime import Lifetime, Service, Worker, add_broker_check
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.lifecycle import consume_lifecycle
from services.reconciler.runner import JobScheduler

SERVICE = Service("reconciler")


def build(settings: Settings, config: ReconcilerConfig | None = None) -> web.Application:
    jobs_config = config or ReconcilerConfig.from_env()

    async def start(life: Lifetime) -> Worker:
        settings = life.settings
        # One connection per concurrently running job at most; jobs are short, so 4 is plenty.
        pool = await life.pool(min_size=1, max_size=4)
        broker = await life.broker()
        # `connected`, not `is_closed`: a robust connection is not closed while it reconnects.
        add_broker_check(life.app, broker.connected.is_set, "broker connection lost")

        async def lead(stop: asyncio.Event) -> None:
            scheduler = JobScheduler(pool, jobs_config, JOBS.values())
            topology = Topology(settings.mq_prefix, settings.ingest_shards)
            async with asyncio.TaskGroup() as group:
                group.create_task(scheduler.run(stop), name="reconcile-jobs")
                group.create_task(consume_lifecycle(broker, topology, scheduler, stop), name="reconcile-lifecycle")

        return lambda stop: LeaderLock(settings.database_url, "reconciler", holder=settings.instance_id,
                                       fenced=[pool]).run(stop, lead)

    return SERVICE.worker_app(settings, start)


def main() -> None:
    SERVICE.serve(build)
