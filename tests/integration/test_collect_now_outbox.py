"""Collect-now through the real outbox pump to RabbitMQ: the events the hub and the coordinator consume."""

from __future__ import annotations

import asyncio
import uuid

import msgspec

from libs.config import Settings
from libs.contracts.amqp import LifecycleEvent
from libs.contracts.wire import TaskControl, dispatch_decoder
from libs.mq.topology import Topology
from libs.outbox.pump import AmqpPublisher, OutboxPump, PumpConfig
from tests.support.capture import capture
from tests.support.collect_now import api_client, business_task, execution, fetch_all, make_world, today
from tests.support.hub_routing import logical_key
from tests.support.wait import eventually


async def test_collect_now_events_reach_the_broker_in_order(settings: Settings, pool, topology: Topology,
                                                            amqp) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=1)
        other = world.tenant["brands"][1]
        day = await today(conn, world.tenant_id)
        client = world.client_id(0)
        tasks = [await business_task(conn, tenant_id=world.tenant_id, brand_id=other["brand_id"],
                                     question_id=other["question_ids"][0], ai_platform_id=p, business_date=day)
                 for p in world.platform_ids]
        queued = await execution(conn, monitor_task_id=tasks[0], client_id=client)
        running = await execution(conn, monitor_task_id=tasks[1], client_id=client, status="in_progress")

    publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="collect-now-test-pump")
    await publisher.start()
    pump = OutboxPump(pool, publisher, PumpConfig(claimed_by="collect-now-test-pump"),
                      listen_url=settings.database_url)
    stop = asyncio.Event()
    pump_task = asyncio.create_task(pump.run(stop))
    try:
        async with capture(amqp, topology.dispatch_exchange, f"#.monitor.control.{client}") as controls, \
                capture(amqp, topology.lifecycle_exchange, "collect_now.accepted") as lifecycle, \
                api_client(settings) as http:
            await asyncio.wait_for(pump.listening.wait(), 10)
            resp = await http.post(f"/api/tenant/monitoring/brands/{world.brand_id}/collect-now", json={},
                                   headers=world.auth())
            body = await resp.json()
            assert resp.status == 202, body
            await eventually(lambda: _done(len(controls.messages) >= 2 and len(lifecycle.messages) >= 1),
                             timeout=10, message="collect-now events on the broker")
            await eventually(lambda: _all_published(pool), timeout=10, message="outbox rows marked published")
    finally:
        stop.set()
        await asyncio.wait_for(pump_task, 10)
        await publisher.close()

    request_id = uuid.UUID(body["request_id"])
    events = [dispatch_decoder.decode(m.body) for m in controls.messages]
    assert all(isinstance(e, TaskControl) for e in events)
    # Per client, events arrive in commit order: the cancellation first, then the interrupt.
    assert [(e.task_id, e.control, e.interrupt_generation, e.collect_request_id) for e in events
            if isinstance(e, TaskControl)] == [
        (queued, "cancelled", 1, request_id), (running, "interrupt_requested", 1, request_id)]
    assert all(logical_key(m.routing_key) == f"monitor.control.{client}" for m in controls.messages)
    accepted = msgspec.json.decode(lifecycle.messages[0].body, type=LifecycleEvent)
    assert (accepted.event, accepted.collect_request_id, accepted.client_id) == (
        "collect_now.accepted", request_id, client)


async def _all_published(pool) -> bool:
    async with pool.connection() as conn:
        rows = await fetch_all(conn, "SELECT status FROM outbox")
    return len(rows) == 3 and {r["status"] for r in rows} == {"published"}


async def _done(value: bool) -> bool:
    return value


async def test_the_commit_wakes_the_pumps_only_for_control_events(settings: Settings, pool, database_url) -> None:
    """The coordinator is always woken; the pumps only when the request cancelled or interrupted something
    (prioritised control events), not for its lifecycle event alone."""
    from libs.db.pool import connect
    from libs.outbox import NOTIFY_CHANNEL
    from libs.outbox.writer import PRIORITY_WAKE
    from libs.tasks.transitions import DISPATCH_WAKE_CHANNEL

    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=1)
        busy = world.tenant["brands"][1]
        day = await today(conn, world.tenant_id)
        task = await business_task(conn, tenant_id=world.tenant_id, brand_id=busy["brand_id"],
                                   question_id=busy["question_ids"][0], ai_platform_id=world.platform_ids[0],
                                   business_date=day)
    listener = await connect(database_url, name="collect-now-notify-test")
    try:
        await listener.execute(f"LISTEN {DISPATCH_WAKE_CHANNEL}")
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        async with api_client(settings) as http:
            idle = await http.post(f"/api/tenant/monitoring/brands/{world.brand_id}/collect-now", json={},
                                   headers=world.auth())
            assert idle.status == 202, await idle.json()
            assert [n.channel async for n in listener.notifies(timeout=0.5)] == [DISPATCH_WAKE_CHANNEL]
            async with pool.connection() as conn:
                await execution(conn, monitor_task_id=task, client_id=world.client_id(0))
            busy_click = await http.post(f"/api/tenant/monitoring/brands/{busy['brand_id']}/collect-now", json={},
                                         headers=world.auth())
            assert (await busy_click.json())["aborted_queued_count"] == 1
            woken = {(n.channel, n.payload) async for n in listener.notifies(timeout=0.5)}
            assert woken == {(DISPATCH_WAKE_CHANNEL, ""), (NOTIFY_CHANNEL, PRIORITY_WAKE)}
    finally:
        await listener.close()
