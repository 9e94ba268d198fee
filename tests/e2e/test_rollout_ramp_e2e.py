"""The guarded ramp end to end: the real reconciler process records its consistency figures every run, and the real
`monitorctl rollout advance` refuses the next step while a gate fails (a migration orphan), then takes it once the
gate has held again for the step's dwell (a 1 s dwell setting instead of days; no sleep, polling with a deadline)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import SettingError, load_settings, set_setting
from services.dispatch_coordinator import admin, rollout_ramp
from tests.support.db import one
from tests.support.desktop import insert_ready_task
from tests.support.monitorctl import run_in_process
from tests.support.procs import ServiceProcess, service_env
from tests.support.wait import eventually

DWELL_S = 1


async def _latest_observation(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    return await one(pool, "SELECT coalesce(max(id), 0) AS id, (array_agg(orphans ORDER BY id DESC))[1] AS orphans "
                           "FROM rollout_observations")


async def test_advance_is_refused_while_a_gate_fails_and_taken_once_it_held_for_the_dwell(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, due=False)
        for key, value in {"rollout_percentage": 5, "rollout_ramp": f"5:{DWELL_S}s,25:{DWELL_S}s,50:1d,100",
                           "reconcile_interval_seconds": 1, "rollout_gate_min_preemptions": 0}.items():
            await set_setting(conn, key, value)
        # A desktop_tasks-owned task that looks dispatched but has no execution record: an orphan (§16.2.4 #3).
        orphan = await insert_ready_task(conn, tenant=seed["tenants"][0], brand_index=0, question_index=0,
                                         platform_id=int(seed["platforms"][0]["ai_platform_id"]))
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_attempts = 1, last_dispatched_at = now() "
                           "WHERE id = %s", (orphan,))
    reconciler = ServiceProcess("reconciler", service_env(settings), log_dir=tmp_path).start()
    try:
        await eventually(lambda: _orphans_seen(pool), timeout=20, message="an observation with the orphan")
        refused = await run_in_process(settings, "rollout", "advance")
        assert refused.returncode == 1, refused.stderr
        verdict = msgspec.json.decode(refused.stdout)
        assert verdict["applied"] is False and verdict["next_step"] == 25
        assert verdict["reasons"] == ["a gate fails now: 1 migration orphan task(s) (at most 0)"], verdict
        async with pool.connection() as conn:
            assert (await load_settings(conn)).rollout_percentage == 5
            # The orphan resolved (its dispatch marks cleared, as a human would after looking): the gate holds again.
            await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_attempts = 0, last_dispatched_at = NULL "
                               "WHERE id = %s", (orphan,))
        fixed_at = time.monotonic()
        attempts: list[dict[str, Any]] = []

        async def advanced() -> bool:
            async with pool.connection() as conn:
                attempts.append(await rollout_ramp.advance(conn))
            return bool(attempts[-1]["applied"])

        await eventually(advanced, timeout=30, interval=0.2, message=f"the advance taken\n{reconciler.logs()[-3000:]}")
        assert time.monotonic() - fixed_at >= DWELL_S  # not before the gate had held for the dwell
        refusals = [reason for a in attempts[:-1] for reason in a["reasons"]]
        assert any("held again for" in r for r in refusals), refusals  # the breach restarted the dwell clock
        taken = attempts[-1]
        assert taken["rollout_percentage"] == {"before": 5, "after": 25} and taken["held_seconds"] >= DWELL_S
    finally:
        reconciler.stop()

    # The new step has its own dwell to hold first: refused with the reason, nothing changed.
    async with pool.connection() as conn:
        dwell = await rollout_ramp.advance(conn)
        assert not dwell["applied"] and f"of its {DWELL_S} s dwell" in dwell["reasons"][0], dwell
        # A jump past the gates needs --force; lowering does not.
        with pytest.raises(SettingError, match="--force"):
            await admin.set_rollout(conn, 100)
        assert (await admin.set_rollout(conn, 100, force=True))["rollout_percentage"] == {"before": 25, "after": 100}
        assert (await admin.set_rollout(conn, 50))["rollout_percentage"]["after"] == 50


async def _orphans_seen(pool: AsyncConnectionPool[Conn]) -> bool:
    row = await _latest_observation(pool)
    return bool(row["id"]) and row["orphans"] == 1
