"""libs/tasks/clicks.py's operations against real Postgres: the click's one read, the promotion of its scope (queued on
a pipelined transaction, read after the sync), and the request's reads after the click."""

from __future__ import annotations

import uuid

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.domain.shard import ingest_shard_key
from libs.tasks import clicks
from libs.tasks.clicks import ScopeRow
from tests.support.reconcile_factory import (
    heartbeat,
    insert_execution,
    insert_legacy_lease,
    insert_request,
    insert_task,
    make_world,
    row,
    today,
)


async def test_read_for_click_reads_brand_clients_requests_and_scope(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, clients=2, questions=2)
        await heartbeat(conn, w.clients[0], seconds_ago=1)
        await heartbeat(conn, w.clients[1], seconds_ago=600)  # stale: not a candidate
        active = await insert_request(conn, w, client_id=w.clients[0])

        async def read(brand_id: int) -> clicks.ClickReads:
            async with pipelined_transaction(conn) as pipe:
                queued = await clicks.read_for_click(
                    conn, tenant_id=w.tenant_id, workspace_id=w.workspace_id, brand_id=brand_id, keyword_id=None,
                    user_id=w.user_id, window_s=300, scope_hashes=["none"], heartbeat_timeout_s=30,
                    question_ids=None, platform_ids=None)
                await pipe.sync()
                return await queued.result()

        reads = await read(w.brand_id)
        assert (reads.brand_id, reads.workspace_id, reads.keyword_ok) == (w.brand_id, w.workspace_id, True)
        assert reads.business_date == today() and reads.user_requests_last_hour == 1
        assert [c.id for c in reads.candidates()] == [w.clients[0]]
        assert [(a.id, a.target_client_id) for a in reads.active()] == [(active, w.clients[0])]
        scope = {(s.question_id, s.ai_platform_id) for s in reads.scope()}
        assert scope == {(q, w.platform_id) for q in w.question_ids}
        assert reads.recent() == []  # no request of these scope hashes
        assert (await read(w.brand_id + 1000)).brand_id is None


async def test_promote_for_click_creates_promotes_and_marks_superseded(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=4)
        client = w.clients[0]
        old_request = await insert_request(conn, w, client_id=client)
        pending = await insert_task(conn, w, question_index=0, collect_request_id=old_request)
        outside = await insert_task(conn, w, question_index=2, collect_request_id=old_request)  # not in the scope
        held = await insert_task(conn, w, question_index=1, execution_owner="legacy")
        await insert_legacy_lease(conn, w, held, client)  # a client holds it: in the scope, not promoted
        request_id = await insert_request(conn, w, client_id=client)
        day = today()
        async with pipelined_transaction(conn) as pipe:
            queued = await clicks.promote_for_click(
                conn, tenant_id=w.tenant_id, workspace_id=w.workspace_id, brand_id=w.brand_id, business_date=day,
                client_id=client, request_id=request_id,
                scope=[ScopeRow(w.question_ids[i], w.platform_id, None) for i in (0, 1, 3)],
                shard_key=ingest_shard_key(w.tenant_id, w.brand_id, day), superseded_ids=[old_request])
            await pipe.sync()
            promoted = await queued.result()
        assert (promoted.created, promoted.scope_tasks) == (1, 3)
        assert pending in promoted.promoted_ids and held not in promoted.promoted_ids
        assert len(promoted.promoted_ids) == 2
        task = await row(conn, "SELECT dispatch_lane, target_client_id, collect_request_id, superseded_by_request_id "
                               "FROM monitoring_collect_tasks WHERE id = %s", pending)
        assert (task["dispatch_lane"], task["target_client_id"], task["collect_request_id"]) == (
            "high", client, request_id)
        # The superseded request's task outside the new scope says which request replaced its request.
        marked = await row(conn, "SELECT superseded_by_request_id, dispatch_lane FROM monitoring_collect_tasks "
                                 "WHERE id = %s", outside)
        assert (marked["superseded_by_request_id"], marked["dispatch_lane"]) == (request_id, "normal")
        held_row = await row(conn, "SELECT status, dispatch_lane FROM monitoring_collect_tasks WHERE id = %s", held)
        assert (held_row["status"], held_row["dispatch_lane"]) == ("leased", "normal")


async def test_request_reads_after_the_click(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, questions=2)
        client = w.clients[0]
        request_id = await insert_request(conn, w, client_id=client, dispatched=1)
        tasks = [await insert_task(conn, w, question_index=i, lane="high", collect_request_id=request_id)
                 for i in range(2)]
        await conn.execute("UPDATE monitoring_collect_requests SET request_scope = %s::jsonb WHERE id = %s",
                           (f'{{"monitor_task_ids": [{tasks[0]}, {tasks[1]}]}}', request_id))
        await insert_execution(conn, w, tasks[0], client, lane="high", collect_request_id=request_id)

        progress = await clicks.request_progress(conn, request_id=request_id, tenant_id=w.tenant_id)
        assert progress is not None and progress.first_dispatched_at is not None
        assert (progress.status, progress.dispatched_task_count) == ("accepted", 1)
        assert await clicks.request_progress(conn, request_id=uuid.uuid4(), tenant_id=w.tenant_id) is None

        view = await clicks.request_view(conn, request_id=request_id, tenant_id=w.tenant_id,
                                         workspace_id=w.workspace_id)
        assert view is not None and view.execution_leased and view.monitor_task_ids == tasks
        assert view.ttl_remaining_ms > 0
        assert await clicks.request_view(conn, request_id=request_id, tenant_id=w.tenant_id,
                                         workspace_id=w.workspace_id + 1) is None

        page = await clicks.request_tasks(conn, request_id=request_id, tenant_id=w.tenant_id, task_ids=tasks,
                                          after_task_id=0, limit=1)
        assert [(t.monitor_task_id, t.execution_status, t.lane) for t in page] == [(tasks[0], "in_progress", "high")]
        rest = await clicks.request_tasks(conn, request_id=request_id, tenant_id=w.tenant_id, task_ids=tasks,
                                          after_task_id=tasks[0], limit=10)
        assert [(t.monitor_task_id, t.execution_status) for t in rest] == [(tasks[1], None)]
