"""The TypeScript desktop SDK (sdk/typescript) against the real stack: its conformance tests on node's test runner
(`node --test`) drive a real client through click -> preempt at a safe point -> yield -> high tasks -> results, and
a too-new major's refusal; then the database shows the outcome. The SDK is compiled here (tsc, incremental);
scripts/ensure-node-tools.sh installs its pinned packages."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from tests.support.db import fetch as rows
from tests.support.db import one
from tests.support.desktop import insert_ready_task
from tests.support.stack import running_stack
from tests.support.wait import eventually

SDK = Path(__file__).resolve().parents[2] / "sdk" / "typescript"
HUB_ENV: dict[str, str | int] = {"HUB_HEARTBEAT_FLUSH_S": "0.3", "HUB_PING_INTERVAL_S": "1"}

pytestmark = pytest.mark.timeout(120)


def _compile_sdk() -> None:
    tsc = SDK / "node_modules" / ".bin" / "tsc"
    if not tsc.exists() or shutil.which("node") is None:
        pytest.fail("the SDK's packages are not installed: run `bash scripts/ensure-node-tools.sh`")
    built = subprocess.run([str(tsc), "-p", str(SDK)], capture_output=True, text=True, timeout=120, check=False)
    assert built.returncode == 0, built.stdout + built.stderr


async def _seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    """Brand 0 has three ready scheduled tasks (one runs, the others queue for the client); brand 1 is clicked."""
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=2, questions=3, clients=1, platforms=("openai",), due=False)
        tenant = seed["tenants"][0]
        for index in range(3):
            await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=index,
                                    platform_id=seed["platforms"][0]["ai_platform_id"], age_s=60 - index)
        await conn.execute("UPDATE platform_settings SET max_concurrent = 20")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 1")
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000}.items():
            await set_setting(conn, key, value)
    return seed


async def test_typescript_sdk_conformance_on_the_real_stack(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                           tmp_path: Path) -> None:
    # Before the services start, not beside them: on a busy box a parallel compile slowed their start-up past its
    # deadline. Incremental: about a second when nothing changed.
    await asyncio.to_thread(_compile_sdk)
    seed = await _seed(pool)
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    clicked = tenant["brands"][1]
    async with running_stack(settings, tmp_path, **HUB_ENV) as stack:
        env = {**os.environ, "MONITOR_HUB_URL": stack.hub_url, "MONITOR_API_URL": stack.api_url,
               "MONITOR_CLIENT_TOKEN": client["token"], "MONITOR_CLIENT_ID": client["client_id"],
               "MONITOR_JWT": stack.jwt(tenant), "MONITOR_BRAND_ID": str(clicked["brand_id"])}
        run = await asyncio.to_thread(
            subprocess.run, ["node", "--test", "--test-reporter=tap", "dist/test/"], cwd=SDK, env=env,
            capture_output=True, text=True, timeout=90, check=False)
        report = run.stdout + run.stderr
        assert run.returncode == 0, f"{report}\n{stack.logs()}"
        counts = {key: int(value) for key, value in re.findall(r"^# (pass|fail|skipped) (\d+)$", run.stdout, re.M)}
        assert counts["fail"] == 0 and counts["skipped"] == 0 and counts["pass"] >= 8, report

        # The database agrees with what the SDK saw.
        request = await one(pool, "SELECT id, status, interrupt_generation FROM monitoring_collect_requests "
                                  "WHERE brand_id = %s", clicked["brand_id"])

        async def request_succeeded() -> bool:
            row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s", request["id"])
            return bool(row["status"] == "succeeded")

        await eventually(request_succeeded, timeout=20, message=f"the request succeeded\n{stack.logs()}")
        yielded = await rows(pool, "SELECT status, interrupt_reason, execution_phase FROM desktop_tasks "
                                   "WHERE target_client_id = %s AND source = 'daily_schedule' AND "
                                   "interrupt_reason = 'collect_now_preempt' AND started_at IS NOT NULL",
                             uuid.UUID(client["client_id"]))
        assert len(yielded) == 1 and yielded[0]["status"] == "aborted", yielded
        assert yielded[0]["execution_phase"] in ("AUTHENTICATING", "INPUTTING", "WAITING")  # before a safe point
        runs = await rows(pool, "SELECT status, brand_mentioned FROM question_monitor_runs WHERE brand_id = %s",
                          clicked["brand_id"])
        assert len(runs) == len(clicked["question_ids"]) and all(r["status"] == "succeeded" for r in runs), runs
        health = await one(pool, "SELECT platform_health FROM desktop_clients WHERE id = %s",
                           uuid.UUID(client["client_id"]))
        assert health["platform_health"] == {"openai": "healthy"}
