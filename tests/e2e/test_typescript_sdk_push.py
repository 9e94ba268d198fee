"""The TypeScript desktop SDK with push-lease on the real stack: its push conformance test (node's test runner)
asks for push_lease, clicks, and runs the pushed tasks to their results without a lease call; the database shows
each task leased once, at dispatch."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from tests.e2e.test_typescript_sdk import SDK, _compile_sdk
from tests.support.db import fetch as rows
from tests.support.stack import running_stack

PUSH_ENV: dict[str, str | int] = {"HUB_HEARTBEAT_FLUSH_S": "0.3", "HUB_PING_INTERVAL_S": "1",
                                  "PUSH_LEASE_ENABLED": "1", "PUSH_LEASE_SECRET": "7c" * 32}

pytestmark = pytest.mark.timeout(120)


async def test_typescript_sdk_runs_pushed_leases(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                tmp_path: Path) -> None:
    await asyncio.to_thread(_compile_sdk)
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=3, clients=1, platforms=("openai",), due=False)
        await conn.execute("UPDATE platform_settings SET max_concurrent = 20")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 4")
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000}.items():
            await set_setting(conn, key, value)
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    brand = tenant["brands"][0]
    async with running_stack(settings, tmp_path, **PUSH_ENV) as stack:
        env = {**os.environ, "MONITOR_PUSH_HUB_URL": stack.hub_url, "MONITOR_API_URL": stack.api_url,
               "MONITOR_CLIENT_TOKEN": client["token"], "MONITOR_CLIENT_ID": client["client_id"],
               "MONITOR_JWT": stack.jwt(tenant), "MONITOR_BRAND_ID": str(brand["brand_id"])}
        run = await asyncio.to_thread(
            subprocess.run, ["node", "--test", "--test-reporter=tap", "dist/stack-test/push-conformance.test.js"],
            cwd=SDK, env=env, capture_output=True, text=True, timeout=90, check=False)
        report = run.stdout + run.stderr
        assert run.returncode == 0, f"{report}\n{stack.logs()}"
        counts = {key: int(value) for key, value in re.findall(r"^# (pass|fail|skipped) (\d+)$", run.stdout, re.M)}
        assert counts == {"pass": 1, "fail": 0, "skipped": 0}, report
    executions = await rows(pool, "SELECT d.id, d.status, (SELECT count(*) FROM desktop_task_attempts a "
                                  "WHERE a.task_id = d.id) AS attempts FROM desktop_tasks d "
                                  "WHERE d.target_client_id = %s", uuid.UUID(client["client_id"]))
    assert len(executions) == len(brand["question_ids"]) and all(r["attempts"] == 1 for r in executions), executions
