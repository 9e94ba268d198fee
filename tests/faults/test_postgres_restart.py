"""Postgres stopped for FAULT_PG_OUTAGE_SECONDS (20 s here, 75 for the issue's run), `-m fast` and `-m immediate`
(a crash), with the stack and a desktop working: clicks are answered 503 while it is away, every service stays up,
and once it is back the first click is accepted and reaches the desktop. Prints how long after the return.
It stops the shared server: it runs alone, in `make faults`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from tests.faults.netfault import have_pg_ctl, postgres_stopped
from tests.faults.world import HUB_ENV, OPS_TOKEN, one_desktop, reached_desktop, seed_one_desktop
from tests.support.stack import DISPATCH_SERVICES, Stack, running_stack
from tests.support.wait import eventually

OUTAGE_SECONDS = float(os.environ.get("FAULT_PG_OUTAGE_SECONDS", "20"))
pytestmark = [pytest.mark.timeout(OUTAGE_SECONDS + 240),
              pytest.mark.skipif(not have_pg_ctl(), reason="needs root and the fault servers (make faults)")]


async def _click_accepted(stack: Stack, tenant: dict[str, object], brand: int) -> dict[str, object] | None:
    payload = await stack.collect_now(tenant, brand, expect=(200, 201, 202, 503))
    return payload if "promoted_task_count" in payload else None  # a 503 problem has a request_id too


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_postgres_back_the_first_click_reaches_its_desktop(
        mode: str, settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    seed = await seed_one_desktop(pool)
    tenant = seed["tenants"][0]
    brands = [b["brand_id"] for b in tenant["brands"]]
    async with running_stack(settings, tmp_path, services=DISPATCH_SERVICES, OPS_API_TOKEN=OPS_TOKEN,
                             **HUB_ENV) as stack:
        desktop = one_desktop(stack, tenant["clients"][0]["token"])
        async with desktop:
            await eventually(desktop.connected.is_set, timeout=15, message="the desktop connected")
            with postgres_stopped(mode):
                stopped_at = time.monotonic()
                refused = await stack.collect_now(tenant, brands[0], expect=(503,))
                assert refused["error"] == "database_unavailable", refused
                await eventually(lambda: time.monotonic() - stopped_at >= OUTAGE_SECONDS,
                                 timeout=OUTAGE_SECONDS + 5, interval=1.0, message="the outage's time")
                for name, proc in stack.procs.items():
                    assert proc.proc is not None and proc.proc.poll() is None, f"{name} died while Postgres was away"
            back_at = time.monotonic()
            await pool.check()  # the test's own idle connections were ended with the server: replaced
            clicked = await eventually(lambda: _click_accepted(stack, tenant, brands[1]), timeout=60, interval=0.1,
                                       message="a click accepted after Postgres returned")
            accepted_s = time.monotonic() - back_at

            async def delivered() -> bool:
                return len(await reached_desktop(pool, desktop)) >= int(str(clicked["promoted_task_count"]))

            await eventually(delivered, timeout=60, interval=0.1, message="the click delivered")
            delivered_s = time.monotonic() - back_at
    print(f"\nPostgres stopped -m {mode} for {OUTAGE_SECONDS:.0f} s: first click accepted {accepted_s:.1f} s and "
          f"delivered {delivered_s:.1f} s after it was back")
