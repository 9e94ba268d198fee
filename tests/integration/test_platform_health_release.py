"""The platform-health pause at the hub, on real Postgres: a heartbeat flush that stores a broken login releases the
work already queued for that client on that platform (queued executions and unpulled legacy offers of the normal,
boosted and retry lanes; high work stays), gives the business tasks their dispatch attempt back, emits
`task.released` and tells the client `task_control(cancelled)`; one client's failure never fails another's; an
operator's `ignore_health` override keeps the work. The lease call skips such work on both paths (the second line:
work queued after the flush by a pass that read the report before it changed)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from services.dispatch_hub.heartbeats import HeartbeatWriter
from tests.integration.test_hub_api import http, hub, lease, seed
from tests.integration.test_hub_legacy_leases import offer_legacy
from tests.support.db import fetch
from tests.support.desktop import dispatch_execution
from tests.support.reconcile_factory import (
    World,
    business,
    insert_execution,
    insert_legacy_lease,
    insert_task,
    make_world,
    outbox_messages,
)

__all__ = ["http", "hub", "seed"]  # the fixtures of test_hub_api, shared

BROKEN = {"openai": "login_required", "gemini": "healthy"}


def writer(pool: AsyncConnectionPool[Conn]) -> HeartbeatWriter:
    return HeartbeatWriter(pool, hub="hub-test", interval_s=1.0, is_connected=lambda _: True)


async def queued_work(conn: Conn, world: World, client: uuid.UUID, *, question: int, platform: str,
                      lane: str = "normal", owner: str = "desktop_tasks",
                      status: str = "queued") -> tuple[int, uuid.UUID]:
    """A business task dispatched once (its attempt counted) and its work on `client`: an execution, or a legacy
    offer (pulled when `status` is in_progress)."""
    task = await insert_task(conn, world, question_index=question, platform=platform, lane=lane, dispatch_attempts=1,
                             execution_owner=owner, target_client_id=client if lane == "high" else None)
    if owner == "legacy":
        return task, await insert_legacy_lease(conn, world, task, client, status=status, lane=lane)
    return task, await insert_execution(conn, world, task, client, status=status, lane=lane)


async def statuses(pool: AsyncConnectionPool[Conn], ids: dict[str, uuid.UUID]) -> dict[str, tuple[str, str | None]]:
    rows = await fetch(pool, "SELECT id, status, interrupt_reason FROM desktop_tasks WHERE id = ANY(%s) UNION ALL "
                             "SELECT id, status, interrupt_reason FROM legacy_leases WHERE id = ANY(%s)",
                       list(ids.values()), list(ids.values()))
    by_id = {r["id"]: (r["status"], r["interrupt_reason"]) for r in rows}
    return {name: by_id[task_id] for name, task_id in ids.items()}


async def test_a_broken_login_releases_the_clients_queued_normal_work_of_that_platform(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, clients=2, questions=9, platforms=("openai", "gemini"))
        a, b = world.clients
        tasks: dict[str, tuple[int, uuid.UUID]] = {
            "normal": await queued_work(conn, world, a, question=0, platform="openai"),
            "retry": await queued_work(conn, world, a, question=1, platform="openai", lane="retry"),
            "boosted": await queued_work(conn, world, a, question=2, platform="openai", lane="normal_boosted"),
            "legacy_offer": await queued_work(conn, world, a, question=3, platform="openai", owner="legacy"),
            # kept: high work, running work, the platform whose login works, another client's work
            "high": await queued_work(conn, world, a, question=4, platform="openai", lane="high"),
            "running": await queued_work(conn, world, a, question=5, platform="openai", status="in_progress"),
            "legacy_pulled": await queued_work(conn, world, a, question=6, platform="openai", owner="legacy",
                                               status="in_progress"),
            "gemini": await queued_work(conn, world, a, question=7, platform="gemini"),
            "other_client": await queued_work(conn, world, b, question=8, platform="openai"),
        }
    heartbeats = writer(pool)
    heartbeats.report_health(a, BROKEN)
    heartbeats.report_health(b, {"openai": "healthy"})
    await heartbeats.flush()

    released = {"normal", "retry", "boosted", "legacy_offer"}
    ids = {name: task_id for name, (_, task_id) in tasks.items()}
    after = await statuses(pool, ids)
    assert {n: s for n, s in after.items() if n in released} == dict.fromkeys(released,
                                                                              ("aborted", "platform_unhealthy"))
    assert {n: s[0] for n, s in after.items() if n not in released} == {
        "high": "queued", "running": "in_progress", "legacy_pulled": "in_progress", "gemini": "queued",
        "other_client": "queued"}
    assert heartbeats.health_released == 4
    async with pool.connection() as conn:
        for name in released:  # pending again, the dispatch attempt given back, nothing of a lease left
            task = await business(conn, tasks[name][0])
            assert (task["status"], task["dispatch_attempts"], task["legacy_lease_id"], task["leased_to_executor"]) \
                == ("pending", 0, None, None), name
        for name in ("high", "gemini", "other_client"):
            assert (await business(conn, tasks[name][0]))["dispatch_attempts"] == 1, name
        attempts = await fetch(pool, "SELECT count(*) AS n FROM desktop_task_attempts WHERE task_id = ANY(%s)",
                               [ids[n] for n in released])
        assert attempts == [{"n": 0}]  # never leased: no attempt opened or closed
        controls = await outbox_messages(conn, f"monitor.control.{a}")
        lifecycle = await outbox_messages(conn, "task.released")
        assert await outbox_messages(conn, f"monitor.control.{b}") == []
        health = await fetch(pool, "SELECT platform_health FROM desktop_clients WHERE id = %s", a)
    assert health == [{"platform_health": BROKEN}]  # stored in the same transaction
    assert sorted((c["task_id"], c["control"], c["reason"]) for c in controls) == sorted(
        (str(ids[n]), "cancelled", "platform_unhealthy") for n in released)
    assert sorted((e["task_id"], e["client_id"], e["reason"], e["ai_platform_id"]) for e in lifecycle) == sorted(
        (str(ids[n]), str(a), "platform_unhealthy", world.platform_ids["openai"]) for n in released)

    # The report again (every heartbeat carries it): nothing more to release, nothing sent twice.
    heartbeats.report_health(a, BROKEN)
    await heartbeats.flush()
    assert heartbeats.health_released == 4
    async with pool.connection() as conn:
        assert len(await outbox_messages(conn, "task.released")) == 4


async def test_an_ignore_health_override_keeps_the_work_and_one_clients_failure_spares_the_others(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        # Two tenants: the first one's operator set `ignore_health` on openai.
        world = await make_world(conn, clients=1, questions=1, platforms=("openai", "gemini"))
        other = await make_world(conn, clients=2, questions=2, platforms=("openai", "gemini"))
        overridden, (failing, fine) = world.clients[0], other.clients
        kept = await queued_work(conn, world, overridden, question=0, platform="openai")
        stuck = await queued_work(conn, other, failing, question=0, platform="openai")
        released = await queued_work(conn, other, fine, question=1, platform="openai")
        await conn.execute("INSERT INTO platform_health_overrides (tenant_id, ai_platform_id, mode, reason) "
                           "VALUES (%s, %s, 'ignore_health', 'stale report')",
                           (world.tenant_id, world.platform_ids["openai"]))
        # One client's release fails in the database (a stand-in for any per-client failure).
        await conn.execute(f"""
            CREATE FUNCTION test_refuse_release() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.status = 'aborted' AND NEW.target_client_id = '{failing}' THEN
                    RAISE EXCEPTION 'simulated failure releasing this client''s work';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER test_refuse_release BEFORE UPDATE ON desktop_tasks
                FOR EACH ROW EXECUTE FUNCTION test_refuse_release();""")
    clients = [overridden, failing, fine]
    heartbeats = writer(pool)
    for client in clients:
        heartbeats.report_health(client, BROKEN)
    await heartbeats.flush()

    after = await statuses(pool, {"kept": kept[1], "stuck": stuck[1], "released": released[1]})
    assert after == {"kept": ("queued", None), "stuck": ("queued", None),
                     "released": ("aborted", "platform_unhealthy")}
    assert (heartbeats.health_released, heartbeats.release_failed, heartbeats.health_rejected) == (1, 1, 0)
    stored = await fetch(pool, "SELECT id, platform_health FROM desktop_clients WHERE id = ANY(%s)", clients)
    assert {r["id"]: r["platform_health"] for r in stored} == dict.fromkeys(clients, BROKEN)  # every report


async def test_the_lease_skips_normal_work_of_a_platform_the_client_reports_broken(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    codes = {p["code"]: p["ai_platform_id"] for p in seed["platforms"]}
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 4")
        broken = await dispatch_execution(conn, tenant=tenant, platform_id=codes["openai"],
                                          client_id=client["client_id"], question_index=0)
        high = await dispatch_execution(conn, tenant=tenant, platform_id=codes["openai"],
                                        client_id=client["client_id"], question_index=1, lane="high")
        working = await dispatch_execution(conn, tenant=tenant, platform_id=codes["gemini"],
                                           client_id=client["client_id"], question_index=2)
    offered = await offer_legacy(pool, tenant, client["client_id"], question_index=3)  # min(id): openai
    assert (await fetch(pool, "SELECT code FROM ai_platforms p JOIN legacy_leases l ON l.ai_platform_id = p.id "
                              "WHERE l.id = %s", offered["task_id"])) == [{"code": "openai"}]
    async with pool.connection() as conn:  # stored by a flush, the work queued by a pass that read the old report
        await conn.execute("UPDATE desktop_clients SET platform_health = %s::jsonb WHERE id = %s",
                           (json.dumps(BROKEN), client["client_id"]))
    leased = await lease(http, hub, client["token"], max_tasks=4)
    assert sorted(t["task_id"] for t in leased) == sorted([str(high["task_id"]), str(working["task_id"])])
    rows = await fetch(pool, "SELECT status FROM desktop_tasks WHERE id = %s UNION ALL "
                             "SELECT status FROM legacy_leases WHERE id = %s", broken["task_id"], offered["task_id"])
    assert rows == [{"status": "queued"}, {"status": "queued"}]  # left for the flush to release

    # An operator who knows the report is stale lets the client take it, on both paths.
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO platform_health_overrides (tenant_id, ai_platform_id, mode) "
                           "VALUES (%s, %s, 'ignore_health')", (tenant["tenant_id"], codes["openai"]))
    leased = await lease(http, hub, client["token"], max_tasks=2)
    assert sorted(t["task_id"] for t in leased) == sorted([str(broken["task_id"]), str(offered["task_id"])])
