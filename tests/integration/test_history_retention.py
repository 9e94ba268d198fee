"""History retention (reconciler job `history_retention`, libs/tasks/retention.py): finished executions with their
attempts, finished legacy leases, finished collect-now requests and finished business tasks past their retention go,
in bounded batches, oldest first; a live one never does, however old, nor anything younger than its retention, nor a
business task an execution or a legacy lease still refers to."""

from __future__ import annotations

import uuid
from datetime import timedelta

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.runner import run_job
from tests.support.reconcile_factory import insert_execution, insert_request, insert_task, make_world, today

_AGE_EXECUTION = "UPDATE desktop_tasks SET created_at = now() - make_interval(days => %(days)s) WHERE id = %(id)s"
_LEASE = """
INSERT INTO legacy_leases (id, monitor_task_id, tenant_id, workspace_id, target_client_id, ai_platform_id, brand_id,
    question_id, business_date, lane, lane_weight, priority, status, enqueued_at, created_at)
SELECT %(id)s, t.id, t.tenant_id, t.workspace_id, %(client)s, t.ai_platform_id, t.brand_id, t.question_id,
       t.business_date, 'normal', 2, 100, %(status)s, t.enqueued_at, now() - make_interval(days => %(days)s)
FROM monitoring_collect_tasks t WHERE t.id = %(task)s
"""


async def _ids(conn: Conn, query: str) -> set[object]:
    cur = await conn.execute(query)
    return {r["id"] for r in await cur.fetchall()}


async def test_old_finished_history_goes_in_batches_and_live_or_recent_rows_stay(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=9)
        client = w.clients[0]
        tasks = [await insert_task(conn, w, question_index=i, status="completed" if i < 5 else "pending")
                 for i in range(9)]
        executions: dict[str, uuid.UUID] = {}
        # Three old finished executions (one with an attempt), one old live one, one recent finished one.
        for name, task, status, days in (("old_a", tasks[0], "succeeded", 40), ("old_b", tasks[1], "failed", 50),
                                         ("old_c", tasks[2], "aborted", 60), ("old_live", tasks[5], "unknown", 90),
                                         ("recent", tasks[3], "succeeded", 10)):
            executions[name] = await insert_execution(conn, w, task, client, status=status)
            await conn.execute(_AGE_EXECUTION, {"id": executions[name], "days": days})
        await conn.execute("INSERT INTO desktop_task_attempts (task_id, monitor_task_id, tenant_id, client_id, "
                           "lease_epoch, status, started_at, finished_at) VALUES (%s, %s, %s, %s, 1, 'succeeded', "
                           "now() - interval '40 days', now() - interval '40 days')",
                           (executions["old_a"], tasks[0], w.tenant_id, client))
        leases = {name: uuid.uuid4() for name in ("old", "old_live", "recent")}
        for name, task, status, days in (("old", tasks[4], "expired", 40), ("old_live", tasks[6], "queued", 40),
                                         ("recent", tasks[7], "succeeded", 1)):
            await conn.execute(_LEASE, {"id": leases[name], "client": client, "status": status, "days": days,
                                        "task": task})
        day = 86_400
        requests = {"old": await insert_request(conn, w, client_id=client, status="succeeded", created_ago=40 * day),
                    "old_timed_out": await insert_request(conn, w, client_id=client, status="timed_out",
                                                          created_ago=36 * day),
                    "old_live": await insert_request(conn, w, client_id=client, status="running",
                                                     created_ago=40 * day),
                    "recent": await insert_request(conn, w, client_id=client, status="succeeded", created_ago=day)}

        # Two rows per table and batch, one batch a run: the oldest two executions go first.
        config = ReconcilerConfig(retention_batch_rows=2, retention_batches_per_run=1)
        first = await run_job(JOBS["history_retention"], conn, config)
        assert first.details == {"executions": 2, "legacy_leases": 1, "collect_requests": 2}
        remaining = await _ids(conn, "SELECT id FROM desktop_tasks")
        assert executions["old_c"] not in remaining and executions["old_b"] not in remaining
        assert executions["old_a"] in remaining

        second = await run_job(JOBS["history_retention"], conn, config)
        assert second.details == {"executions": 1, "attempts": 1}
        assert await _ids(conn, "SELECT id FROM desktop_tasks") == {executions["old_live"], executions["recent"]}
        cur = await conn.execute("SELECT count(*) AS n FROM desktop_task_attempts WHERE task_id = %s",
                                 (executions["old_a"],))
        assert (await cur.fetchone())["n"] == 0  # type: ignore[index]
        assert await _ids(conn, "SELECT id FROM legacy_leases") == {leases["old_live"], leases["recent"]}
        assert await _ids(conn, "SELECT id FROM monitoring_collect_requests") == {requests["old_live"],
                                                                                  requests["recent"]}
        # The business tasks stay (reports, explain, the scanner's business keys).
        cur = await conn.execute("SELECT count(*) AS n FROM monitoring_collect_tasks WHERE id = ANY(%s)", (tasks,))
        assert (await cur.fetchone())["n"] == len(tasks)  # type: ignore[index]

        assert (await run_job(JOBS["history_retention"], conn, config)).fixed == 0


async def test_old_finished_business_tasks_go_oldest_first_and_live_or_referenced_or_young_ones_stay(
        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=3)
        client = w.clients[0]
        old = today() - timedelta(days=410)
        tasks: dict[str, int] = {}
        # Finished and past BUSINESS_TASK_RETENTION_DAYS (400): every finished status goes, oldest first.
        for k, status in enumerate(("completed", "failed", "skipped", "expired")):
            tasks[status] = await insert_task(conn, w, question_index=0, status=status,
                                              business_date=old - timedelta(days=k))
        # Finished, old, its last execution as old: the batch deletes the execution first, then the task.
        tasks["with_old_execution"] = await insert_task(conn, w, question_index=1, status="completed",
                                                        business_date=old)
        execution = await insert_execution(conn, w, tasks["with_old_execution"], client, status="succeeded")
        await conn.execute(_AGE_EXECUTION, {"id": execution, "days": 410})
        # Kept: live however old (the business-day sweep's to expire, not the retention's to delete) ...
        tasks["pending"] = await insert_task(conn, w, question_index=1, status="pending",
                                             business_date=old - timedelta(days=1))
        tasks["leased"] = await insert_task(conn, w, question_index=1, status="leased", execution_owner="legacy",
                                            business_date=old - timedelta(days=2), legacy_lease_expires_in=60)
        tasks["received"] = await insert_task(conn, w, question_index=1, status="received", execution_owner="legacy",
                                              business_date=old - timedelta(days=3), legacy_lease_expires_in=60)
        # ... finished but an execution (live: unknown) or a legacy lease (finished, inside its own retention) still
        # refers to it ...
        tasks["with_live_execution"] = await insert_task(conn, w, question_index=2, status="failed",
                                                         business_date=old)
        live = await insert_execution(conn, w, tasks["with_live_execution"], client, status="unknown")
        await conn.execute(_AGE_EXECUTION, {"id": live, "days": 410})
        tasks["with_lease"] = await insert_task(conn, w, question_index=2, status="expired",
                                                business_date=old - timedelta(days=1))
        await conn.execute(_LEASE, {"id": uuid.uuid4(), "client": client, "status": "expired", "days": 20,
                                    "task": tasks["with_lease"]})
        # ... or inside the retention.
        tasks["young"] = await insert_task(conn, w, question_index=2, status="completed",
                                           business_date=today() - timedelta(days=399))

        config = ReconcilerConfig(retention_batch_rows=2, retention_batches_per_run=1)
        first = await run_job(JOBS["history_retention"], conn, config)
        assert first.details == {"executions": 1, "business_tasks": 2}
        remaining = await _ids(conn, "SELECT id FROM monitoring_collect_tasks")
        assert tasks["expired"] not in remaining and tasks["skipped"] not in remaining  # the two oldest
        # A finished one a writer holds is left for a later batch (SKIP LOCKED), not waited for.
        async with pool.connection() as writer, writer.transaction():
            await writer.execute("SELECT 1 FROM monitoring_collect_tasks WHERE id = %s FOR UPDATE",
                                 (tasks["failed"],))
            second = await run_job(JOBS["history_retention"], conn, config)
            assert second.details == {"business_tasks": 2}
            assert tasks["failed"] in await _ids(conn, "SELECT id FROM monitoring_collect_tasks")
        third = await run_job(JOBS["history_retention"], conn, config)
        assert third.details == {"business_tasks": 1}

        kept = {"pending", "leased", "received", "with_live_execution", "with_lease", "young"}
        assert await _ids(conn, "SELECT id FROM monitoring_collect_tasks") == {tasks[k] for k in kept}
        assert await _ids(conn, "SELECT id FROM desktop_tasks") == {live}
        assert (await run_job(JOBS["history_retention"], conn, config)).fixed == 0
