"""collect-now-api as a real process (uvloop, env config): ops endpoints, a click, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp

from libs.config import Settings
from tests.support.collect_now import JWT_SECRET, make_world
from tests.support.procs import ServiceProcess, refused_start, service_env


async def test_service_process_accepts_a_click_and_stops_cleanly(settings: Settings, pool, tmp_path: Path) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=1)
    api = ServiceProcess("collect-now-api", service_env(settings, GATEWAY_JWT_SECRET=JWT_SECRET), log_dir=tmp_path)
    await asyncio.to_thread(api.start)
    try:
        async with aiohttp.ClientSession(api.url) as http:
            async with http.get("/readyz") as resp:
                assert resp.status == 200 and (await resp.json())["checks"] == {"postgres": "ok", "schema": "ok"}
            async with http.get("/openapi.json") as resp:
                assert resp.status == 200 and (await resp.json())["openapi"].startswith("3.1")
            auth = world.auth()
            async with http.post(f"/api/tenant/monitoring/brands/{world.brand_id}/collect-now", json={},
                                 headers=auth) as resp:
                body = await resp.json()
                assert resp.status == 202, body
            async with http.get(f"/api/tenant/monitoring/collect-requests/{body['request_id']}",
                                headers=auth) as resp:
                assert resp.status == 200 and (await resp.json())["requested_task_count"] == 3
            async with http.get("/metrics") as resp:
                text = await resp.text()
                assert "\ncollect_now_accept_count 1.0" in text
    finally:
        code = await asyncio.to_thread(api.stop)
    assert code == 0, api.logs()[-3000:]
    events = [json.loads(line) for line in api.logs().splitlines() if line.startswith("{")]
    accepted = [e for e in events if e["event"] == "collect_now.accepted"]
    assert len(accepted) == 1 and accepted[0]["request_id"] == body["request_id"]
    assert auth["Authorization"].split()[1] not in api.logs()


async def test_service_refuses_to_start_without_a_real_gateway_key(settings: Settings, tmp_path: Path) -> None:
    for secret, why in (("", "set GATEWAY_JWT_SECRET"), ("local-demo-gateway-secret-change-me-0001", "placeholder"),
                        ("too-short", "at least 32")):
        env = service_env(settings, GATEWAY_JWT_SECRET=secret)
        env.pop("DEV_MODE", None)
        error, _ = await refused_start("collect-now-api", env, tmp_path)
        assert why in error, (secret, error[-2000:])
    # A real key but no audience to check: no service either (the issuer's twin case: tests/unit/test_gateway_auth.py).
    env = service_env(settings, GATEWAY_JWT_SECRET=JWT_SECRET, GATEWAY_JWT_AUDIENCE="")
    env.pop("DEV_MODE", None)
    error, _ = await refused_start("collect-now-api", env, tmp_path)
    assert "set GATEWAY_JWT_AUDIENCE" in error, error[-2000:]
    # DEV_MODE is the explicit escape hatch for local stacks
    dev = ServiceProcess("collect-now-api", service_env(settings, GATEWAY_JWT_SECRET="", DEV_MODE="1"),
                         log_dir=tmp_path)
    await asyncio.to_thread(dev.start)
    assert await asyncio.to_thread(dev.stop) == 0
