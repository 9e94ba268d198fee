"""The reconciler as a process: leader election, scheduled jobs, events through the outbox, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.mq.topology import Topology
from tests.support.capture import capture
from tests.support.procs import ServiceProcess, service_env
from tests.support.reconcile_factory import execution, heartbeat, insert_execution, insert_task, make_world
from tests.support.wait import eventually

FAST = "expired_leases=0.3,request_ttl=0.3,offline_clients=0.3,interrupt_timeouts=0.3,unknown_executions=0.3"


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2) as resp:
        body: dict[str, Any] = json.loads(resp.read())
        return body


def _leader_gauge(proc: ServiceProcess) -> float:
    with urllib.request.urlopen(proc.url + "/metrics", timeout=2) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('leader_is_active{role="reconciler"}'):
                return float(line.split()[-1])
    return 0.0


async def leader_gauge(proc: ServiceProcess) -> float:
    return await asyncio.to_thread(_leader_gauge, proc)


@pytest.fixture
def procs(settings: Settings, tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    for proc in started:
        proc.stop()


async def test_leader_runs_jobs_publishes_events_and_hands_over(
    settings: Settings, pool: AsyncConnectionPool[Conn], amqp: aio_pika.abc.AbstractRobustConnection,
    topology: Topology, procs: list[ServiceProcess], tmp_path: Path,
) -> None:
    env = service_env(settings, RECONCILER_INTERVALS=FAST)
    async with capture(amqp, topology.lifecycle_exchange, "#") as lifecycle, \
            capture(amqp, topology.dispatch_exchange, "#.monitor.control.#") as controls:
        procs.append(ServiceProcess("outbox-pump", env, log_dir=tmp_path).start())
        first = ServiceProcess("reconciler", env, log_dir=tmp_path).start()
        procs.append(first)
        second = ServiceProcess("reconciler", env, log_dir=tmp_path).start()
        procs.append(second)
        ready = await asyncio.to_thread(get_json, first.url + "/readyz")
        assert ready["checks"] == {"postgres": "ok", "schema": "ok", "rabbitmq": "ok"}

        async def one_leader() -> list[float] | None:
            gauges = [await leader_gauge(first), await leader_gauge(second)]
            return gauges if sorted(gauges) == [0.0, 1.0] else None

        gauges = await eventually(one_leader, timeout=10, message="exactly one reconciler leading")
        leader, standby = (first, second) if gauges[0] == 1.0 else (second, first)

        async with pool.connection() as conn:
            w = await make_world(conn, clients=2)
            await heartbeat(conn, w.clients[1], seconds_ago=1)
            task = await insert_task(conn, w, dispatch_attempts=1)
            exec_id = await insert_execution(conn, w, task, w.clients[0], lease_expires_in=-1)

        async def aborted() -> bool:
            async with pool.connection() as conn:
                return (await execution(conn, exec_id))["status"] == "aborted"

        await eventually(aborted, timeout=10, message="expired lease reconciled by the leader")

        def events() -> list[dict[str, object]]:
            return [msgspec.json.decode(body) for body in lifecycle.bodies]

        await eventually(lambda: _async(any(e["event"] == "task.aborted" and e["task_id"] == str(exec_id)
                                            for e in events())), timeout=10, message="task.aborted on the broker")
        await eventually(lambda: _async(any(msgspec.json.decode(b)["control"] == "lease_revoked"
                                            for b in controls.bodies)), timeout=10, message="lease_revoked")
        # The client with no heartbeat at all was never online; the stale-heartbeat rule does not flap it.
        assert not any(e["event"] == "client.offline" for e in events())

        # Graceful stop of the leader; the standby takes over and keeps reconciling.
        assert leader.stop() == 0

        async def standby_leads() -> bool:
            return await leader_gauge(standby) == 1.0

        await eventually(standby_leads, timeout=15, message="standby takes over")
        async with pool.connection() as conn:
            await heartbeat(conn, w.clients[1], seconds_ago=120)

        async def offline() -> bool:
            return any(e["event"] == "client.offline" and e["client_id"] == str(w.clients[1]) for e in events())

        await eventually(offline, timeout=10, message="client.offline from the new leader")
        # The job logs its run once it has ended, which can be after its event reached the broker.
        await eventually(lambda: '"event": "reconcile job ran"' in standby.logs(), timeout=10,
                         message="the new leader's job run in its log")


async def _async(value: bool) -> bool:
    return value
