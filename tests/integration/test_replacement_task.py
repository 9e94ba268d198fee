"""task_control.replacement_task_id: the interrupt a collect-now sends names the high execution that takes the
interrupted one's place, and the coordinator's high pass creates that execution under that very id."""

from __future__ import annotations

from typing import Any

import msgspec
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn
from libs.dispatch_settings import load_settings
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_hub.leases import current_interrupt
from tests.support.collect_now import api_client, business_task, execution, fetch_all, make_world, today


async def test_the_interrupt_names_the_high_execution_that_replaces_it(settings: Settings,
                                                                       pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=2, questions=1, clients=1)
        other_brand = world.tenant["brands"][1]
        day = await today(conn, world.tenant_id)
        scheduled = await business_task(conn, tenant_id=world.tenant_id, brand_id=other_brand["brand_id"],
                                        question_id=other_brand["question_ids"][0],
                                        ai_platform_id=world.platform_ids[0], business_date=day)
        running = await execution(conn, monitor_task_id=scheduled, client_id=world.client_id(0), status="in_progress")
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
        # the hub's replay of the interrupt names the same replacement
        (row,) = await fetch_all(conn, "SELECT * FROM desktop_tasks WHERE id = %s", running)
        assert current_interrupt(row, now=control.updated_at).replacement_task_id == control.replacement_task_id
        settings_now = await load_settings(conn)
    outcome = await Dispatcher(pool).run_high_pass(settings_now)
    assert outcome.dispatched >= 1
    async with pool.connection() as conn:
        high = await fetch_all(conn, "SELECT id, target_client_id, collect_request_id::text AS r FROM desktop_tasks "
                               "WHERE lane = 'high'")
        ids = {h["id"] for h in high}
        assert control.replacement_task_id in ids, (control.replacement_task_id, ids)
        assert all(h["r"] == accepted["request_id"] for h in high)
        # the id was used once: a later dispatch of the same task gets a new one
        left = await fetch_all(conn, "SELECT count(*) AS n FROM monitoring_collect_tasks "
                               "WHERE next_execution_id IS NOT NULL")
        assert left == [{"n": 0}]
