"""The broker away for 20 s (`make faults-long`: 10 minutes): a memory alarm that blocks every publisher, or the
broker stopped. Clicks are still accepted, the outbox holds its rows
without dead-lettering any, and once the broker is back everything drains and the clicks reach the desktop. Prints
how long the drain took."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from tests.faults.netfault import broker_stopped, have_rabbitmqctl, memory_alarm, memory_alarm_raised
from tests.faults.world import HUB_ENV, OPS_TOKEN, one_desktop, reached_desktop, seed_one_desktop
from tests.support.db import fetch as rows
from tests.support.stack import DISPATCH_SERVICES, running_stack
from tests.support.wait import eventually

# How long each fault lasts: FAULT_ALARM_SECONDS=600 and FAULT_BROKER_STOP_SECONDS=45 are `make faults-long`'s.
SECONDS = {"memory_alarm": float(os.environ.get("FAULT_ALARM_SECONDS", "20")),
           "stopped": float(os.environ.get("FAULT_BROKER_STOP_SECONDS", "20"))}
pytestmark = [pytest.mark.timeout(max(SECONDS.values()) + 180),
              pytest.mark.skipif(not have_rabbitmqctl(), reason="needs root and rabbitmqctl (the local broker)")]


async def _outbox_states(pool: AsyncConnectionPool[Conn]) -> dict[str, int]:
    return {r["status"]: r["n"] for r in await rows(pool, "SELECT status, count(*) AS n FROM outbox GROUP BY 1")}


async def _where_tasks_are(pool: AsyncConnectionPool[Conn], arrived: dict[str, float]) -> str:
    """For a failure message: each high task's state, whether its event reached the desktop, and the outbox."""
    tasks = await rows(pool, "SELECT t.id, t.status, t.dispatch_lane, d.id::text AS task_id, d.status AS execution "
                             "FROM monitoring_collect_tasks t LEFT JOIN desktop_tasks d ON d.monitor_task_id = t.id "
                             "WHERE t.collect_request_id IS NOT NULL ORDER BY t.id")
    lines = [f"task {t['id']} {t['status']}/{t['dispatch_lane']} execution {t['task_id']} {t['execution']} "
             f"arrived={t['task_id'] in arrived}" for t in tasks]
    return "high tasks:\n" + "\n".join(lines) + f"\noutbox: {await _outbox_states(pool)}"


FAULTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "memory_alarm": memory_alarm, "stopped": broker_stopped}


async def _fault_in_force(kind: str) -> bool:
    return memory_alarm_raised() if kind == "memory_alarm" else True


@pytest.mark.parametrize("kind", list(FAULTS))
async def test_the_broker_away_holds_the_outbox_and_drains_when_it_returns(
        kind: str, settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    away_s = SECONDS[kind]
    seed = await seed_one_desktop(pool)
    tenant = seed["tenants"][0]
    brands = [b["brand_id"] for b in tenant["brands"]]
    async with running_stack(settings, tmp_path, services=DISPATCH_SERVICES, OPS_API_TOKEN=OPS_TOKEN,
                             OUTBOX_PUBLISH_TIMEOUT_SECONDS=2, COORDINATOR_RELAY_LEASE_SECONDS=2, **HUB_ENV) as stack:
        desktop = one_desktop(stack, tenant["clients"][0]["token"])
        async with desktop:
            await eventually(desktop.connected.is_set, timeout=15, message="the desktop connected")
            with FAULTS[kind]():
                await eventually(lambda: _fault_in_force(kind), timeout=30, message=f"the broker fault {kind}")
                raised_at = time.monotonic()
                clicks = [await stack.collect_now(tenant, brand) for brand in brands]
                await eventually(lambda: time.monotonic() - raised_at >= away_s, timeout=away_s + 5,
                                 interval=1.0, message="the alarm's time")
                held = await _outbox_states(pool)
                assert held.get("dead_letter", 0) == 0, held
                assert held.get("queued", 0) + held.get("retryable", 0) + held.get("running", 0) > 0, held
            cleared_at = time.monotonic()
            for name, proc in stack.procs.items():
                assert proc.proc is not None and proc.proc.poll() is None, \
                    f"{name} died while the broker was away:\n{proc.logs()[-3000:]}"
            expected = sum(click["promoted_task_count"] for click in clicks)
            try:
                async def delivered() -> bool:
                    return len(await reached_desktop(pool, desktop)) >= expected

                await eventually(delivered, timeout=60, interval=0.1, message="the clicks delivered after the fault")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{await _where_tasks_are(pool, desktop.stats.event_arrivals)}\n"
                                     f"{stack.logs()}") from None
            delivered_s = time.monotonic() - cleared_at

            async def drained() -> bool:
                states = await _outbox_states(pool)
                return set(states) <= {"published"}

            await eventually(drained, timeout=60, interval=0.2, message="the outbox drained")
            drained_s = time.monotonic() - cleared_at
    print(f"\nbroker {kind} for {away_s:.0f} s: {len(clicks)} clicks accepted during it, held rows "
          f"{held}, dead letters 0; clicks delivered {delivered_s:.1f} s and the outbox drained {drained_s:.1f} s "
          "after the broker was back")
