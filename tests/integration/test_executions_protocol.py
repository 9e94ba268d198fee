"""The `Executions` protocol (libs/tasks/execution_paths.py) on real Postgres, the same test run against both
implementations: each legal move answers its value, each illegal one a typed outcome (`Stale`, `NotFound`, `Fenced`)
instead of a silent no-op."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.auth import hash_token
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.domain.lanes import lane_weight
from libs.leader import is_fenced
from libs.tasks import execution_paths
from libs.tasks.execution_paths import Executions
from libs.tasks.outcomes import Fenced, NotFound, Stale
from libs.tasks.records import (
    EndedExecution,
    ExecutionEnd,
    Extended,
    Leased,
    LeaseState,
    Offer,
    ResultClaim,
)
from libs.tasks.transitions import Yielded, finish_business_task, retry_business_task, yield_business_task
from tests.support.desktop import dispatch_execution, insert_ready_task

# Where each path keeps the lease's expiry: the execution row, the business row.
_EXPIRE = {
    "desktop_tasks": "UPDATE desktop_tasks SET lease_expires_at = now() - interval '1 minute' WHERE id = %s",
    "legacy": "UPDATE monitoring_collect_tasks SET lease_expires_at = now() - interval '1 minute' "
              "WHERE legacy_lease_id = %s",
}
PATHS = pytest.mark.parametrize("path", execution_paths.PATHS, ids=lambda p: p.owner)
TOKEN = "lt1.1.a-token-of-epoch-one"


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=1, brands=1, questions=3, clients=1, due=False)


async def queued_work(conn: Conn, path: Executions, seed: dict[str, Any]) -> tuple[uuid.UUID, int, uuid.UUID]:
    """Work queued for the seeded client on `path`, as the coordinator writes it: (task id, tenant, client)."""
    tenant = seed["tenants"][0]
    client = uuid.UUID(tenant["clients"][0]["client_id"])
    platform = seed["platforms"][0]["ai_platform_id"]
    if path.owner == "desktop_tasks":
        execution = await dispatch_execution(conn, tenant=tenant, platform_id=platform, client_id=client)
        return execution["task_id"], tenant["tenant_id"], client
    task_id = await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=0, platform_id=platform)
    await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = 'legacy' WHERE id = %s", (task_id,))
    cur = await conn.execute("SELECT * FROM monitoring_collect_tasks WHERE id = %s", (task_id,))
    task = await cur.fetchone()
    assert task is not None
    lease_id = uuid.uuid4()
    async with conn.transaction():
        await path.create(conn, [{
            "id": lease_id, "monitor_task_id": task_id, "tenant_id": task["tenant_id"],
            "workspace_id": task["workspace_id"], "target_client_id": client, "ai_platform_id": task["ai_platform_id"],
            "brand_id": task["brand_id"], "question_id": task["question_id"], "business_date": task["business_date"],
            "lane": "normal", "lane_weight": lane_weight("monitor", "normal"), "priority": 100,
            "interrupt_generation": 0, "collect_request_id": None, "enqueued_at": task["enqueued_at"]}],
            ts=datetime.now(UTC))
    return lease_id, tenant["tenant_id"], client


async def leased_work(conn: Conn, path: Executions, seed: dict[str, Any]) -> tuple[uuid.UUID, int, uuid.UUID]:
    """Queued work picked and leased at epoch 1 with TOKEN."""
    task_id, tenant_id, client = await queued_work(conn, path, seed)
    picked = await (await path.pick(conn, client_id=client, tenant_id=tenant_id, max_tasks=5)).result()
    assert [o.id for o in picked] == [task_id] and all(isinstance(o, Offer) for o in picked)
    assert picked[0].execution_owner == path.owner
    leased = await (await path.mark_leased(conn, task_id, epoch=1, token_hash=hash_token(TOKEN), ttl_s=60)).result()
    assert isinstance(leased, Leased)
    return task_id, tenant_id, client


@PATHS
async def test_a_lease_taken_twice_is_stale(pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
                                            path: Executions) -> None:
    async with pool.connection() as conn:
        task_id, _, _ = await leased_work(conn, path, seed)
        again = await (await path.mark_leased(conn, task_id, epoch=1, token_hash=hash_token(TOKEN), ttl_s=60)).result()
        assert again == Stale(task_id=task_id)
        never = uuid.uuid4()
        assert await (await path.mark_leased(conn, never, epoch=1, token_hash="h", ttl_s=60)).result() == Stale(
            task_id=never)


@PATHS
async def test_extend_is_fenced_by_token_epoch_and_holder(pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
                                                          path: Executions) -> None:
    async with pool.connection() as conn:
        task_id, tenant_id, client = await leased_work(conn, path, seed)
        args: dict[str, Any] = {"tenant_id": tenant_id, "client_id": client, "epoch": 1,
                                "token_hash": hash_token(TOKEN), "ttl_s": 60, "phase": "WAITING"}
        extended = await path.extend(conn, task_id, **args)
        assert isinstance(extended, Extended) and extended.execution_owner == path.owner
        assert await path.extend(conn, task_id, **{**args, "token_hash": hash_token("lt1.1.other")}) == Fenced(
            task_id=task_id)
        assert await path.extend(conn, task_id, **{**args, "epoch": 2}) == Fenced(task_id=task_id)
        assert await path.extend(conn, task_id, **{**args, "client_id": uuid.uuid4()}) == Fenced(task_id=task_id)
        # the interface over both paths finds it whichever path holds it, and is fenced the same way
        assert isinstance(await execution_paths.extend(conn, task_id, **args), Extended)
        assert isinstance(await execution_paths.extend(conn, task_id, **{**args, "epoch": 0}), Fenced)


@PATHS
async def test_ending_an_ended_execution_is_stale_and_an_unknown_one_not_found(
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any], path: Executions) -> None:
    async with pool.connection() as conn:
        task_id, tenant_id, client = await leased_work(conn, path, seed)
        wrong_epoch = await execution_paths.end(conn, ExecutionEnd(task_id=task_id, outcome="aborted", lease_epoch=0))
        assert wrong_epoch == Stale(task_id=task_id, status="in_progress")  # a fenced-off holder cannot end it
        ended = await execution_paths.end(conn, ExecutionEnd(task_id=task_id, outcome="aborted", lease_epoch=1,
                                                             reason="lease_expired"))
        assert isinstance(ended, EndedExecution) and ended.previous_status == "in_progress"
        assert ended.client_id == client and ended.tenant_id == tenant_id
        again = await execution_paths.end(conn, ExecutionEnd(task_id=task_id, outcome="succeeded"))
        assert again == Stale(task_id=task_id, status="aborted")
        assert await path.end_one(conn, ExecutionEnd(task_id=task_id, outcome="succeeded")) is None
        nobody = uuid.uuid4()
        assert await execution_paths.end(conn, ExecutionEnd(task_id=nobody, outcome="aborted")) == NotFound(
            task_id=nobody)
        # the ended lease is fenced off: extend, and the batch form ends nothing
        assert isinstance(await path.extend(conn, task_id, tenant_id=tenant_id, client_id=client, epoch=1,
                                            token_hash=hash_token(TOKEN), ttl_s=60, phase=None), Fenced)
        assert await execution_paths.end_many(conn, [ExecutionEnd(task_id=task_id, outcome="failed")]) == []


@PATHS
async def test_a_result_claim_at_another_epoch_is_stale(pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
                                                        path: Executions) -> None:
    async with pool.connection() as conn:
        task_id, tenant_id, _ = await leased_work(conn, path, seed)
        assert await path.claim_result(conn, task_id, tenant_id=tenant_id, epoch=0, digest="d1") == Stale(
            task_id=task_id)
        assert await path.claim_result(conn, task_id, tenant_id=tenant_id, epoch=1, digest="d1") == ResultClaim(
            previous=None, received=False)
        assert await path.claim_result(conn, task_id, tenant_id=tenant_id, epoch=1, digest="d2") == ResultClaim(
            previous="d1", received=False)
        assert await path.release_result_claim(conn, task_id, tenant_id=tenant_id, epoch=1, digest="d2") == Stale(
            task_id=task_id)  # the claim is d1's
        assert await path.mark_result_received(conn, task_id, tenant_id=tenant_id, epoch=0) == Stale(task_id=task_id)


@PATHS
async def test_lease_state_and_reconcile_locks_answer_not_found_or_stale(
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any], path: Executions) -> None:
    async with pool.connection() as conn:
        task_id, tenant_id, _ = await leased_work(conn, path, seed)
        state = await execution_paths.lease_state(conn, task_id, tenant_id=tenant_id)
        assert isinstance(state, LeaseState) and state.execution_owner == path.owner and state.status == "in_progress"
        assert await path.lease_state(conn, task_id, tenant_id=tenant_id + 1000) == NotFound(task_id=task_id)
        nobody = uuid.uuid4()
        assert await execution_paths.lease_state(conn, nobody, tenant_id=tenant_id) == NotFound(task_id=nobody)
        # a live lease is not expired, nor unknown: the reconciler's moves refuse it
        assert await execution_paths.lock_expired(conn, task_id) == Stale(task_id=task_id)
        assert await execution_paths.lock_unknown(conn, task_id) == Stale(task_id=task_id)
        assert await execution_paths.requeue_unknown(conn, task_id, lease_epoch=1) == Stale(task_id=task_id)
        assert task_id not in await execution_paths.expired(conn, limit=10)


@PATHS
async def test_an_expired_lease_is_locked_once_then_stale_once_ended(
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any], path: Executions) -> None:
    async with pool.connection() as conn:
        task_id, _, _ = await leased_work(conn, path, seed)
        await conn.execute(_EXPIRE[path.owner], (task_id,))
        assert task_id in await execution_paths.expired(conn, limit=10)
        async with conn.transaction():
            lease = await execution_paths.lock_expired(conn, task_id)
            assert not isinstance(lease, Stale) and lease.id == task_id and lease.lease_epoch == 1
            assert isinstance(await execution_paths.end(conn, ExecutionEnd(task_id=task_id, outcome="expired",
                                                                           lease_epoch=1)), EndedExecution)
        assert await execution_paths.lock_expired(conn, task_id) == Stale(task_id=task_id)


@PATHS
async def test_a_deposed_leaders_dispatch_is_refused_by_the_fence_on_either_path(
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any], path: Executions) -> None:
    """The database refuses it (SQLSTATE MLF01): an exception, not an outcome, since its transaction is aborted."""
    tenant = seed["tenants"][0]
    client = uuid.UUID(tenant["clients"][0]["client_id"])
    platform = seed["platforms"][0]["ai_platform_id"]
    async with pool.connection() as conn:
        task_id = await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=1, platform_id=platform)
        await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = %s WHERE id = %s",
                           (path.owner, task_id))
        cur = await conn.execute("SELECT * FROM monitoring_collect_tasks WHERE id = %s", (task_id,))
        task = await cur.fetchone()
        assert task is not None
        row = {"id": uuid.uuid4(), "monitor_task_id": task_id, "tenant_id": task["tenant_id"],
               "workspace_id": task["workspace_id"], "target_client_id": client, "ai_platform_id": platform,
               "brand_id": task["brand_id"], "question_id": task["question_id"],
               "business_date": task["business_date"], "lane": "normal",
               "lane_weight": lane_weight("monitor", "normal"), "priority": 100, "interrupt_generation": 0,
               "collect_request_id": None,
               "enqueued_at": task["enqueued_at"], "source": "daily_schedule", "scheduler_group_key": "qid:1",
               "execution_owner": path.owner}
        with pytest.raises(psycopg.Error) as refused:
            async with conn.transaction():
                # a session of a coordinator whose term is no longer the stored one (migration 024)
                await conn.execute("SELECT set_config('monitoring.leader_role', 'dispatch-coordinator', true), "
                                   "set_config('monitoring.leader_term', '999999', true)")
                await execution_paths.dispatch(conn, [row], ts=datetime.now(UTC))
        assert is_fenced(refused.value)
        assert await execution_paths.lease_state(conn, row["id"], tenant_id=task["tenant_id"]) == NotFound(
            task_id=row["id"])


async def test_the_business_consequence_of_an_end_is_stale_on_a_finished_task(
        pool: AsyncConnectionPool[Conn], seed: dict[str, Any]) -> None:
    tenant = seed["tenants"][0]
    async with pool.connection() as conn:
        task_id = await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=2,
                                          platform_id=seed["platforms"][0]["ai_platform_id"])
        assert await yield_business_task(conn, task_id) == Yielded(monitor_task_id=task_id)
        assert await retry_business_task(conn, task_id, max_attempts=5, error="x") == "pending"
        assert await finish_business_task(conn, task_id, status="completed")
        assert await yield_business_task(conn, task_id) == Stale()
        assert await retry_business_task(conn, task_id, max_attempts=5, error="x") == Stale()
