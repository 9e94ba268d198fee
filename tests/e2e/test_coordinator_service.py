"""dispatch-coordinator as a real process: it fails closed on a short or placeholder OPS_API_TOKEN."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from libs.config import Settings
from tests.support.procs import ServiceProcess, refused_start, service_env

REAL_TOKEN = "e2e-ops-token-7f3a9c1d5b8e2f6a0c4d9e1b"


async def test_coordinator_refuses_to_start_with_a_short_or_placeholder_ops_token(settings: Settings,
                                                                                    tmp_path: Path) -> None:
    for token, why in (("REPLACE_ME_WITH_OUTPUT_OF_OPENSSL_RAND_HEX_32", "placeholder"), ("x", "at least 32")):
        env = service_env(settings, OPS_API_TOKEN=token)
        env.pop("DEV_MODE", None)
        error, logs = await refused_start("dispatch-coordinator", env, tmp_path)
        assert why in error and "OPS_API_TOKEN" in error, error[-2000:]
        assert len(token) < 8 or token not in logs  # the reason names no secret
    # A real token starts it (and guards the ops routes); DEV_MODE is the escape hatch for local stacks.
    env = service_env(settings, OPS_API_TOKEN=REAL_TOKEN)
    env.pop("DEV_MODE", None)
    for extra in (env, {**env, "OPS_API_TOKEN": "x", "DEV_MODE": "1"}):
        coordinator = ServiceProcess("dispatch-coordinator", extra, log_dir=tmp_path)
        await asyncio.to_thread(coordinator.start)
        try:
            async with aiohttp.ClientSession(coordinator.url) as http:
                async with http.get("/api/ops/dispatch/status", headers={"Authorization": "Bearer wrong"}) as resp:
                    assert resp.status == 401, await resp.text()
        finally:
            assert await asyncio.to_thread(coordinator.stop) == 0, coordinator.logs()[-3000:]
