"""libs/tasks/requests.py's operations against real Postgres: each moves a collect-now request only from the states
it may leave, and answers what it did (docs/architecture.md "The task store: the click's and ingest's operations")."""

from __future__ import annotations

import uuid

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.tasks import requests
from libs.tasks.requests import CountDelta
from tests.support.reconcile_factory import insert_execution, insert_request, insert_task, make_world, row


async def _status(conn: Conn, request_id: uuid.UUID) -> str:
    return str((await row(conn, "SELECT status FROM monitoring_collect_requests WHERE id = %s", request_id))["status"])


async def test_create_and_supersede_on_a_pipelined_transaction(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        client = w.clients[0]
        open_old = await insert_request(conn, w, client_id=client, status="running")
        finished_old = await insert_request(conn, w, client_id=client, status="succeeded")
        new_id = uuid.uuid4()
        async with pipelined_transaction(conn):
            created = await requests.create(
                conn, request_id=new_id, tenant_id=w.tenant_id, workspace_id=w.workspace_id, brand_id=w.brand_id,
                keyword_id=None, user_id=w.user_id, client_id=client, scope_hash="h", scope={"monitor_task_ids": [1]},
                preempt=True, generation=3, requested=1, aborted_queued=0, interrupt_requested=0, ttl_s=120,
                traceparent=None)
            superseded = await requests.supersede(conn, request_id=new_id, tenant_id=w.tenant_id,
                                                  old_ids=[open_old, finished_old])
            nothing = await requests.supersede(conn, request_id=new_id, tenant_id=w.tenant_id, old_ids=[])
        request = await created.result()
        assert (request.id, request.status) == (new_id, "accepted")
        ttl = await row(conn, "SELECT ttl_expires_at - created_at AS ttl, request_scope FROM "
                              "monitoring_collect_requests WHERE id = %s", new_id)
        assert ttl["ttl"].total_seconds() == 120 and ttl["request_scope"] == {"monitor_task_ids": [1]}
        assert await superseded.result() == [open_old]  # a finished request is not superseded
        assert await nothing.result() == []
        assert await _status(conn, open_old) == "superseded" and await _status(conn, finished_old) == "succeeded"


async def test_dispatched_running_and_first_preempt(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        request_id = await insert_request(conn, w, client_id=w.clients[0])
        done = await insert_request(conn, w, client_id=w.clients[0], status="succeeded")
        first = await (await requests.mark_dispatched(conn, {request_id: 2})).result()
        again = await (await requests.mark_dispatched(conn, {request_id: 1})).result()
        assert [(d.id, d.first) for d in first] == [(request_id, True)] and not again[0].first
        assert first[0].latency_ms >= 0
        assert await (await requests.mark_dispatched(conn, {})).result() == []
        counted = await row(conn, "SELECT status, dispatched_task_count FROM monitoring_collect_requests WHERE id = %s",
                            request_id)
        assert (counted["status"], counted["dispatched_task_count"]) == ("dispatching", 3)

        await requests.mark_running(conn, request_id=request_id, tenant_id=w.tenant_id)
        await requests.mark_running(conn, request_id=done, tenant_id=w.tenant_id)
        assert await _status(conn, request_id) == "running" and await _status(conn, done) == "succeeded"

        age = await requests.mark_first_preempt(conn, request_id=request_id, tenant_id=w.tenant_id)
        assert age is not None and age >= 0
        assert await requests.mark_first_preempt(conn, request_id=request_id, tenant_id=w.tenant_id + 1) is None


async def test_record_results_then_finish_once(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        request_id = await insert_request(conn, w, client_id=w.clients[0], status="running", requested=2)
        one = await requests.record_results(conn, request_id=request_id, tenant_id=w.tenant_id,
                                            delta=CountDelta(completed=1))
        assert one is not None and one.first_result and one.final_status() is None
        two = await requests.record_results(conn, request_id=request_id, tenant_id=w.tenant_id,
                                            delta=CountDelta(failed=1))
        assert two is not None and not two.first_result
        assert (two.completed_task_count, two.failed_task_count, two.final_status()) == (1, 1, "partial")
        assert await requests.finish(conn, request_id=request_id, status="partial")
        assert not await requests.finish(conn, request_id=request_id, status="failed")  # final already
        assert await _status(conn, request_id) == "partial"
        assert await requests.record_results(conn, request_id=request_id, tenant_id=w.tenant_id + 1,
                                             delta=CountDelta(completed=1)) is None


async def test_time_out_demotes_and_leaves_a_running_request_with_live_work(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        client = w.clients[0]
        stale = await insert_request(conn, w, client_id=client, ttl_in=-5)
        busy = await insert_request(conn, w, client_id=client, status="running", ttl_in=-5)
        fresh = await insert_request(conn, w, client_id=client)
        high = await insert_task(conn, w, question_index=0, lane="high", target_client_id=client,
                                 collect_request_id=stale)
        running_task = await insert_task(conn, w, question_index=1, lane="high", collect_request_id=busy)
        await insert_execution(conn, w, running_task, client, lane="high", collect_request_id=busy)

        assert await requests.timed_out_candidates(conn, limit=10) == [stale]
        async with conn.transaction():
            timed_out = await requests.time_out(conn, stale)
        assert timed_out is not None
        assert (timed_out.id, timed_out.tenant_id, timed_out.tasks_demoted) == (stale, w.tenant_id, 1)
        task = await row(conn, "SELECT dispatch_lane, target_client_id FROM monitoring_collect_tasks WHERE id = %s",
                         high)
        assert (task["dispatch_lane"], task["target_client_id"]) == ("normal", None)
        assert await requests.time_out(conn, stale) is None  # timed out already
        assert await requests.time_out(conn, busy) is None and await requests.time_out(conn, fresh) is None
        assert [await _status(conn, r) for r in (stale, busy, fresh)] == ["timed_out", "running", "accepted"]


async def test_warn_no_dispatch_once(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn)
        old = await insert_request(conn, w, client_id=w.clients[0], created_ago=120)
        await insert_request(conn, w, client_id=w.clients[0], created_ago=1)
        await insert_request(conn, w, client_id=w.clients[0], created_ago=120, dispatched=1)
        warned = await requests.warn_no_dispatch(conn, warn_s=60)
        assert [(x.id, x.tenant_id, x.target_client_id) for x in warned] == [(old, w.tenant_id, w.clients[0])]
        assert await requests.warn_no_dispatch(conn, warn_s=60) == []
