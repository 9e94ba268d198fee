"""The simulated desktop client against the in-process hub: lane order, phases, results, and the
misbehaviours other tests rely on (dying mid-task, ignoring interrupts)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aio_pika
import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.mq.topology import Topology
from tests.support.desktop import dispatch_execution, request_interrupt, running_hub
from tests.support.hub_routing import routed
from tests.support.wait import eventually
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=1, brands=1, questions=4, clients=1, due=False)


@pytest.fixture
async def hub(settings: Settings, amqp: AbstractRobustConnection) -> AsyncIterator[TestServer]:
    async with running_hub(settings) as server:
        yield server


def options(hub: TestServer, token: str, **extra: Any) -> SimOptions:
    return SimOptions(hub_url=str(hub.make_url("")), token=token, timings=TIMING_PROFILES["fast"], seed=1,
                      idle_poll_s=0.5, heartbeat_interval_s=0.5, **extra)


async def test_sim_runs_tasks_in_lane_order_through_every_phase(
        hub: TestServer, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    platform = seed["platforms"][0]["ai_platform_id"]
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1 WHERE id = %s", (client,))
        retry = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, lane="retry",
                                         age_s=100)
        normal = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client,
                                          question_index=1, age_s=50)
        high = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client, lane="high",
                                        question_index=2)
    async with SimClient(options(hub, token)) as sim:
        await eventually(lambda: _done(sim, 3), timeout=15, message="three tasks executed")
        assert [t for t, _ in sim.stats.executed] == [str(high["task_id"]), str(normal["task_id"]),
                                                      str(retry["task_id"])]
        assert sim.stats.phases[str(high["task_id"])] == [
            "PREPARING", "NAVIGATING", "AUTHENTICATING", "INPUTTING", "SUBMITTING", "WAITING", "PARSING", "POSTING"]
        # Four safe points per task, each measured.
        assert len(sim.stats.safe_point_intervals_ms) == 12
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT execution_phase, result_received_at IS NOT NULL AS r, started_at IS NOT NULL "
                                 "AS s FROM desktop_tasks WHERE id = %s", (high["task_id"],))
        assert await cur.fetchone() == {"execution_phase": "POSTING", "r": True, "s": True}


async def test_sim_can_die_mid_task(hub: TestServer, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=seed["platforms"][0]["ai_platform_id"],
                                      client_id=client)
    async with SimClient(options(hub, token, die_at_phase="INPUTTING")) as sim:
        await eventually(lambda: _value(sim.stats.died), timeout=10, message="the client died")
        assert sim.stats.executed == [] and sim.stats.aborted == []

        async def offline_with_task_left_running() -> bool:
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT d.status, d.execution_phase, c.online FROM desktop_tasks d "
                    "JOIN desktop_clients c ON c.id = d.target_client_id WHERE d.id = %s", (ex["task_id"],))
                row = await cur.fetchone()
            return row == {"status": "in_progress", "execution_phase": "AUTHENTICATING", "online": False}

        await eventually(offline_with_task_left_running, message="lease left to expire, client offline")


async def test_sim_ignoring_interrupts_finishes_its_task(
        hub: TestServer, pool: AsyncConnectionPool[Conn], seed: dict[str, Any], amqp: AbstractRobustConnection,
        topology: Topology) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    async with pool.connection() as conn:
        ex = await dispatch_execution(conn, tenant=tenant, platform_id=seed["platforms"][0]["ai_platform_id"],
                                      client_id=client)
    stubborn = options(hub, token, ignore_interrupts=True)
    stubborn.timings = TIMING_PROFILES["fast"].scaled(10)
    async with SimClient(stubborn) as sim:
        await eventually(lambda: _value(sim.active_phase(str(ex["task_id"])) == "AUTHENTICATING"), timeout=10,
                         interval=0.01, message="task started")
        async with pool.connection() as conn:
            await request_interrupt(conn, task_id=ex["task_id"], generation=1)
        channel = await amqp.channel()
        exchange = await channel.get_exchange(topology.dispatch_exchange)
        control = TaskControl(kind="monitor", task_id=ex["task_id"], target_client_id=uuid.UUID(client),
                              control="interrupt_requested", reason="collect_now_preempt", interrupt_generation=1,
                              updated_at=datetime.now(UTC))
        await exchange.publish(aio_pika.Message(msgspec.json.encode(control)),
                               routing_key=await routed(pool, f"monitor.control.{client}"))
        await channel.close()
        await eventually(lambda: _done(sim, 1), timeout=15, message="task finished despite the interrupt")
        assert sim.stats.aborted == []
        assert any(e.get("type") == "task_control" for e in sim.stats.events)


def _value(value: bool) -> Any:
    async def probe() -> bool:
        return value

    return probe()


def _done(sim: SimClient, count: int) -> Any:
    return _value(len(sim.stats.executed) >= count)


async def test_a_disabled_sim_stops_reconnecting(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                 seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client, token = tenant["clients"][0]["client_id"], tenant["clients"][0]["token"]
    async with running_hub(settings, hub_revocation_check_s=0.3) as hub, SimClient(options(hub, token)) as sim:
        await eventually(lambda: sim.stats.hellos >= 1 or None, timeout=10, message="connected")
        async with pool.connection() as conn:
            await conn.execute("UPDATE desktop_clients SET disabled_at = now() WHERE id = %s", (client,))
        await eventually(lambda: sim.stats.refused, timeout=10, message="told to stop")
        assert sim.stats.refused == "disabled" and sim.stats.connects == 1
