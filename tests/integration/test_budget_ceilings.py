"""Budget ceilings (the circuit-breaker values): no budget or limit above its ceiling, whichever command sets
it; a ceiling changes only with its own command, never below its budget."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import DispatchSettings, SettingError, check_ceiling, check_new_ceiling, set_setting
from services.dispatch_coordinator import admin
from tests.support.db import fetch
from tests.support.monitorctl import monitorctl_json, monitorctl_refused
from tests.support.wait import eventually


def test_the_seed_ceilings_bound_their_budgets() -> None:
    settings = DispatchSettings()
    assert (settings.cluster_dispatch_per_minute_ceiling, settings.tenant_dispatch_per_minute_ceiling,
            settings.client_max_concurrent_ceiling, settings.client_max_queue_depth_ceiling,
            settings.platform_max_concurrent_ceiling) == (500, 60, 4, 40, 2)
    check_ceiling(settings, "cluster_dispatch_per_minute", 500)
    for what, value in (("cluster_dispatch_per_minute", 501), ("tenant_dispatch_per_minute", 61),
                        ("client.max_concurrent", 5), ("client.max_queue_depth", 41), ("platform.max_concurrent", 3)):
        try:
            check_ceiling(settings, what, value)
        except SettingError as exc:
            assert "set-ceiling" in str(exc)
        else:
            raise AssertionError(f"{what} = {value} passed its ceiling")
    check_new_ceiling(settings, "cluster_dispatch_per_minute_ceiling", 300)  # down to the budget is fine
    try:
        check_new_ceiling(settings, "cluster_dispatch_per_minute_ceiling", 299)
    except SettingError as exc:
        assert "lower cluster_dispatch_per_minute first" in str(exc)
    else:
        raise AssertionError("a ceiling went below its budget")


async def test_monitorctl_refuses_budgets_and_limits_above_their_ceilings(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, due=False)
    client = seed["tenants"][0]["clients"][0]["client_id"]
    tenant = seed["tenants"][0]["tenant_id"]

    refused = await monitorctl_refused(settings, "budgets", "set", "cluster_dispatch_per_minute", "800")
    assert "above its ceiling 500" in refused and "set-ceiling cluster_dispatch_per_minute_ceiling" in refused
    refused = await monitorctl_refused(settings, "budgets", "set", "cluster_dispatch_per_minute_ceiling", "800")
    assert "is a ceiling" in refused
    assert await monitorctl_json(settings, "budgets", "set", "cluster_dispatch_per_minute", "450") == {
        "key": "cluster_dispatch_per_minute", "value": 450}
    await monitorctl_json(settings, "budgets", "set-ceiling", "cluster_dispatch_per_minute_ceiling", "800")
    await monitorctl_json(settings, "budgets", "set", "cluster_dispatch_per_minute", "800")
    assert "lower cluster_dispatch_per_minute first" in await monitorctl_refused(
        settings, "budgets", "set-ceiling", "cluster_dispatch_per_minute_ceiling", "500")

    assert "above its ceiling 4" in await monitorctl_refused(settings, "client", "set", client, "--max-concurrent", "5")
    assert await monitorctl_json(settings, "client", "set", client, "--max-concurrent", "4",
                                 "--max-queue-depth", "40") == {
        "client_id": client, "tenant_id": tenant, "max_concurrent": 4, "max_queue_depth": 40}
    assert "above its ceiling 40" in await monitorctl_refused(settings, "client", "set", client,
                                                               "--max-queue-depth", "41")
    assert "above its ceiling 4" in await monitorctl_refused(
        settings, "client", "create", "--tenant", str(tenant), "--workspace", str(tenant), "--user", "1",
        "--max-concurrent", "9")
    assert "above its ceiling 2" in await monitorctl_refused(settings, "platform", "set", "openai",
                                                              "--max-concurrent", "3")
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT max_concurrent_monitor, max_queue_depth FROM desktop_clients WHERE id = %s",
                                 (client,))
        assert await cur.fetchone() == {"max_concurrent_monitor": 4, "max_queue_depth": 40}


async def test_a_ceiling_is_not_lowered_below_the_limits_in_use(settings: Settings,
                                                                 pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=2, due=False)
    first, second = (c["client_id"] for c in seed["tenants"][0]["clients"])
    await monitorctl_json(settings, "client", "set", first, "--max-concurrent", "4", "--max-queue-depth", "30")
    await monitorctl_json(settings, "client", "set", second, "--max-concurrent", "3", "--max-queue-depth", "30")
    await monitorctl_json(settings, "platform", "set", "openai", "--max-concurrent", "2")

    refused = await monitorctl_refused(settings, "budgets", "set-ceiling", "client_max_concurrent_ceiling", "2")
    assert "below what 2 client(s) have client.max_concurrent set to (up to 4)" in refused, refused
    assert "monitorctl client set CLIENT_ID --max-concurrent 2" in refused
    refused = await monitorctl_refused(settings, "budgets", "set-ceiling", "client_max_queue_depth_ceiling", "29")
    assert "2 client(s) have client.max_queue_depth" in refused and "--max-queue-depth 29" in refused, refused
    refused = await monitorctl_refused(settings, "budgets", "set-ceiling", "platform_max_concurrent_ceiling", "1")
    assert "1 platform(s) have platform.max_concurrent set to (up to 2)" in refused, refused
    assert "monitorctl platform set CODE --max-concurrent 1" in refused
    budgets = await monitorctl_json(settings, "budgets", "get")
    assert (budgets["client_max_concurrent_ceiling"], budgets["client_max_queue_depth_ceiling"],
            budgets["platform_max_concurrent_ceiling"]) == (4, 40, 2)  # nothing changed

    # Down to the highest limit in use is fine; below it once the limits are lowered first.
    await monitorctl_json(settings, "budgets", "set-ceiling", "client_max_concurrent_ceiling", "4")
    assert "1 client(s)" in await monitorctl_refused(settings, "budgets", "set-ceiling",
                                                     "client_max_concurrent_ceiling", "3")
    await monitorctl_json(settings, "client", "set", first, "--max-concurrent", "3")
    await monitorctl_json(settings, "budgets", "set-ceiling", "client_max_concurrent_ceiling", "3")
    await monitorctl_json(settings, "budgets", "set-ceiling", "client_max_queue_depth_ceiling", "30")
    await monitorctl_json(settings, "platform", "set", "openai", "--max-concurrent", "1")
    await monitorctl_json(settings, "budgets", "set-ceiling", "platform_max_concurrent_ceiling", "1")
    budgets = await monitorctl_json(settings, "budgets", "get")
    assert (budgets["client_max_concurrent_ceiling"], budgets["client_max_queue_depth_ceiling"],
            budgets["platform_max_concurrent_ceiling"]) == (3, 30, 1)


async def _waits_for_the_ceiling_lock(pool: AsyncConnectionPool[Conn], holder_pid: int) -> bool | None:
    rows = await fetch(pool, "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                             "AND (classid::bigint << 32 | objid::bigint) = 7401552113 AND pid <> %s", holder_pid)
    return True if rows[0]["n"] else None


async def test_limits_and_ceilings_change_one_at_a_time(pool: AsyncConnectionPool[Conn]) -> None:
    """A client's or platform's limit checked against a ceiling that is being lowered waits for it, and is then
    checked against the lowered ceiling (no limit above its ceiling from the two racing)."""
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, due=False)
    client = uuid.UUID(seed["tenants"][0]["clients"][0]["client_id"])
    changes = (
        ("client_max_concurrent_ceiling", 2,
         lambda conn: admin.set_client_limits(conn, client, max_concurrent=3, max_queue_depth=None)),
        ("client_max_queue_depth_ceiling", 20,
         lambda conn: admin.set_client_limits(conn, client, max_concurrent=None, max_queue_depth=30)),
        ("platform_max_concurrent_ceiling", 1, lambda conn: admin.set_platform(conn, "openai", max_concurrent=2)),
    )
    for ceiling, lowered, change in changes:
        async with pool.connection() as lowering, pool.connection() as operator:
            async with lowering.transaction():
                await lowering.execute(admin.CEILING_LOCK)  # set-ceiling, between its check and its commit
                racing = asyncio.create_task(change(operator))
                await eventually(lambda: _waits_for_the_ceiling_lock(pool, lowering.info.backend_pid),
                                 message=f"the limit change waits for the ceiling lock ({ceiling})")
                assert not racing.done()
                await set_setting(lowering, ceiling, lowered)
            try:
                await racing
            except admin.AdminError as exc:
                assert f"above its ceiling {lowered}" in str(exc), exc
            else:
                raise AssertionError(f"a limit went above {ceiling} = {lowered}")
    rows = await fetch(pool, "SELECT max_concurrent_monitor, max_queue_depth FROM desktop_clients WHERE id = %s",
                       client)
    assert rows == [{"max_concurrent_monitor": 2, "max_queue_depth": 20}]
    rows = await fetch(pool, "SELECT coalesce(s.max_concurrent, 1) AS n FROM ai_platforms p "
                             "LEFT JOIN platform_settings s ON s.ai_platform_id = p.id WHERE p.code = 'openai'")
    assert rows == [{"n": 1}]


def test_the_budget_coupling_rule_refuses_a_tenant_budget_at_the_clusters() -> None:
    from libs.dispatch_settings import budget_sum_warning, check_budget_coupling

    check_budget_coupling(DispatchSettings())  # 30 < 300
    for bad in (DispatchSettings(tenant_dispatch_per_minute=300), DispatchSettings(cluster_dispatch_per_minute=20)):
        try:
            check_budget_coupling(bad)
        except SettingError as exc:
            assert "must stay below cluster_dispatch_per_minute" in str(exc)
        else:
            raise AssertionError("a tenant budget at or above the cluster's was accepted")
    assert budget_sum_warning(DispatchSettings(), 9) is None  # 270 < 300
    assert "10 tenants dispatched" in (budget_sum_warning(DispatchSettings(), 10) or "")


async def test_budgets_set_holds_the_cluster_above_the_tenant_budgets(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    """§9.2 "cluster budget > sum of tenant budgets" (libs/dispatch_settings.check_budget_coupling): refused for one
    tenant's budget, a warning for the tenants dispatching now."""
    from tests.support.desktop import dispatch_execution

    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=2, brands=1, questions=1, clients=1, due=False)
    async with pool.connection() as conn:
        assert await admin.set_budget(conn, "cluster_dispatch_per_minute", 60) == 60
        assert await admin.budget_warning(conn) is None  # nobody dispatched
        for key, value in (("tenant_dispatch_per_minute", 60), ("cluster_dispatch_per_minute", 30)):
            try:
                await admin.set_budget(conn, key, value)
            except SettingError as exc:
                assert "must stay below cluster_dispatch_per_minute" in str(exc), exc
            else:
                raise AssertionError(f"{key} = {value} was accepted")
        for tenant in seed["tenants"]:
            await dispatch_execution(conn, tenant=tenant, platform_id=int(seed["platforms"][0]["ai_platform_id"]),
                                     client_id=tenant["clients"][0]["client_id"])
    warned = await monitorctl_json(settings, "budgets", "set", "cluster_dispatch_per_minute", "59")
    assert warned["value"] == 59 and "2 tenants dispatched" in warned["warning"] and "sum to 60" in warned["warning"]
