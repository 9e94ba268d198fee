"""Run the dispatch coordinator (behind its leader lock) and an outbox pump inside a test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aio_pika.abc import AbstractRobustConnection

from libs.config import Settings
from libs.db.pool import make_pool
from libs.leader import LeaderLock
from libs.mq.connection import connect as mq_connect
from libs.mq.topology import Topology
from libs.outbox.pump import AmqpPublisher, OutboxPump, PumpConfig
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig
from tests.support.wait import eventually


@dataclass
class Running:
    coordinator: Coordinator
    leader: LeaderLock
    pump: OutboxPump | None
    amqp: AbstractRobustConnection


@contextlib.asynccontextmanager
async def run_coordinator(settings: Settings, *, with_pump: bool = True) -> AsyncIterator[Running]:
    pool = make_pool(settings, name="coordinator-under-test", min_size=1, max_size=4)
    await pool.open(wait=True)
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    amqp = await mq_connect(settings.amqp_url, name="coordinator-under-test")
    coordinator = Coordinator(pool, CoordinatorConfig(database_url=settings.database_url, topology=topology,
                                                      instance_id="test-coordinator"), amqp)
    leader = LeaderLock(settings.database_url, "dispatch-coordinator", retry_interval=0.2, check_interval=0.5,
                        fenced=[pool])
    stop = asyncio.Event()
    tasks = [asyncio.create_task(leader.run(stop, coordinator.lead))]
    pump = None
    publisher = None
    pump_pool = None
    if with_pump:
        pump_pool = make_pool(settings, name="pump-under-test", min_size=1, max_size=2)
        await pump_pool.open(wait=True)
        publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="pump-under-test")
        await publisher.start()
        pump = OutboxPump(pump_pool, publisher, PumpConfig(claimed_by="pump-under-test", batch_size=500,
                                                           poll_interval_s=0.2), listen_url=settings.database_url)
        tasks.append(asyncio.create_task(pump.run(stop)))
    try:
        await eventually(lambda: _ready(coordinator), timeout=15, message="coordinator leading and consuming")
        yield Running(coordinator=coordinator, leader=leader, pump=pump, amqp=amqp)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        if publisher is not None:
            await publisher.close()
        if pump_pool is not None:
            await pump_pool.close()
        await amqp.close()
        await pool.close()


async def _ready(coordinator: Coordinator) -> bool:
    return coordinator.listening.is_set() and coordinator.consuming.is_set()
