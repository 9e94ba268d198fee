"""An ingest replica whose broker connection drops while it starts (a broker restart as a pod comes up; the service
chaos run met it: the replica exited instead of coming up) carries on once the connection is back, on real Postgres
and RabbitMQ (`IngestWorker._start`)."""

from __future__ import annotations

from datetime import date
from typing import Any

from aiormq.exceptions import AMQPConnectionError
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.mq.connection import connect
from libs.mq.topology import declare_ingest
from services.ingest_shard_workers.consumer import IngestConfig, IngestWorker
from tests.support.ingest_factory import fetch, make_executions, make_result, make_world, publish, running_worker
from tests.support.wait import eventually


async def test_a_connection_dropped_during_start_up_is_waited_for_and_the_start_carried_on(
        pool: AsyncConnectionPool[Conn], settings, topology, amqp) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        [execution] = await make_executions(conn, world, business_date=date(2026, 3, 23))
    connection = await connect(settings.amqp_url, name="ingest-start")
    async with connection.channel() as channel:
        await declare_ingest(channel, topology)
    opened = connection.channel
    drops = []

    def channel_dropping_twice(*args: Any, **kwargs: Any) -> Any:
        # What aiormq raises when the broker closes the connection under a channel being opened.
        if len(drops) < 2:
            drops.append(1)
            raise AMQPConnectionError("Server connection unexpectedly closed. Read 0 bytes but 1 bytes expected")
        return opened(*args, **kwargs)

    connection.channel = channel_dropping_twice  # type: ignore[method-assign]
    worker = IngestWorker(connection, topology, pool, IngestConfig(instance_id="ingest-start", batch_size=10,
                                                                   prefetch=20))
    async with running_worker(connection, worker):
        assert len(drops) == 2 and all(shard.subscribed for shard in worker.shards)
        await publish(amqp, topology, [make_result(execution, shards=topology.ingest_shards)])
        await eventually(lambda: fetch(pool, "SELECT 1 FROM ingest_applied_results"), message="the result applied")
