"""The routing table and the hub's routing by it, on real Postgres and RabbitMQ: one reshard at a time, drains only
for a draining epoch, and a publisher that still routes by a retired epoch re-routed, not refused or lost."""

from __future__ import annotations

import asyncio
from datetime import date

from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import MonitorResult, result_decoder
from libs.db.pool import Conn
from libs.ingest.routing import Routing, RoutingStore
from libs.mq.topology import Topology, declare_ingest
from services.dispatch_hub.results import AmqpResultPublisher, RoutingTableRouter, publish_routed
from tests.support.ingest_factory import make_executions, make_result, make_world
from tests.support.monitorctl import monitorctl_json, run_monitorctl


async def test_one_reshard_at_a_time_and_drains_only_while_draining(pool: AsyncConnectionPool[Conn]) -> None:
    store = RoutingStore(default_shards=4)
    async with pool.connection() as conn:
        assert (await store.state(conn)).active == Routing(0, 4)
        assert not await store.mark_drained(conn, 0, 1, "t")  # epoch 0 is not draining: a stray marker
        assert await store.start_epoch(conn, Routing(0, 4), 8) == 1
        state = await store.state(conn)
        assert (state.active, state.draining) == (Routing(1, 8), Routing(0, 4))
        assert await store.start_epoch(conn, Routing(1, 8), 2) is None  # refused while epoch 0 drains
        assert not await store.mark_drained(conn, 0, 1, "t")  # not unbound yet
        await store.mark_unbound(conn, 0)
        for shard in range(4):
            assert await store.mark_drained(conn, 0, shard, "t")
        assert await store.retire(conn, 0)
        assert (await store.state(conn)) == type(state)(Routing(1, 8))


async def test_a_stale_publisher_is_re_routed_to_the_active_epoch(pool: AsyncConnectionPool[Conn], topology: Topology,
                                                                  amqp) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        [execution] = await make_executions(conn, world, business_date=date(2026, 3, 21))
    stale = RoutingTableRouter(pool, topology.ingest_shards, max_age_s=3600)
    publisher = AmqpResultPublisher(amqp, topology, router=stale)
    await publisher.start()  # declares and binds epoch 0
    store = RoutingStore(topology.ingest_shards)
    new = Routing(1, 8)
    try:
        async with amqp.channel() as channel:
            await declare_ingest(channel, topology, [new])
            async with pool.connection() as conn:
                assert await store.start_epoch(conn, Routing(0, topology.ingest_shards), 8) == 1
            for shard in range(topology.ingest_shards):
                queue = await channel.get_queue(topology.ingest_queue(shard))
                await queue.unbind(topology.result_exchange, routing_key=f"shard.{shard}")
            result: MonitorResult = make_result(execution, shards=topology.ingest_shards)
            sent = await publish_routed(publisher, stale, result)  # by epoch 0: returned, then by epoch 1
            assert (sent.routing_epoch, sent.shard) == (1, new.shard_of(result.tenant_id, result.brand_id,
                                                                        result.business_date))
            # (basic.get is refused on single-active-consumer queues: consume the one message)
            queue = await channel.get_queue(topology.ingest_queue(sent.shard, 1))
            async with queue.iterator() as messages:
                got = await asyncio.wait_for(anext(aiter(messages)), 10)
                assert result_decoder.decode(got.body) == sent
                await got.ack()
    finally:
        await publisher.close()
        async with amqp.channel() as channel:
            for shard in range(8):
                await channel.queue_delete(topology.ingest_queue(shard, 1))


async def test_reshard_is_a_dry_run_unless_applied_and_refuses_a_second_one(pool: AsyncConnectionPool[Conn],
                                                                             settings) -> None:
    env = {"MQ_PREFIX": settings.mq_prefix, "INGEST_SHARDS": str(settings.ingest_shards)}
    plan = await monitorctl_json(settings, "ingest", "reshard", "8", env=env)
    assert plan["status"] == "dry_run" and plan["to"] == {"epoch": 1, "shards": 8}
    assert plan["waits_for"]["5"] == [1]
    store = RoutingStore(settings.ingest_shards)
    async with pool.connection() as conn:
        assert (await store.state(conn)).active == Routing(0, 4)  # nothing changed
        await store.start_epoch(conn, Routing(0, 4), 8)  # a reshard to 8 under way
    refused = await asyncio.to_thread(run_monitorctl, settings, "ingest", "reshard", "2", "--apply", env=env)
    assert refused.returncode == 2 and "a reshard from 4 to 8 shards is under way" in refused.stderr
