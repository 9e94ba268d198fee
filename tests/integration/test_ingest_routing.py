"""The routing table and the hub's routing by it, on real Postgres and RabbitMQ: one reshard at a time, drains only
for a draining epoch, a publisher that still routes by a retired epoch re-routed, not refused or lost, and a result that
reached an old queue behind its drain marker forwarded to the new epoch and applied there once."""

from __future__ import annotations

import asyncio
from datetime import date

import aio_pika
import msgspec
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import MonitorResult, result_decoder
from libs.db.pool import Conn
from libs.ingest.routing import Routing, RoutingStore, routed
from libs.mq.topology import Topology, declare_ingest
from libs.telemetry import metrics as m
from services.dispatch_hub.results import AmqpResultPublisher, RoutingTableRouter, publish_routed
from tests.support.ingest_factory import fetch, make_executions, make_result, make_world, running_ingest
from tests.support.monitorctl import monitorctl_json, run_monitorctl
from tests.support.wait import eventually
from tools.monitorctl.cmd_ingest import _mark_tails, _unbind


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


async def test_a_late_result_behind_the_drain_marker_is_forwarded_and_applied_once_by_the_new_epoch(
        pool: AsyncConnectionPool[Conn], settings, topology: Topology, amqp) -> None:
    """A result routed by the old epoch that reached its queue after that queue's drain marker (the broker held the
    publish past the grace, docs/reliability.md "Online resharding"): the old shard must not apply it (its key now
    belongs to a new-epoch shard) but forward it to the active epoch, whose shard applies it once, after the old
    shards it takes keys from are drained."""
    async with pool.connection() as conn:
        world = await make_world(conn, brands=1, questions=1, platforms=1)
        [execution] = await make_executions(conn, world, business_date=date(2026, 3, 22))
    old, new = Routing(0, topology.ingest_shards), Routing(1, 8)
    store = RoutingStore(topology.ingest_shards)
    late = make_result(execution, shards=old.shards)
    target = routed(late, new)
    forwarded_before = m.ingest_reshard_forwarded_count.value()
    async with running_ingest(pool, settings, topology) as worker:
        async with amqp.channel() as channel:
            await declare_ingest(channel, topology, [new])
            async with pool.connection() as conn:
                assert await store.start_epoch(conn, old, new.shards) == new.epoch
            await _unbind(channel, topology, old)
            async with pool.connection() as conn:
                await store.mark_unbound(conn, old.epoch)
            await eventually(lambda: worker.routing.active == new, message="the worker reading the new epoch")
            await _mark_tails(channel, topology, old, frozenset())
            # Behind its shard's marker, in the old queue itself: what the unbind can no longer stop.
            await channel.default_exchange.publish(aio_pika.Message(
                body=msgspec.json.encode(late), content_type="application/json", message_id=str(late.result_id),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=topology.ingest_queue(late.shard, old.epoch), timeout=10.0)
        ledger = await eventually(lambda: fetch(pool, "SELECT routing_epoch FROM ingest_applied_results"),
                                  timeout=30.0, message="the late result applied")
        assert [row["routing_epoch"] for row in ledger] == [new.epoch]
        assert m.ingest_reshard_forwarded_count.value() - forwarded_before == 1
        assert worker.consumers[(old.epoch, late.shard)].drained
        assert worker.consumers[(new.epoch, target.shard)].subscribed
    assert len(await fetch(pool, "SELECT 1 FROM question_monitor_runs")) == 1
    async with pool.connection() as conn:
        assert (await store.state(conn)).drained == frozenset(range(old.shards))
