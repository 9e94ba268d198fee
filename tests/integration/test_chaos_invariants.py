"""The service chaos test's invariants (tests/support/chaos.py) on both execution paths, against real Postgres: each
one flags a legacy lease that breaks it (alone or together with desktop_tasks executions), and passes the same rows
when nothing is wrong. The chaos run itself only ever shows the passing side; this is the failing side."""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn
from libs.dispatch_settings import set_setting
from libs.mq.topology import DISPATCH
from libs.outbox import enqueue
from services.dispatch_hub.logic import result_id_for
from tests.support.chaos import (
    ChaosClient,
    ChaosStack,
    Fleet,
    Invariant,
    Replica,
    check_controls,
    check_double_execution,
    check_legacy_leases,
    check_limits,
    check_paths,
    check_results,
    check_service_repairs,
    rollout_legacy,
)
from tests.support.procs import ServiceProcess
from tests.support.reconcile_factory import World, insert_execution, insert_legacy_lease, insert_task, make_world
from tools.desktop_sim.client import SimOptions

WINDOW_S = 10


async def lease(conn: Conn, world: World, monitor_task_id: int, client_id: uuid.UUID, *, created: float,
                leased: float | None = None, finished: float | None = None, received: float | None = None,
                status: str = "succeeded", lane: str = "normal", reason: str | None = None) -> uuid.UUID:
    """A legacy lease's history row with its moments in seconds from `base()` (the business row left alone)."""
    lease_id = uuid.uuid4()
    await conn.execute(
        """
        INSERT INTO legacy_leases (id, monitor_task_id, tenant_id, workspace_id, target_client_id, ai_platform_id,
                                   brand_id, question_id, business_date, lane, lane_weight, priority, status,
                                   lease_epoch, interrupt_reason, enqueued_at, created_at, leased_at, finished_at,
                                   result_received_at)
        SELECT %(id)s, t.id, t.tenant_id, t.workspace_id, %(client)s, t.ai_platform_id, t.brand_id, t.question_id,
               t.business_date, %(lane)s, 100, t.dispatch_priority, %(status)s, %(epoch)s, %(reason)s, t.enqueued_at,
               to_timestamp(%(created)s), to_timestamp(%(leased)s), to_timestamp(%(finished)s),
               to_timestamp(%(received)s)
        FROM monitoring_collect_tasks t WHERE t.id = %(task)s
        """,
        {"id": lease_id, "client": client_id, "lane": lane, "status": status, "epoch": 0 if leased is None else 1,
         "reason": reason, "task": monitor_task_id, "created": at(created), "leased": at(leased),
         "finished": at(finished), "received": at(received)})
    return lease_id


async def attempt(conn: Conn, world: World, monitor_task_id: int, client_id: uuid.UUID, *, started: float,
                  finished: float) -> uuid.UUID:
    """A desktop_tasks execution of the business task, leased once, over [started, finished)."""
    task_id = await insert_execution(conn, world, monitor_task_id, client_id)
    await conn.execute("UPDATE desktop_task_attempts SET started_at = to_timestamp(%s), "
                       "finished_at = to_timestamp(%s), status = 'succeeded' WHERE task_id = %s",
                       (at(started), at(finished), task_id))
    await conn.execute("UPDATE desktop_tasks SET status = 'succeeded', created_at = to_timestamp(%s), "
                       "finished_at = to_timestamp(%s) WHERE id = %s", (at(started), at(finished), task_id))
    return task_id


_BASE = (math.floor(time.time() / WINDOW_S) - 30) * WINDOW_S  # the start of a budget window five minutes ago


def at(offset: float | None) -> float | None:
    return None if offset is None else _BASE + offset


def by_name(invariants: list[Invariant], prefix: str) -> Invariant:
    return next(i for i in invariants if i.name.startswith(prefix))


async def _world(pool: AsyncConnectionPool[Conn]) -> tuple[World, list[int]]:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=2, questions=3)
        tasks = [await insert_task(conn, world, question_index=i, execution_owner="legacy", status="completed")
                 for i in range(3)]
        for key, value in {"budget_window_seconds": WINDOW_S, "cluster_dispatch_per_minute": 40,
                           "tenant_dispatch_per_minute": 15}.items():
            await set_setting(conn, key, value)
        await conn.execute("UPDATE platform_settings SET max_concurrent = 2")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 2")
    return world, tasks


def test_the_rollout_puts_exactly_the_highest_tenants_on_legacy() -> None:
    assert rollout_legacy([1, 2, 3], 1) == 3
    assert rollout_legacy([1, 2, 3], 2) == 2
    assert rollout_legacy([1, 2, 3], 0) == 100
    assert rollout_legacy([98, 99, 100], 1) == 99  # 100 % 100 = 0: tenants 100 and 98 on desktop_tasks


async def test_two_runs_of_a_task_at_once_on_either_path_are_a_violation(pool: AsyncConnectionPool[Conn]) -> None:
    world, (both_legacy, across, fine) = await _world(pool)
    a, b = world.clients
    async with pool.connection() as conn:
        # Two legacy leases of one task, 2 s at once (the pull of the second before the end of the first).
        await lease(conn, world, both_legacy, a, created=0, leased=1, finished=10)
        await lease(conn, world, both_legacy, b, created=7, leased=8, finished=12)
        # An execution's attempt and a legacy lease of one task, at once.
        await attempt(conn, world, across, a, started=0, finished=10)
        await lease(conn, world, across, b, created=5, finished=6, status="aborted", reason="client_offline")
        # One after the other: an offer withdrawn before it was pulled, a lease, an execution.
        await lease(conn, world, fine, a, created=0, finished=3, status="aborted", reason="client_offline")
        await lease(conn, world, fine, b, created=3, leased=4, finished=9, status="expired")
        await attempt(conn, world, fine, a, started=9, finished=15)
        # Its end stamped 0.1 s before its pull (the ending transaction began first): after the execution, no error.
        await lease(conn, world, fine, b, created=15.5, leased=16, finished=15.9, status="aborted",
                    reason="client_offline")

    found = await check_double_execution(pool)

    assert (found.checked, found.violations) == (3, 2), found
    assert {e["monitor_task_id"] for e in found.examples} == {both_legacy, across}
    assert sorted(e["across_paths"] for e in found.examples) == [False, True]


async def test_legacy_offers_count_against_the_budget_unless_refunded(pool: AsyncConnectionPool[Conn]) -> None:
    world, (task, *_) = await _world(pool)
    a, _ = world.clients
    async with pool.connection() as conn:
        for i in range(15):  # the tenant's non-high budget of a window, in offers
            await lease(conn, world, task, a, created=1 + i * 0.1, finished=1.05 + i * 0.1, status="aborted",
                        reason="client_offline")
        for i in range(3):  # given back: withdrawn by a collect-now before the pull
            await lease(conn, world, task, a, created=3 + i * 0.1, finished=3.05 + i * 0.1, status="aborted",
                        reason="collect_now_preempt")

    assert by_name(await check_limits(pool), "tenant budget").violations == 0

    async with pool.connection() as conn:  # one offer too many in that window, on the execution path
        other = await insert_task(conn, world, question_index=0, execution_owner="desktop_tasks",
                                  business_date=datetime.now(UTC).date().replace(year=2020))
        await attempt(conn, world, other, a, started=5, finished=5.01)

    over = by_name(await check_limits(pool), "tenant budget")
    assert over.violations == 1 and over.examples[0][2] == 16, over


async def test_pulled_legacy_leases_count_against_the_clients_concurrency(pool: AsyncConnectionPool[Conn]) -> None:
    world, (t1, t2, t3) = await _world(pool)
    a, b = world.clients
    async with pool.connection() as conn:
        # Client a: an execution and a pulled legacy lease at once (its limit of 2), a third one pulled whose result
        # reached the hub before the others started, and an offer it never pulled.
        await attempt(conn, world, t1, a, started=10, finished=20)
        await lease(conn, world, t2, a, created=9, leased=10, finished=20)
        await lease(conn, world, t3, a, created=0, leased=1, received=9, finished=25)
        await lease(conn, world, t3, a, created=0, finished=25, status="aborted", reason="client_offline")

    assert by_name(await check_limits(pool), "client concurrency").violations == 0

    async with pool.connection() as conn:  # client a pulls a third while both run: over its limit for 5 s
        await lease(conn, world, t3, a, created=12, leased=13, finished=18)
        await lease(conn, world, t3, b, created=12, leased=13, finished=18)  # another client: its own limit

    over = by_name(await check_limits(pool), "client concurrency")
    assert over.violations == 1, over
    client, (start, duration, peak) = over.examples[0]
    assert (client, round(start - _BASE, 3), round(duration, 3), peak) == (str(a), 13, 5, 3)


async def test_legacy_offers_count_against_the_platforms_concurrency(pool: AsyncConnectionPool[Conn]) -> None:
    world, (t1, t2, t3) = await _world(pool)
    a, b = world.clients
    async with pool.connection() as conn:
        await attempt(conn, world, t1, a, started=0, finished=10)
        await lease(conn, world, t2, b, created=0, finished=10, status="aborted", reason="client_offline")

    assert by_name(await check_limits(pool), "platform concurrency").violations == 0

    async with pool.connection() as conn:  # a third queued on the same (tenant, platform), never pulled
        await lease(conn, world, t3, b, created=4, finished=6, status="aborted", reason="client_offline")

    over = by_name(await check_limits(pool), "platform concurrency")
    assert over.violations == 1 and over.examples[0][1][2] == 3, over


async def test_a_live_expired_or_zombie_legacy_lease_is_a_violation(pool: AsyncConnectionPool[Conn]) -> None:
    world, _ = await _world(pool)
    a, b = world.clients
    async with pool.connection() as conn:
        done = await insert_task(conn, world, question_index=0, execution_owner="legacy", status="completed",
                                 business_date=datetime.now(UTC).date().replace(year=2020))
        await lease(conn, world, done, a, created=0, leased=1, finished=5)

    found = await check_legacy_leases(pool)
    assert [i.violations for i in found] == [0, 0, 0], found

    async with pool.connection() as conn:
        live = await insert_task(conn, world, question_index=1, execution_owner="legacy",
                                 business_date=datetime.now(UTC).date().replace(year=2021))
        await insert_legacy_lease(conn, world, live, a, lease_expires_in=-30)  # pulled, expired long ago
        # Lease columns left on a completed row; a live lease its business row does not name.
        zombie = await insert_task(conn, world, question_index=2, execution_owner="legacy", status="completed",
                                   business_date=datetime.now(UTC).date().replace(year=2022))
        await conn.execute("UPDATE monitoring_collect_tasks SET leased_to_executor = %s WHERE id = %s", (b, zombie))
        orphan = await insert_task(conn, world, question_index=0, execution_owner="legacy",
                                   business_date=datetime.now(UTC).date().replace(year=2023))
        await insert_legacy_lease(conn, world, orphan, b, status="queued")
        await conn.execute("UPDATE monitoring_collect_tasks SET status = 'pending', leased_to_executor = NULL, "
                           "legacy_lease_id = NULL WHERE id = %s", (orphan,))

    live_check, expired_check, columns_check = await check_legacy_leases(pool)
    assert live_check.violations == 3, live_check  # two live leases, one business row leased
    assert expired_check.violations == 1 and expired_check.examples[0]["id"] == live, expired_check
    assert columns_check.violations == 2, columns_check
    assert {e["id"] for e in columns_check.examples} == {zombie, orphan}


async def test_a_task_control_for_a_legacy_lease_must_reach_its_client(pool: AsyncConnectionPool[Conn]) -> None:
    world, (task, *_) = await _world(pool)
    a, _ = world.clients
    async with pool.connection() as conn:
        lease_id = await lease(conn, world, task, a, created=0, leased=1, finished=None, status="in_progress")
        control = TaskControl(kind="monitor", task_id=lease_id, target_client_id=a, control="interrupt_requested",
                              reason="collect_now_preempt", interrupt_generation=1, updated_at=datetime.now(UTC))
        async with conn.transaction():
            await enqueue(conn, exchange=DISPATCH, routing_key=f"monitor.control.{a}", message=control)
        await conn.execute("UPDATE outbox SET status = 'published', published_at = now()")
    async with aiohttp.ClientSession() as session:
        client = ChaosClient(SimOptions(hub_url="http://127.0.0.1:9", token="unused"), session=session)
        client.client_id = str(a)
        client.held[str(lease_id)] = [time.time() - 60, math.inf]  # holding the lease, connected all along
        client.connected_periods.append([time.time() - 60, math.inf])
        fleet = Fleet({"tenants": [], "platforms": []}, [], random.Random(0))
        fleet.clients.append(client)

        missed = await check_controls(pool, fleet)
        assert missed.violations == 1 and missed.examples[0]["path"] == "legacy", missed

        event: dict[str, Any] = msgspec.to_builtins(control)
        client.received.append((time.time(), {**event, "type": "task_control"}))
        delivered = await check_controls(pool, fleet)
        assert delivered.violations == 0 and "legacy interrupt_requested 1" in delivered.note, delivered


async def test_a_202_result_of_a_legacy_lease_must_be_applied(pool: AsyncConnectionPool[Conn]) -> None:
    world, (task, *_) = await _world(pool)
    async with pool.connection() as conn:
        lease_id = await lease(conn, world, task, world.clients[0], created=0, leased=1, received=2, finished=3)
    accepted = {str(result_id_for(lease_id, 1))}

    assert (await check_results(pool, accepted))[0].violations == 1

    async with pool.connection() as conn:
        await conn.execute("INSERT INTO ingest_applied_results (result_id, tenant_id, shard, task_id, monitor_task_id, "
                           "status, applied_by) VALUES (%s, %s, 0, %s, %s, 'succeeded', 'test')",
                           (result_id_for(lease_id, 1), world.tenant_id, lease_id, task))
    applied = (await check_results(pool, accepted))[0]
    assert applied.violations == 0 and "1 of legacy leases" in applied.note, applied


async def test_work_off_its_tenants_path_is_a_violation(pool: AsyncConnectionPool[Conn]) -> None:
    world, (task, other, _) = await _world(pool)  # tenant 1, its tasks on legacy: rollout 1 (1 % 100 >= 1)
    async with pool.connection() as conn:
        await lease(conn, world, task, world.clients[0], created=0, leased=1, finished=3)

    assert (await check_paths(pool, rollout=1)).violations == 0
    assert (await check_paths(pool, rollout=2)).violations == 3  # all three tasks belong on desktop_tasks then

    async with pool.connection() as conn:  # an execution of a legacy-owned task
        await attempt(conn, world, other, world.clients[0], started=5, finished=6)
    wrong = await check_paths(pool, rollout=1)
    assert wrong.violations == 1 and wrong.examples[0]["problem"] == "execution of a legacy-owned task", wrong


def test_a_dual_path_repair_in_a_service_log_is_a_violation(settings: Settings, tmp_path: Path) -> None:
    stack = ChaosStack(settings, tmp_path)
    reconciler = Replica("reconciler", 0, ServiceProcess("reconciler", {}, log_dir=tmp_path))
    stack.replicas.append(reconciler)
    lines = [{"level": "info", "event": "reconcile job done", "job": "migration_reconcile"},
             {"level": "warning", "event": "ready tasks waiting longer than the reconcile interval; coordinator woken"}]
    reconciler.proc.log_path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")

    assert check_service_repairs(stack).violations == 0

    lines += [{"level": "warning", "event": "zombie lease cleared", "monitor_task_id": 7},
              {"level": "error", "event": "ALERT: active execution on a legacy-owned task; needs a human",
               "monitor_task_id": 8}]
    reconciler.proc.log_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    found = check_service_repairs(stack)
    assert found.violations == 2 and [e[2] for e in found.examples] == [7, 8], found


class _FlakyStart(ServiceProcess):
    """Fails its first `failures` starts as a service that exits during start-up does."""

    def __init__(self, failures: int, log_dir: Path) -> None:
        super().__init__("reconciler", {}, log_dir=log_dir)
        self.failures, self.starts, self.kills = failures, 0, 0

    def start(self, *, ready_path: str = "/readyz", timeout: float = 30.0) -> ServiceProcess:
        self.starts += 1
        if self.starts <= self.failures:
            raise RuntimeError(f"reconciler exited with 1:\n{'x' * 5000}ImportError: the reason, at the end")
        return self

    def kill(self) -> None:
        self.kills += 1


async def test_a_failed_start_is_retried_and_recorded(settings: Settings, tmp_path: Path) -> None:
    stack = ChaosStack(settings, tmp_path)
    flaky = _FlakyStart(2, tmp_path)
    replica = Replica("reconciler", 0, flaky)
    stack.replicas.append(replica)

    await stack.restart(replica)

    assert replica.up and (flaky.starts, flaky.kills) == (3, 2)
    assert [label for _, label, _ in stack.failed_starts] == ["reconciler#0", "reconciler#0"]
    assert all(tail.endswith("ImportError: the reason, at the end") for _, _, tail in stack.failed_starts)
