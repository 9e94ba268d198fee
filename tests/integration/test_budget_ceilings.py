"""Budget ceilings (the circuit-breaker values): no budget or limit above its ceiling, whichever command sets
it; a ceiling changes only with its own command, never below its budget."""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import DispatchSettings, SettingError, check_ceiling, check_new_ceiling
from tests.support.monitorctl import monitorctl_json, monitorctl_refused


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
