"""The adaptive interrupt timeouts' loop on real Postgres: two hub replicas' safe-point intervals land in one
histogram; the reconciler's job measures each platform's P95 (every replica's samples), tunes a dynamic
platform's soft/hard timeouts from it at most once per tuning interval and only with enough samples, leaves a
static platform's alone, and `monitorctl platform get` shows the measured P95 beside the configured values."""

from __future__ import annotations

import uuid
from typing import Any

from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from services.dispatch_coordinator import admin
from services.dispatch_hub.leases import SafePointStats
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.runner import run_job
from tests.support.monitorctl import monitorctl_json

CLIENTS = [uuid.UUID(int=i) for i in range(1, 6)]


async def _platforms(pool: AsyncConnectionPool[Conn], code: str) -> list[dict[str, Any]]:
    """What `monitorctl platform get CODE` prints (in process: the CLI itself is run by the other tests here)."""
    async with pool.connection() as conn:
        return await admin.get_platforms(conn, code)


async def _tune(pool: AsyncConnectionPool[Conn]) -> dict[str, int]:
    async with pool.connection() as conn:
        return (await run_job(JOBS["safe_point_tuning"], conn, ReconcilerConfig())).details


async def test_two_hubs_samples_tune_a_dynamic_platform_once_per_interval(settings: Settings,
                                                                          pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, clients=1, due=False,
                                               platforms=("openai", "gemini"))
        await set_setting(conn, "safe_point_min_samples", 150)
    ids = {p["code"]: p["ai_platform_id"] for p in seed["platforms"]}
    await monitorctl_json(settings, "platform", "set", "gemini", "--dynamic")
    before = {p["code"]: p for p in await monitorctl_json(settings, "platform", "get")}

    hub_a, hub_b = SafePointStats(), SafePointStats()
    for hub in (hub_a, hub_b):
        for client in CLIENTS:  # five clients alike, each reporting to both replicas
            for _ in range(18):
                hub.observe(ids["gemini"], "gemini", 7_000, client)   # bucket (5000, 8000]
                hub.observe(ids["openai"], "openai", 7_000, client)
            for _ in range(2):
                hub.observe(ids["gemini"], "gemini", 9_000, client)   # bucket (8000, 10000]
                hub.observe(ids["openai"], "openai", 9_000, client)
        await hub.flush(pool)
    assert hub_a.flushed == hub_b.flushed == 200

    details = await _tune(pool)
    assert details["platforms_measured"] == 2 and details["timeouts_tuned"] == 1
    after = {p["code"]: p for p in await monitorctl_json(settings, "platform", "get")}
    # 200 samples over both replicas, 40 a client: each client's P95 half way into (8000, 10000] -> 9000, and so
    # their median; soft = 13500 -> at least 15000
    assert after["gemini"]["measured_safe_point_p95_ms"] == 9000 and after["gemini"]["measured_samples"] == 200
    assert after["gemini"]["measured_clients"] == 5
    assert (after["gemini"]["interrupt_soft_timeout_ms"], after["gemini"]["interrupt_hard_timeout_ms"]) == (
        15_000, 45_000)
    assert after["gemini"]["timeouts_tuned_at"] is not None
    # static: measured, never tuned
    assert after["openai"]["measured_safe_point_p95_ms"] == 9000
    assert (after["openai"]["interrupt_soft_timeout_ms"], after["openai"]["interrupt_hard_timeout_ms"]) == (
        before["openai"]["interrupt_soft_timeout_ms"], before["openai"]["interrupt_hard_timeout_ms"])
    assert REGISTRY.get_sample_value("safe_point_interval_ms_p95", {"platform": "gemini"}) == 9000

    # Slower safe points now, but the week is not over: measured, not tuned again.
    for client in CLIENTS:
        for _ in range(400):
            hub_a.observe(ids["gemini"], "gemini", 50_000, client)
    await hub_a.flush(pool)
    details = await _tune(pool)
    assert "timeouts_tuned" not in details
    again = {p["code"]: p for p in await monitorctl_json(settings, "platform", "get")}
    assert again["gemini"]["measured_safe_point_p95_ms"] > 45_000
    assert again["gemini"]["interrupt_soft_timeout_ms"] == 15_000
    # Once the tuning interval has passed, the new P95 sets the timeouts.
    async with pool.connection() as conn:
        await set_setting(conn, "interrupt_tuning_interval_seconds", 0)
    assert (await _tune(pool))["timeouts_tuned"] == 1
    tuned = {p["code"]: p for p in await monitorctl_json(settings, "platform", "get")}
    p95 = tuned["gemini"]["measured_safe_point_p95_ms"]
    assert tuned["gemini"]["interrupt_soft_timeout_ms"] >= round(p95 * 1.5) - 1
    assert tuned["gemini"]["interrupt_hard_timeout_ms"] == tuned["gemini"]["interrupt_soft_timeout_ms"] * 3


async def test_too_few_samples_change_nothing(settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, clients=1, due=False, platforms=("perplexity",))
    platform = seed["platforms"][0]["ai_platform_id"]
    await monitorctl_json(settings, "platform", "set", "perplexity", "--dynamic")
    hub = SafePointStats()
    for client in CLIENTS[:3]:
        for _ in range(20):
            hub.observe(platform, "perplexity", 60_000, client)
    await hub.flush(pool)
    details = await _tune(pool)
    assert details["platforms_measured"] == 1 and "timeouts_tuned" not in details


async def test_one_client_cannot_move_a_platforms_timeouts(settings: Settings,
                                                           pool: AsyncConnectionPool[Conn]) -> None:
    """A platform without fixed values is measured by default (§10.5 "other"), and its P95 is the median of its
    clients' P95s: a client flooding absurd intervals is one vote; a platform measured by too few clients is shown,
    never tuned."""
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, clients=1, due=False, platforms=("kimi",))
        await set_setting(conn, "safe_point_min_samples", 50)
    platform = seed["platforms"][0]["ai_platform_id"]
    (kimi,) = await _platforms(pool, "kimi")
    assert kimi["timeouts_dynamic"] is True  # no fixed values: measured by default
    hub = SafePointStats()
    flood = uuid.UUID(int=99)
    for _ in range(5000):
        hub.observe(platform, "kimi", 170_000, flood)  # one client: safe points three minutes apart
    await hub.flush(pool)
    assert (await _tune(pool)).get("too_few_clients") == 1  # one client alone tunes nothing
    assert (await _platforms(pool, "kimi"))[0]["interrupt_soft_timeout_ms"] == 15_000
    for client in CLIENTS[:3]:
        for _ in range(30):
            hub.observe(platform, "kimi", 18_000, client)  # bucket (15000, 20000]
    await hub.flush(pool)
    assert (await _tune(pool))["timeouts_tuned"] == 1
    (tuned,) = await _platforms(pool, "kimi")
    # four clients: P95s about 19,700 (x3) and 120,000+ (the flood); the lower median is an honest client's
    assert tuned["measured_clients"] == 4 and 19_000 < tuned["measured_safe_point_p95_ms"] <= 20_000, tuned
    assert abs(tuned["interrupt_soft_timeout_ms"] - tuned["measured_safe_point_p95_ms"] * 1.5) <= 1
    assert tuned["interrupt_hard_timeout_ms"] == tuned["interrupt_soft_timeout_ms"] * 3
    # Fixed values make a platform static: the tuner leaves them alone.
    fixed = await monitorctl_json(settings, "platform", "set", "kimi", "--soft-timeout-ms", "20000",
                                  "--hard-timeout-ms", "60000")
    assert fixed["timeouts_dynamic"] is False
