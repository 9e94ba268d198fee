"""task_control.replacement_task_id: the interrupt a collect-now sends names the high execution that takes the
interrupted one's place, and the coordinator's high pass creates that execution under that very id (on the legacy
path: the high offer)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import msgspec
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn
from libs.dispatch_settings import load_settings, set_setting
from libs.domain.lanes import lane_weight
from libs.tasks import execution_paths, legacy
from libs.tasks.records import Leased, LeaseState
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_hub.leases import current_interrupt
from tests.support.collect_now import World, api_client, business_task, execution, fetch_all, make_world, today


async def _interrupting_click(settings: Settings, pool: AsyncConnectionPool[Conn], *, legacy_path: bool) -> (
        tuple[World, uuid.UUID, dict[str, Any], TaskControl]):
    """A click whose client runs scheduled work of another brand (an execution, or a pulled legacy lease): the
    world, the running work, the click's answer and the interrupt sent for it."""
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=1, clients=1)
        if legacy_path:
            await set_setting(conn, "rollout_percentage", 0)  # every tenant on the legacy path
        other_brand = world.tenant["brands"][1]
        day = await today(conn, world.tenant_id)
        scheduled = await business_task(conn, tenant_id=world.tenant_id, brand_id=other_brand["brand_id"],
                                        question_id=other_brand["question_ids"][0],
                                        ai_platform_id=world.platform_ids[0], business_date=day)
        if legacy_path:
            await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = 'legacy' WHERE id = %s",
                               (scheduled,))
            running = await pulled_legacy_lease(conn, scheduled, world.client_id(0))
        else:
            running = await execution(conn, monitor_task_id=scheduled, client_id=world.client_id(0),
                                      status="in_progress")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 4")
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 2 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 2")
    async with api_client(settings) as http:
        resp = await http.post(f"/api/tenant/monitoring/brands/{world.brand_id}/collect-now", json={},
                               headers=world.auth())
        accepted: dict[str, Any] = await resp.json()
        assert resp.status == 202 and accepted["interrupt_requested_count"] == 1, accepted
    async with pool.connection() as conn:
        rows = await fetch_all(conn, "SELECT payload FROM outbox WHERE routing_key = %s",
                               f"monitor.control.{world.client_id(0)}")
    (control,) = [msgspec.json.decode(r["payload"], type=TaskControl) for r in rows]
    assert control.control == "interrupt_requested" and control.task_id == running
    assert control.replacement_task_id is not None
    return world, running, accepted, control


async def test_the_interrupt_names_the_high_execution_that_replaces_it(settings: Settings,
                                                                       pool: AsyncConnectionPool[Conn]) -> None:
    world, running, accepted, control = await _interrupting_click(settings, pool, legacy_path=False)
    async with pool.connection() as conn:
        # the hub's re-sent interrupt names the same replacement
        row = await execution_paths.DESKTOP_TASKS.lease_state(conn, running, tenant_id=world.tenant_id)
        assert isinstance(row, LeaseState)
        assert current_interrupt(row, now=control.updated_at).replacement_task_id == control.replacement_task_id
        settings_now = await load_settings(conn)
    outcome = await Dispatcher(pool).run_high_pass(settings_now)
    assert outcome.dispatched >= 1
    async with pool.connection() as conn:
        high = await fetch_all(conn, "SELECT id, target_client_id, collect_request_id::text AS r FROM desktop_tasks "
                               "WHERE lane = 'high'")
        ids = {h["id"] for h in high}
        assert control.replacement_task_id in ids, (control.replacement_task_id, ids)
        # §7.2 supersedes_task_id: the replacement names the execution it replaced (migration 061); no other does
        links = await fetch_all(conn, "SELECT id, supersedes_task_id FROM desktop_tasks "
                                      "WHERE supersedes_task_id IS NOT NULL")
        assert links == [{"id": control.replacement_task_id, "supersedes_task_id": running}]
        assert all(h["r"] == accepted["request_id"] for h in high)
        # the id was used once: a later dispatch of the same task gets a new one
        left = await fetch_all(conn, "SELECT count(*) AS n FROM monitoring_collect_tasks "
                               "WHERE next_execution_id IS NOT NULL")
        assert left == [{"n": 0}]


async def test_the_legacy_interrupt_names_the_offer_that_replaces_it(settings: Settings,
                                                                     pool: AsyncConnectionPool[Conn]) -> None:
    """The same on the legacy path (docs/legacy-path.md): the interrupted lease keeps the replacement's id, the hub's
    re-sent interrupt (read from the lease as the hub reads it) names it, and the high pass offers the promoted task
    under that id."""
    world, running, accepted, control = await _interrupting_click(settings, pool, legacy_path=True)
    async with pool.connection() as conn:
        (flags,) = await fetch_all(conn, "SELECT control_flags FROM legacy_leases WHERE id = %s", running)
        assert flags["control_flags"]["replacement_task_id"] == str(control.replacement_task_id)
        # the hub's re-sent interrupt of the lease (a stale callback) names the same replacement
        row = await execution_paths.LEGACY.lease_state(conn, running, tenant_id=world.tenant_id)
        assert isinstance(row, LeaseState)
        resent = current_interrupt(row, now=control.updated_at)
        assert (resent.task_id, resent.control, resent.replacement_task_id) == (
            running, "interrupt_requested", control.replacement_task_id)
        settings_now = await load_settings(conn)
    outcome = await Dispatcher(pool).run_high_pass(settings_now)
    assert outcome.dispatched >= 1
    async with pool.connection() as conn:
        offers = await fetch_all(conn, "SELECT id, collect_request_id::text AS r FROM legacy_leases "
                                       "WHERE lane = 'high'")
        assert control.replacement_task_id in {o["id"] for o in offers}, (control.replacement_task_id, offers)
        assert all(o["r"] == accepted["request_id"] for o in offers)
        assert await fetch_all(conn, "SELECT count(*) AS n FROM desktop_tasks") == [{"n": 0}]


async def pulled_legacy_lease(conn: Conn, monitor_task_id: int, client_id: uuid.UUID) -> uuid.UUID:
    """Scheduled legacy work the client pulled: offered (legacy.offer) and leased (LegacyExecutions.mark_leased), as the
    coordinator and the hub write it."""
    (task,) = await fetch_all(conn, "SELECT * FROM monitoring_collect_tasks WHERE id = %s", monitor_task_id)
    lease_id = uuid.uuid4()
    async with conn.transaction():
        await legacy.offer(conn, [{
            "id": lease_id, "monitor_task_id": monitor_task_id, "tenant_id": task["tenant_id"],
            "workspace_id": task["workspace_id"], "target_client_id": client_id,
            "ai_platform_id": task["ai_platform_id"], "brand_id": task["brand_id"], "question_id": task["question_id"],
            "business_date": task["business_date"], "lane": "normal", "lane_weight": lane_weight("monitor", "normal"),
            "priority": task["dispatch_priority"], "interrupt_generation": 0, "collect_request_id": None,
            "enqueued_at": task["enqueued_at"]}], ts=datetime.now(UTC))
        leased = await execution_paths.LEGACY.mark_leased(conn, lease_id, epoch=1, token_hash="h", ttl_s=300)
    assert isinstance(await leased.result(), Leased)
    return lease_id
