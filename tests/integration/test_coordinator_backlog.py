"""The coordinator's backlog gauges (maintenance.observe_backlog) against real Postgres: what counts as ready, and
that the whole-backlog statements look the active executions up in a hashed set rather than once per task."""

from __future__ import annotations

from datetime import date
from typing import Any

import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.domain.shard import ingest_shard_key
from libs.tasks import backlog_reads
from libs.telemetry import metrics
from services.dispatch_coordinator.maintenance import BacklogCensus, observe_backlog
from tests.support.desktop import dispatch_execution

_PENDING = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner, dispatch_after, enqueued_at)
VALUES (%(tenant_id)s, %(workspace_id)s, %(brand_id)s, %(question_id)s, %(platform_id)s, %(day)s, 'pending',
    100, %(lane)s, %(shard_key)s, %(owner)s, now() + make_interval(secs => %(due_in_s)s),
    now() - make_interval(secs => %(age_s)s))
"""


async def _pending(conn: Conn, tenant: dict[str, Any], platform_id: int, question_index: int, *, lane: str = "normal",
                   owner: str = "desktop_tasks", due_in_s: float = -1, age_s: float = 60) -> None:
    brand = tenant["brands"][0]
    day = date.today()
    await conn.execute(_PENDING, {
        "tenant_id": tenant["tenant_id"], "workspace_id": tenant["workspace_id"], "brand_id": brand["brand_id"],
        "question_id": brand["question_ids"][question_index], "platform_id": platform_id, "day": day, "lane": lane,
        "shard_key": ingest_shard_key(tenant["tenant_id"], brand["brand_id"], day), "owner": owner,
        "due_in_s": due_in_s, "age_s": age_s})


async def test_backlog_counts_ready_tasks_only(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=2, questions=6, clients=1, platforms=("openai",), due=False)
        first, second = seed["tenants"]
        platform = seed["platforms"][0]["ai_platform_id"]
        client = first["clients"][0]["client_id"]
        await _pending(conn, first, platform, 0, age_s=600)
        await _pending(conn, first, platform, 1, lane="normal_boosted")
        await _pending(conn, first, platform, 2, lane="high", age_s=30, due_in_s=-30)  # promoted 30 s ago
        await _pending(conn, first, platform, 3, owner="legacy")  # the other execution path: ready all the same
        await _pending(conn, first, platform, 4, due_in_s=3600)  # not due yet
        await dispatch_execution(conn, tenant=first, platform_id=platform, client_id=client, question_index=5)
        await _pending(conn, second, platform, 0)
        backlog = await observe_backlog(conn)
    # The task with a queued execution is not ready, nor the not-yet-due one; a legacy-path task is (the coordinator
    # dispatches both paths).
    assert (backlog.normal, backlog.high, backlog.retry) == (4, 1, 0)
    assert backlog.tenant_normal == {first["tenant_id"]: 3, second["tenant_id"]: 1}
    assert 25_000 < backlog.high_oldest_ms < 60_000


def _labels_written(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The label values the per-tenant and per-client gauges are written or removed at from now on."""
    written: list[str] = []
    for gauge in (metrics.tenant_monitor_normal_backlog, metrics.desktop_client_monitor_queue_depth):
        labels, remove = gauge.labels, gauge.remove

        def counted_labels(labels: Any = labels, **kwargs: str) -> Any:
            written.extend(kwargs.values())
            return labels(**kwargs)

        def counted_remove(*values: str, remove: Any = remove) -> None:
            written.extend(values)
            remove(*values)

        monkeypatch.setattr(gauge, "labels", counted_labels)
        monkeypatch.setattr(gauge, "remove", counted_remove)
    return written


async def test_a_tick_writes_the_labels_that_changed_and_removes_the_vanished(
        pool: AsyncConnectionPool[Conn], monkeypatch: pytest.MonkeyPatch) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=3, questions=2, clients=1, platforms=("openai",), due=False)
        tenants = seed["tenants"]
        platform = seed["platforms"][0]["ai_platform_id"]
        for tenant in tenants:
            await _pending(conn, tenant, platform, 0)
        await conn.execute("UPDATE desktop_clients SET online = true")
        census = BacklogCensus()
        await observe_backlog(conn, census)
        ids = [str(t["tenant_id"]) for t in tenants]
        clients = [str(t["clients"][0]["client_id"]) for t in tenants]
        for tenant_id in ids:
            assert REGISTRY.get_sample_value("tenant_monitor_normal_backlog", {"tenant_id": tenant_id}) == 1
        for client in clients:  # online without queued work: zero, not absent
            assert REGISTRY.get_sample_value("desktop_client_monitor_queue_depth", {"client_id": client}) == 0
        written = _labels_written(monkeypatch)
        await observe_backlog(conn, census)
        assert written == []  # nothing changed: no label written
        # The first tenant's task done, the second's client given queued work, the third's too but gone offline.
        await conn.execute("UPDATE monitoring_collect_tasks SET status = 'completed' WHERE tenant_id = %s",
                           (tenants[0]["tenant_id"],))
        for tenant in tenants[1:]:
            await dispatch_execution(conn, tenant=tenant, platform_id=platform,
                                     client_id=tenant["clients"][0]["client_id"], question_index=1)
        await conn.execute("UPDATE desktop_clients SET online = false WHERE id = %s",
                           (tenants[2]["clients"][0]["client_id"],))
        await observe_backlog(conn, census)
    assert sorted(written) == sorted([ids[0], clients[1], clients[2]])
    assert REGISTRY.get_sample_value("tenant_monitor_normal_backlog", {"tenant_id": ids[0]}) is None  # removed
    assert [REGISTRY.get_sample_value("tenant_monitor_normal_backlog", {"tenant_id": t}) for t in ids[1:]] == [1, 1]
    assert [REGISTRY.get_sample_value("desktop_client_monitor_queue_depth", {"client_id": c}) for c in clients] == [
        0, 1, None]


async def test_a_promoted_task_ages_in_the_high_lane_from_its_promotion(pool: AsyncConnectionPool[Conn]) -> None:
    """A scheduled task created two hours ago and promoted by a click 10 s ago has waited 10 s as high work."""
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, questions=1, clients=1, platforms=("openai",), due=False)
        platform = seed["platforms"][0]["ai_platform_id"]
        await _pending(conn, seed["tenants"][0], platform, 0, lane="high", age_s=7200, due_in_s=-10)
        backlog = await observe_backlog(conn)
    assert backlog.high == 1
    assert 9_000 < backlog.high_oldest_ms < 30_000


async def test_whole_backlog_statements_hash_the_active_executions(pool: AsyncConnectionPool[Conn]) -> None:
    """One lookup per task in a hashed set, not a subquery per task (110-120 ms over a 10,000-task backlog), even
    on tables the planner has no statistics for yet."""
    async with pool.connection() as conn:
        for statement in (backlog_reads._BACKLOG, backlog_reads._NORMAL_WAIT_P99, backlog_reads._AGING_READY_COUNT):
            cur = await conn.execute(f"EXPLAIN {statement}")
            plan = "\n".join(str(r["QUERY PLAN"]) for r in await cur.fetchall())
            assert "hashed SubPlan" in plan, plan
