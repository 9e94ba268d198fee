"""Platform-health pause in the coordinator's full pass, on real Postgres: a client that reports a broken login on
one platform gets none of its scheduled work, its other platforms keep flowing; the tenant's platform shows as
paused in `monitorctl status` and the metric; an operator's override wins."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import load_settings
from services.dispatch_coordinator.dispatcher import Dispatcher
from tests.support.collect_now import set_online
from tests.support.desktop import insert_ready_task
from tests.support.monitorctl import monitorctl_json, monitorctl_status


def held_platform(seed: dict[str, Any], code: str) -> int:
    return next(int(p["ai_platform_id"]) for p in seed["platforms"] if p["code"] == code)


async def _dispatched(pool: AsyncConnectionPool[Conn]) -> dict[str, int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT p.code, count(*) AS n FROM desktop_tasks d JOIN ai_platforms p "
                                 "ON p.id = d.ai_platform_id GROUP BY 1")
        return {r["code"]: int(r["n"]) for r in await cur.fetchall()}


async def test_a_broken_login_holds_that_platforms_scheduled_work_only(settings: Settings,
                                                                       pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, brands=1, questions=3, clients=1, due=False,
                                               platforms=("openai", "gemini"))
        tenant = seed["tenants"][0]
        client = tenant["clients"][0]["client_id"]
        await set_online(conn, client, platform_health=json.dumps({"openai": "login_required", "gemini": "healthy"}))
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 4, max_queue_depth = 20")
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 10 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 10")
        for platform in seed["platforms"]:
            for question in range(3):
                await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=question,
                                        platform_id=platform["ai_platform_id"])
        dispatch_settings = await load_settings(conn)
    dispatcher = Dispatcher(pool)
    await dispatcher.run_pass(dispatch_settings)
    assert await _dispatched(pool) == {"gemini": 3}
    labels = {"tenant_id": str(tenant["tenant_id"]), "platform": "openai", "source": "health"}
    assert REGISTRY.get_sample_value("monitor_tenant_platform_paused", labels) == 1
    _, status = await monitorctl_status(settings)
    assert {"tenant_id": tenant["tenant_id"], "platform": "openai", "clients_blocking": 1, "clients_eligible": 1,
            "paused": "health", "override": None, "override_reason": None} in status["platform_health"]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT t.id FROM monitoring_collect_tasks t JOIN ai_platforms p "
                                 "ON p.id = t.ai_platform_id WHERE p.code = 'openai' LIMIT 1")
        held = await cur.fetchone()
    assert held is not None
    explained = await monitorctl_json(settings, "explain", str(held["id"]))
    assert explained["blocked_by"] == "tenant_platform_paused" and explained["platform"]["tenant_paused_by"] == "health"
    assert [c["login_broken_on"] for c in explained["clients"]] == [[held_platform(seed, "openai")]]

    # An operator who knows the report is stale lets the work through; clearing hands it back to the reports.
    await monitorctl_json(settings, "platform", "health-override", "openai", "--tenant", str(tenant["tenant_id"]),
                          "--ignore-health", "--reason", "stale report")
    await dispatcher.run_pass(dispatch_settings)
    assert await _dispatched(pool) == {"gemini": 3, "openai": 3}
    await monitorctl_json(settings, "platform", "health-override", "openai", "--tenant", str(tenant["tenant_id"]),
                          "--clear")
    _, status = await monitorctl_status(settings)
    assert [p["paused"] for p in status["platform_health"] if p["platform"] == "openai"] == ["health"]


async def test_recovery_resumes_and_a_manual_pause_holds(settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, brands=1, questions=2, clients=1, due=False,
                                               platforms=("openai", "gemini"))
        tenant = seed["tenants"][0]
        client = tenant["clients"][0]["client_id"]
        await set_online(conn, client, platform_health=json.dumps({"openai": "captcha"}))
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 4, max_queue_depth = 20")
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 10 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 10")
        for platform in seed["platforms"]:
            await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=0,
                                    platform_id=platform["ai_platform_id"])
        dispatch_settings = await load_settings(conn)
    await monitorctl_json(settings, "platform", "health-override", "gemini", "--tenant", str(tenant["tenant_id"]),
                          "--pause")
    dispatcher = Dispatcher(pool)
    await dispatcher.run_pass(dispatch_settings)
    assert await _dispatched(pool) == {}
    async with pool.connection() as conn:  # the login works again
        await set_online(conn, client, platform_health=json.dumps({"openai": "healthy"}))
    await dispatcher.run_pass(dispatch_settings)
    assert await _dispatched(pool) == {"openai": 1}  # gemini stays paused by the operator
    assert REGISTRY.get_sample_value("monitor_tenant_platform_paused", {
        "tenant_id": str(tenant["tenant_id"]), "platform": "gemini", "source": "operator"}) == 1
