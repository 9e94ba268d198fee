"""A leading dispatch-coordinator whose node goes silent (every packet it sends to Postgres and RabbitMQ dropped by
iptables: no FIN, no RST), with a standby, the rest of the stack and a desktop client working. The standby must
lead within the 15 s lease, a click made as the partition starts must reach the desktop within 20 s, the deposed
leader must step down by itself, and no business task may be dispatched twice. `make faults`; needs root and
iptables. Prints its figures (docs/reliability.md)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from tests.faults.netfault import have_iptables, in_fault_cgroup, leftover_rules, silenced
from tests.faults.world import HUB_ENV, OPS_TOKEN, one_desktop, reached_desktop, seed_one_desktop
from tests.support.db import fetch as rows
from tests.support.procs import ServiceProcess, service_env
from tests.support.stack import running_stack
from tests.support.wait import eventually

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not have_iptables(),
                                 reason="needs root, iptables (scripts/ensure-fault-tools.sh) and cgroup v2")]

STACK = ("outbox-pump", "dispatch-hub", "collect-now-api", "ingest-shard-workers")


def _leading(proc: ServiceProcess, role: str = "dispatch-coordinator") -> bool:
    try:
        with urllib.request.urlopen(proc.url + "/metrics", timeout=1) as resp:
            return f'leader_is_active{{role="{role}"}} 1.0' in resp.read().decode()
    except OSError:
        return False


async def test_a_silent_leader_is_replaced_within_the_lease(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                           tmp_path: Path) -> None:
    seed = await seed_one_desktop(pool)
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    brands = [b["brand_id"] for b in tenant["brands"]]
    db_port = int(conninfo_to_dict(settings.database_url).get("port") or 5432)
    amqp_port = urlsplit(settings.amqp_url).port or 5672
    async with running_stack(settings, tmp_path, services=STACK, **HUB_ENV) as stack:
        env = service_env(settings, OPS_API_TOKEN=OPS_TOKEN, DISPATCH_TICK_MS=200)
        leader = ServiceProcess("dispatch-coordinator", env, log_dir=tmp_path, wrapper=in_fault_cgroup()).start()
        standby = None
        try:
            await eventually(lambda: _leading(leader), timeout=20, message="the first coordinator leading")
            standby = ServiceProcess("dispatch-coordinator", env, log_dir=tmp_path).start()
            desktop = one_desktop(stack, client["token"])
            async with desktop:
                await eventually(desktop.connected.is_set, timeout=15, message="the desktop connected")
                before = await stack.collect_now(tenant, brands[0])

                async def reached(at_least: int, since: frozenset[str] = frozenset()) -> set[str] | None:
                    got = await reached_desktop(pool, desktop)
                    return got if len(got - since) >= at_least > 0 else None

                delivered_before = frozenset(await eventually(
                    lambda: reached(before["promoted_task_count"]), timeout=15, message="the first click delivered"))
                with silenced((db_port, amqp_port)):
                    partitioned_at = time.monotonic()
                    clicked = await stack.collect_now(tenant, brands[1])
                    await eventually(lambda: _leading(standby), timeout=30, interval=0.2,
                                     message=f"the standby leading\n{standby.logs()[-3000:]}")
                    standby_led_s = time.monotonic() - partitioned_at
                    await eventually(lambda: reached(clicked["promoted_task_count"], delivered_before), timeout=30,
                                     interval=0.1, message="the partition's click delivered")
                    delivered_s = time.monotonic() - partitioned_at
                    await eventually(lambda: not _leading(leader), timeout=20, interval=0.2,
                                     message="the deposed leader stepping down")
                    stepped_down_s = time.monotonic() - partitioned_at
                assert leftover_rules() == []
                healed = await stack.collect_now(tenant, brands[2])
                clicks = (before, clicked, healed)
                await eventually(lambda: reached(sum(click["promoted_task_count"] for click in clicks)), timeout=20,
                                 message="a click after the partition healed delivered")
            assert _leading(standby) and not _leading(leader), "the healed old leader must stay a standby"
        finally:
            leader.stop()
            if standby is not None:
                standby.stop()
    twice = await rows(pool, "SELECT monitor_task_id, count(*) AS n FROM desktop_tasks WHERE lane = 'high' "
                             "GROUP BY 1 HAVING count(*) > 1")
    terms = await rows(pool, "SELECT term FROM leader_terms WHERE role = 'dispatch-coordinator'")
    print(f"\nleader partition: standby leading after {standby_led_s:.1f} s, the click delivered after "
          f"{delivered_s:.1f} s, the deposed leader stepped down after {stepped_down_s:.1f} s; "
          f"terms taken {terms[0]['term']}, high tasks dispatched twice {len(twice)}")
    assert twice == []


async def test_a_silent_reconciler_leader_is_replaced_within_the_lease(settings: Settings,
                                                                       pool: AsyncConnectionPool[Conn],
                                                                       tmp_path: Path) -> None:
    """The reconciler's election is the same code: a silent leader is replaced, steps down, and stays a standby."""
    db_port = int(conninfo_to_dict(settings.database_url).get("port") or 5432)
    amqp_port = urlsplit(settings.amqp_url).port or 5672
    env = service_env(settings)
    leader = ServiceProcess("reconciler", env, log_dir=tmp_path, wrapper=in_fault_cgroup()).start()
    standby = None
    try:
        await eventually(lambda: _leading(leader, "reconciler"), timeout=20, message="the first reconciler leading")
        standby = ServiceProcess("reconciler", env, log_dir=tmp_path).start()
        with silenced((db_port, amqp_port)):
            partitioned_at = time.monotonic()
            await eventually(lambda: _leading(standby, "reconciler"), timeout=30, interval=0.2,
                             message=f"the standby reconciler leading\n{standby.logs()[-3000:]}")
            standby_led_s = time.monotonic() - partitioned_at
            await eventually(lambda: not _leading(leader, "reconciler"), timeout=20, interval=0.2,
                             message="the deposed reconciler stepping down")
            stepped_down_s = time.monotonic() - partitioned_at
        assert leftover_rules() == []
        assert _leading(standby, "reconciler") and not _leading(leader, "reconciler")
    finally:
        leader.stop()
        if standby is not None:
            standby.stop()
    terms = await rows(pool, "SELECT term FROM leader_terms WHERE role = 'reconciler'")
    print(f"\nreconciler partition: standby leading after {standby_led_s:.1f} s, the deposed leader stepped down "
          f"after {stepped_down_s:.1f} s; terms taken {terms[0]['term']}")
    assert terms[0]["term"] == 2
