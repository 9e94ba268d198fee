"""Two dispatch-coordinator processes: kill -9 the leader mid-run, the standby takes over, nothing is dispatched twice.
Also the operator endpoint and `monitorctl explain` against the running service."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import set_setting
from tests.support.dispatch_fleet import Fleet, running, seed_fleet
from tests.support.procs import BIN, ServiceProcess, service_env
from tests.support.wait import eventually

TASKS = 4 * 150


def _is_leader(proc: ServiceProcess) -> bool:
    try:
        with urllib.request.urlopen(proc.url + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return False
    return 'leader_is_active{role="dispatch-coordinator"} 1.0' in text


OPS_TOKEN = "leader-test-ops-token-0123456789abcdef"


def _get_json(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
        return json.loads(resp.read())


async def _scalar(pool: AsyncConnectionPool[Conn], sql: str) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute(sql)
        row = await cur.fetchone()
        assert row is not None
        return int(next(iter(row.values())))


async def test_standby_takes_over_after_kill_9_without_duplicate_dispatch(
        settings: Any, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[150] * 4, clients_per_tenant=3)
        for key, value in (("cluster_dispatch_per_minute", 100_000), ("tenant_dispatch_per_minute", 100_000),
                           ("dispatch_tick_ms", 200), ("dispatch_batch_size", 20)):
            await set_setting(conn, key, value)
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 3 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 3")
    env = service_env(settings, OPS_API_TOKEN=OPS_TOKEN)
    procs = [ServiceProcess("dispatch-coordinator", env, log_dir=tmp_path) for _ in range(2)]
    fleet = Fleet(pool, seeded.client_ids, task_seconds=0.02)
    try:
        for proc in procs:
            await asyncio.to_thread(proc.start)

        async def leader() -> ServiceProcess | None:
            found = [p for p in procs if await asyncio.to_thread(_is_leader, p)]
            return found[0] if len(found) == 1 else None

        first = await eventually(leader, timeout=15, message="one leader")
        async with running(fleet):
            await eventually(lambda: _scalar(pool, "SELECT count(*) >= 100 FROM desktop_tasks"), timeout=20,
                             message="dispatch under way")
            first.kill()  # SIGKILL: no graceful release, Postgres frees the lock when the session dies
            standby = next(p for p in procs if p is not first)
            await eventually(lambda: asyncio.to_thread(_is_leader, standby), timeout=15, message="standby leads")
            await eventually(lambda: _scalar(pool, f"SELECT count(*) = {TASKS} FROM monitoring_collect_tasks "
                                                   "WHERE status = 'completed'"), timeout=60,
                             message="every task completed")
        assert await _scalar(pool, "SELECT count(*) FROM (SELECT monitor_task_id FROM desktop_tasks "
                                   "GROUP BY 1 HAVING count(*) > 1) x") == 0
        assert await _scalar(pool, "SELECT count(*) FROM monitoring_collect_tasks WHERE dispatch_attempts <> 1") == 0
        assert await _scalar(pool, "SELECT count(*) FROM desktop_tasks") == TASKS
        assert await _scalar(pool, "SELECT count(*) FROM outbox WHERE message_type = 'task_available'") == TASKS

        # Operator views on the surviving instance and through the CLI.
        task_id = await _scalar(pool, "SELECT min(id) FROM monitoring_collect_tasks")
        explain_url = f"{standby.url}/api/ops/tasks/{task_id}/explain"
        try:
            await asyncio.to_thread(_get_json, explain_url)
        except urllib.error.HTTPError as refused:
            assert refused.code == 401 and json.loads(refused.read())["error"] == "unauthorized"
        else:
            raise AssertionError("the ops API answered without its token")
        explained = await asyncio.to_thread(_get_json, explain_url, OPS_TOKEN)
        assert explained["task_id"] == task_id and explained["ready"] is False
        assert any("status is completed" in line for line in explained["why"])
        status = await asyncio.to_thread(_get_json, f"{standby.url}/api/ops/dispatch/status", OPS_TOKEN)
        assert status["this_instance"]["leader"] is True and status["clients"]["eligible"] == 12
        out = await asyncio.to_thread(subprocess.run, [str(BIN / "monitorctl"), "--json", "explain", str(task_id)],
                                      env=env, capture_output=True, text=True, timeout=30, check=True)
        assert json.loads(out.stdout)["status"] == "completed"
        missing = await asyncio.to_thread(subprocess.run, [str(BIN / "monitorctl"), "explain", "999999999"],
                                          env=env, capture_output=True, text=True, timeout=30)
        assert missing.returncode == 1 and "no business task" in missing.stderr
    finally:
        for proc in procs:
            proc.stop()
