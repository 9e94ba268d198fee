"""The rollout dashboard's gauges and counters (deploy/k8s/base/grafana-dashboard-rollout.yaml) against real Postgres:
the rollout percentage as stored, the work in flight per execution path as the database holds it, and the dispatches
per path; a tenant that a rollout moves to legacy shows up on the legacy side of each."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import load_settings
from libs.telemetry import metrics
from services.dispatch_coordinator import admin
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_coordinator.maintenance import observe_backlog, observe_paths
from services.dispatch_coordinator.scanner import scan_once
from tests.support.db import one

OWNERS = ("desktop_tasks", "legacy")
_IN_FLIGHT = """
SELECT (SELECT count(*) FROM desktop_tasks WHERE kind = 'monitor' AND status IN ('queued', 'in_progress', 'unknown'))
           AS desktop_tasks,
       (SELECT count(*) FROM legacy_leases WHERE status IN ('queued', 'in_progress')) AS legacy
"""


def _gauges() -> dict[str, Any]:
    return {"rollout": REGISTRY.get_sample_value("dispatch_rollout_percentage"),
            **{owner: REGISTRY.get_sample_value("dispatch_in_flight_tasks", {"execution_owner": owner})
               for owner in OWNERS}}


def _dispatched() -> dict[str, float]:
    return {owner: metrics.dispatch_dispatched_by_owner_count.value(execution_owner=owner) for owner in OWNERS}


async def _database(pool: AsyncConnectionPool[Conn], rollout: int) -> dict[str, Any]:
    row = await one(pool, _IN_FLIGHT)
    return {"rollout": float(rollout), **{owner: float(row[owner]) for owner in OWNERS}}


async def _tick(pool: AsyncConnectionPool[Conn]) -> None:
    """What the coordinator's maintenance tick does for these gauges."""
    async with pool.connection() as conn:
        await observe_backlog(conn)


async def test_the_rollout_gauges_follow_the_database_and_a_moved_tenant_shows_up_on_legacy(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=2, brands=1, questions=3, clients=1, due=False)
    stays, moves = sorted(seed["tenants"], key=lambda t: int(t["tenant_id"]) % 100)
    cut = int(moves["tenant_id"]) % 100
    assert int(stays["tenant_id"]) % 100 < cut, "the two tenants fall on either side of the cut"

    await _tick(pool)
    assert _gauges() == await _database(pool, 100) == {"rollout": 100.0, "desktop_tasks": 0.0, "legacy": 0.0}

    async with pool.connection() as conn:
        moved = await admin.set_rollout(conn, cut)
    assert moved["tenants_to_legacy"] == 1
    await _tick(pool)
    assert _gauges()["rollout"] == cut

    # Scheduled work of both tenants, dispatched: the moved tenant's on legacy, the other's on desktop_tasks.
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET online = true, last_heartbeat_at = now()")
        await conn.execute("UPDATE monitoring_plans SET next_run_at = now() - interval '1 minute'")
        settings = await load_settings(conn)
    created_before = {o: metrics.dispatch_scanner_tasks_created_count.value(execution_owner=o) for o in OWNERS}
    dispatched_before = _dispatched()
    assert (await scan_once(pool, batch_size=100, rollout_percentage=settings.rollout_percentage)).created > 0
    outcome = await Dispatcher(pool).run_pass(settings)
    assert outcome.dispatched > 0

    tasks = {r["execution_owner"]: r["n"] for r in [
        await one(pool, "SELECT 'legacy' AS execution_owner, count(*) AS n FROM monitoring_collect_tasks "
                        "WHERE tenant_id = %s AND execution_owner = 'legacy'", moves["tenant_id"]),
        await one(pool, "SELECT 'desktop_tasks' AS execution_owner, count(*) AS n FROM monitoring_collect_tasks "
                        "WHERE tenant_id = %s AND execution_owner = 'desktop_tasks'", stays["tenant_id"])]}
    assert tasks["legacy"] > 0 and tasks["desktop_tasks"] > 0
    created = {o: metrics.dispatch_scanner_tasks_created_count.value(execution_owner=o) - created_before[o]
               for o in OWNERS}
    assert created == {o: float(tasks[o]) for o in OWNERS}

    written = await one(pool, "SELECT (SELECT count(*) FROM desktop_tasks) AS desktop_tasks, "
                              "(SELECT count(*) FROM legacy_leases) AS legacy")
    assert written["legacy"] > 0 and written["desktop_tasks"] > 0
    assert {o: _dispatched()[o] - dispatched_before[o] for o in OWNERS} == {o: float(written[o]) for o in OWNERS}
    assert sum(written[o] for o in OWNERS) == outcome.dispatched

    await _tick(pool)
    in_flight = await _database(pool, cut)
    assert in_flight["legacy"] > 0 and in_flight["desktop_tasks"] > 0
    assert _gauges() == in_flight

    # Work ends on both paths: the gauges follow at the next tick.
    async with pool.connection() as conn:
        await conn.execute("UPDATE legacy_leases SET status = 'expired', finished_at = now() "
                           "WHERE id = (SELECT min(id::text)::uuid FROM legacy_leases)")
        await conn.execute("UPDATE desktop_tasks SET status = 'aborted', finished_at = now() "
                           "WHERE id = (SELECT min(id::text)::uuid FROM desktop_tasks)")
    await _tick(pool)
    after = await _database(pool, cut)
    assert after == {**in_flight, "legacy": in_flight["legacy"] - 1, "desktop_tasks": in_flight["desktop_tasks"] - 1}
    assert _gauges() == after


async def test_the_path_gauges_are_exported_by_the_leader_only(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        await observe_paths(conn)
    role = metrics.LEADER_OWNED["dispatch_rollout_percentage"]
    assert metrics.LEADER_OWNED["dispatch_in_flight_tasks"] == role == "dispatch-coordinator"
    metrics.set_leading(role, False)
    standby = metrics.exposition().decode()
    metrics.set_leading(role, True)
    try:
        leader = metrics.exposition().decode()
    finally:
        metrics.set_leading(role, False)
    for name in ("dispatch_rollout_percentage", "dispatch_in_flight_tasks"):
        assert f"\n{name}" not in standby
        assert f"\n{name}" in leader
