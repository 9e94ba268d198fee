"""Push-lease end to end (issue 25, item 1): real outbox-pump, dispatch-coordinator, dispatch-hub, collect-now-api,
ingest-shard-workers and reconciler processes with push-lease on, an old pull-lease client and push-lease clients
(tools.desktop_sim over real WebSockets) in the same run. Both kinds complete clicked work; the push client never
calls lease; a reconnect replays a live pushed lease with the same token and no second lease; a pushed lease nobody
starts expires and is requeued to a client, which completes it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import PUSH_LEASE
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from tests.support.db import fetch as rows
from tests.support.db import one
from tests.support.stack import DISPATCH_SERVICES, Stack, running_stack
from tests.support.wait import eventually
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions

FAST = TIMING_PROFILES["fast"]
PUSH_ENV: dict[str, str | int] = {
    "HUB_HEARTBEAT_FLUSH_S": "0.3", "HUB_PING_INTERVAL_S": "1",
    "PUSH_LEASE_ENABLED": "1", "PUSH_LEASE_SECRET": "5e" * 32, "PUSH_LEASE_TTL_SECONDS": "5",
    "RECONCILER_INTERVALS": "expired_leases=0.5",
}

pytestmark = pytest.mark.timeout(150)


async def _seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    """One tenant, three clients (two slots each), four brands of 2 questions on openai (2 tasks a click; a brand
    collected once a day, so each scenario clicks its own)."""
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=4, questions=2, clients=3, platforms=("openai",), due=False)
        await conn.execute("UPDATE platform_settings SET max_concurrent = 20")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 2")
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000}.items():
            await set_setting(conn, key, value)
    return seed


def _sim(stack: Stack, token: str, *, scale: float = 1.0, **options: Any) -> SimClient:
    return SimClient(SimOptions(hub_url=stack.hub_url, token=token, timings=FAST.scaled(scale), max_concurrent=2,
                                heartbeat_interval_s=1.0, ws_ping_interval_s=2.0, idle_poll_s=1.0, seed=7, **options))


async def _click_and_finish(stack: Stack, pool: AsyncConnectionPool[Conn], tenant: dict[str, Any], brand: int,
                            client_id: str, *, timeout: float = 40) -> uuid.UUID:
    accepted = await stack.collect_now(tenant, brand, {"target_client_id": client_id})
    request_id = uuid.UUID(accepted["request_id"])

    async def done() -> bool:
        row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s", request_id)
        return row["status"] == "succeeded"

    await eventually(done, timeout=timeout, interval=0.1, message=f"request {request_id} succeeded\n{stack.logs()}")
    return request_id


async def _executions(pool: AsyncConnectionPool[Conn], request_id: uuid.UUID) -> list[dict[str, Any]]:
    return await rows(pool, "SELECT id, monitor_task_id, target_client_id, status, lease_epoch FROM desktop_tasks "
                            "WHERE collect_request_id = %s ORDER BY created_at, id", request_id)


async def test_pull_and_push_clients_in_one_run(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                tmp_path: Path) -> None:
    seed = await _seed(pool)
    tenant = seed["tenants"][0]
    (pull_id, pull_token), (push_id, push_token), (lost_id, lost_token) = [
        (c["client_id"], c["token"]) for c in tenant["clients"]]
    brands = [b["brand_id"] for b in tenant["brands"]]
    async with running_stack(settings, tmp_path, services=(*DISPATCH_SERVICES, "reconciler"), **PUSH_ENV) as stack:
        pull = _sim(stack, pull_token)  # an old client: asks for nothing, leases by pull
        push = _sim(stack, push_token, push_lease=True)
        async with pull, push:
            await eventually(lambda: pull.connected.is_set() and push.connected.is_set(), timeout=20,
                             message=f"both clients connected\n{stack.logs()}")
            assert push.stats.granted == [PUSH_LEASE] and pull.stats.granted == []
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT id::text, push_lease FROM desktop_clients WHERE id = ANY(%s)",
                                         ([uuid.UUID(pull_id), uuid.UUID(push_id)],))
                assert {r["id"]: r["push_lease"] for r in await cur.fetchall()} == {pull_id: False, push_id: True}

            # The push client: both tasks arrive leased and are run without a lease call.
            request = await _click_and_finish(stack, pool, tenant, brands[0], push_id)
            done = await _executions(pool, request)
            assert len(done) == 2 and {r["status"] for r in done} == {"succeeded"}
            assert {str(r["id"]) for r in done} == set(push.stats.pushed)
            assert push.stats.lease_calls == 0
            # The old client, in the same run: it is told, leases by call, and finishes.
            calls_before = pull.stats.lease_calls
            request = await _click_and_finish(stack, pool, tenant, brands[1], pull_id)
            assert {r["status"] for r in await _executions(pool, request)} == {"succeeded"}
            assert pull.stats.lease_calls > calls_before and not pull.stats.pushed and not pull.stats.pushed_tokens

        # A reconnect while a pushed lease runs: the replay carries the same token, and there is no second lease.
        slow = _sim(stack, push_token, push_lease=True, scale=10)
        async with slow:
            await eventually(lambda: slow.connected.is_set(), timeout=20, message="the push client reconnected")
            accepted = await stack.collect_now(tenant, brands[2], {"target_client_id": push_id})
            await eventually(lambda: len(slow.stats.pushed) == 2, timeout=20,
                             message=f"two pushed leases running\n{stack.logs()}")
            hellos = slow.stats.hellos
            slow.disconnect()
            await eventually(lambda: slow.stats.hellos > hellos and all(
                len(slow.stats.pushed_tokens[t]) == 2 for t in slow.stats.pushed), timeout=20,
                message=f"the replay after the reconnect\n{stack.logs()}")
            for task_id in slow.stats.pushed:
                first, replayed = slow.stats.pushed_tokens[task_id]
                assert replayed == first
            assert slow.stats.pushed == list(dict.fromkeys(slow.stats.pushed))  # each started once
            request_id = uuid.UUID(accepted["request_id"])
            await eventually(lambda: _succeeded(pool, request_id), timeout=60, interval=0.2,
                             message=f"the slow pushed work finished\n{stack.logs()}")
            attempts = await rows(pool, "SELECT a.task_id, a.lease_epoch FROM desktop_task_attempts a JOIN "
                                        "desktop_tasks d ON d.id = a.task_id WHERE d.collect_request_id = %s",
                                  request_id)
            assert sorted(a["lease_epoch"] for a in attempts) == [1, 1]  # one lease each, never a second
            assert slow.stats.lease_calls == 0

        # A push client that never starts what it is pushed: the lease expires, the reconciler requeues it, and it
        # is dispatched again (to that client, the click's target), which runs it this time.
        lost = _sim(stack, lost_token, push_lease=True, ignore_pushed_leases=True)
        async with lost:
            await eventually(lambda: lost.connected.is_set(), timeout=20, message="the third client connected")
            accepted = await stack.collect_now(tenant, brands[3], {"target_client_id": lost_id})
            request_id = uuid.UUID(accepted["request_id"])
            await eventually(lambda: len(lost.stats.pushed_tokens) == 2, timeout=20,
                             message=f"two pushed leases ignored\n{stack.logs()}")
            ignored = set(lost.stats.pushed_tokens)
            lost.options.ignore_pushed_leases = False
            await eventually(lambda: _succeeded(pool, request_id), timeout=60, interval=0.2,
                             message=f"the requeued work finished\n{stack.logs()}")
            executions = await _executions(pool, request_id)
            first = [r for r in executions if str(r["id"]) in ignored]
            again = [r for r in executions if str(r["id"]) not in ignored]
            assert {r["status"] for r in first} == {"aborted"} and len(first) == 2
            expired = await rows(pool, "SELECT status FROM desktop_task_attempts WHERE task_id = ANY(%s)",
                                 [r["id"] for r in first])
            assert {a["status"] for a in expired} == {"expired"}
            assert {r["status"] for r in again} == {"succeeded"}
            assert {r["monitor_task_id"] for r in again} == {r["monitor_task_id"] for r in first}
            assert {str(r["target_client_id"]) for r in again} == {lost_id}
            assert lost.stats.lease_calls == 0


async def _succeeded(pool: AsyncConnectionPool[Conn], request_id: uuid.UUID) -> bool:
    row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s", request_id)
    return bool(row["status"] == "succeeded")
