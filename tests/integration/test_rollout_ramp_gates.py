"""The ramp's preemption gate read from the executions themselves (services/dispatch_coordinator/rollout_ramp.py):
a running execution that hit the hard timeout counts against the step, one that yielded for it; queued ones cancelled
outright and executions interrupted before the step started do not count."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from services.dispatch_coordinator import rollout_ramp
from tests.support.desktop import dispatch_execution

_INTERRUPTED = """
UPDATE desktop_tasks SET status = 'aborted', lease_epoch = %(epoch)s, interrupt_reason = %(reason)s,
       interrupted_at = now() - make_interval(secs => %(ago_s)s), finished_at = now()
WHERE id = %(id)s
"""


async def test_the_preemption_gate_counts_running_work_interrupted_this_step(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=3, clients=1, due=False)
        tenant = seed["tenants"][0]
        client = tenant["clients"][0]["client_id"]
        platforms = [int(p["ai_platform_id"]) for p in seed["platforms"]]
        for key, value in {"rollout_percentage": 5, "rollout_ramp": "5:0s,100", "rollout_gate_min_preemptions": 2,
                           "rollout_gate_preempt_success_min": 0.9}.items():
            await set_setting(conn, key, value)
        await conn.execute("INSERT INTO rollout_observations (rollout_percentage, ingest_lag_ms, reconcile_fixes, "
                           "orphans) VALUES (5, 0, 0, 0)")
        made = [await dispatch_execution(conn, tenant=tenant, platform_id=platforms[p], client_id=client,
                                         question_index=q) for p in range(2) for q in range(3)]
        ids = [m["task_id"] for m in made]
        # This step: one running execution yielded, one hit the hard timeout, one queued was cancelled (epoch 0).
        # Before the step (an hour ago): two hard timeouts that must not count.
        for task_id, epoch, reason, ago_s in ((ids[0], 1, "collect_now_preempt", 0),
                                              (ids[1], 1, "interrupt_hard_timeout", 0),
                                              (ids[2], 0, "collect_now_preempt", 0),
                                              (ids[3], 1, "interrupt_hard_timeout", 3600),
                                              (ids[4], 1, "interrupt_hard_timeout", 3600)):
            await conn.execute(_INTERRUPTED, {"id": task_id, "epoch": epoch, "reason": reason, "ago_s": ago_s})

        refused = await rollout_ramp.advance(conn)
        gate = next(g for g in refused["gates"] if g["gate"] == "preempt_success_rate")
        assert (gate["interrupts"], gate["rate"]) == (2, 0.5)
        assert not refused["applied"] and refused["reasons"] == [
            "preemption success rate 50.0% below 90% (1 of 2 hit the hard timeout)"]

        await conn.execute(_INTERRUPTED, {"id": ids[1], "epoch": 1, "reason": "collect_now_preempt", "ago_s": 0})
        await conn.execute(_INTERRUPTED, {"id": ids[5], "epoch": 2, "reason": "collect_now_preempt", "ago_s": 0})
        taken = await rollout_ramp.advance(conn)
        assert taken["applied"] and taken["rollout_percentage"] == {"before": 5, "after": 100}, taken
