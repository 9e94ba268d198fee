"""Push-lease at dispatch (libs/tasks/push_leases.py) against real Postgres: the pass that creates a push client's
executions leases as many as the client has free slots (the rows the lease call would have written: in_progress,
epoch 1, the derived token's hash, an open attempt, `task.leased`), the events carry the lease but never the token,
a pull client's stay queued, the hub's replay gives back the same token, and an unanswered push lease expires and is
requeued by the reconciler's expired-lease job as any other."""

from __future__ import annotations

import json
import uuid
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.auth import hash_token
from libs.db.pool import Conn
from libs.dispatch_settings import load_settings, set_setting
from libs.tasks import push_leases
from libs.tasks.push_leases import PushLeaseIssuer
from services.dispatch_coordinator.dispatcher import Dispatcher
from services.dispatch_coordinator.scanner import scan_once
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.runner import run_job
from tests.support.dispatch_fleet import seed_fleet

KEY = b"integration-push-lease-key-0123456789"
TTL_S = 30


async def _rows(pool: AsyncConnectionPool[Conn], sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params or {})
        return list(await cur.fetchall())


async def _dispatched(pool: AsyncConnectionPool[Conn], *, issuer: PushLeaseIssuer | None) -> tuple[uuid.UUID,
                                                                                                    uuid.UUID]:
    """A tenant with a push client and a pull client (2 slots, a queue of 20 each), one full pass."""
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[12], clients_per_tenant=2, max_concurrent=2)
        for key, value in {"cluster_dispatch_per_minute": 1000, "tenant_dispatch_per_minute": 1000}.items():
            await set_setting(conn, key, value)
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 100 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 100")
        push, pull = seeded.tenants[0].clients
        await push_leases.record_capability(conn, {push: True, pull: False})
        settings = await load_settings(conn)
    await scan_once(pool, batch_size=1000, rollout_percentage=100)
    outcome = await Dispatcher(pool, push_leases=issuer).run_pass(settings)
    assert outcome.dispatched == 12
    return push, pull


async def test_a_push_clients_executions_are_leased_at_dispatch_up_to_its_free_slots(
        pool: AsyncConnectionPool[Conn]) -> None:
    issuer = PushLeaseIssuer(KEY, ttl_s=TTL_S)
    push, pull = await _dispatched(pool, issuer=issuer)
    rows = await _rows(pool, "SELECT id, target_client_id, status, lease_epoch, lease_token_hash, execution_phase, "
                             "extract(epoch FROM lease_expires_at - leased_at) AS ttl_s FROM desktop_tasks")
    leased = [r for r in rows if r["status"] == "in_progress"]
    assert {r["target_client_id"] for r in leased} == {push} and len(leased) == 2 == issuer.issued  # its 2 slots
    for r in leased:
        assert r["lease_epoch"] == 1 and r["execution_phase"] == "PREPARING"
        assert r["lease_token_hash"] == hash_token(push_leases.derive_token(KEY, r["id"], 1))
        assert round(float(r["ttl_s"])) == TTL_S
    queued = [r for r in rows if r["status"] == "queued"]
    assert len(queued) == 10 and all(r["lease_epoch"] == 0 and r["lease_token_hash"] is None for r in queued)
    assert any(r["target_client_id"] == push for r in queued)  # beyond its slots: queued, for a pull
    attempts = await _rows(pool, "SELECT task_id, client_id, lease_epoch, status FROM desktop_task_attempts")
    assert sorted((a["task_id"], a["client_id"], a["lease_epoch"], a["status"]) for a in attempts) == sorted(
        (r["id"], push, 1, "in_progress") for r in leased)
    # The events carry the lease (epoch, expiry, what the task runs) and never the token.
    events = [{"routing_key": e["routing_key"], "payload": json.loads(e["payload"]),
               "text": bytes(e["payload"]).decode()}
              for e in await _rows(pool, "SELECT routing_key, payload FROM outbox")]
    available = {e["payload"]["task_id"]: e["payload"] for e in events if e["payload"].get("type") == "task_available"}
    assert len(available) == 12
    with_lease = {i: p for i, p in available.items() if p.get("lease_epoch") is not None}
    assert set(with_lease) == {str(r["id"]) for r in leased}
    for p in with_lease.values():
        assert p["lease_epoch"] == 1 and p["lease_expires_at"] and p["question"]["text"] and p["brand"]["name"]
        assert p.get("lease_token") is None
    assert all(p.get("lease_epoch") is None for i, p in available.items() if i not in with_lease)
    for r in leased:
        assert all(push_leases.derive_token(KEY, r["id"], 1) not in e["text"] for e in events)
    assert sorted(e["payload"]["task_id"] for e in events if e["routing_key"] == "task.leased") == sorted(with_lease)
    # The hub's replay of the push client: the same two leases, with the token that fits their hash.
    async with pool.connection() as conn:
        replayed = await push_leases.replay(conn, [push, pull], key=KEY)
        assert await push_leases.replay(conn, [push], key=b"another key entirely, not the coordinator's") == []
    assert {p.event.task_id for p in replayed} == {r["id"] for r in leased}
    assert all(p.event.lease_token == push_leases.derive_token(KEY, p.event.task_id, 1) for p in replayed)
    assert all(p.target_client_id == push and p.event.question is not None for p in replayed)


async def test_without_an_issuer_every_execution_is_queued_for_a_pull(pool: AsyncConnectionPool[Conn]) -> None:
    push, _ = await _dispatched(pool, issuer=None)  # push-lease off in the coordinator: the client pulls
    rows = await _rows(pool, "SELECT status, count(*) AS n FROM desktop_tasks GROUP BY status")
    assert [(r["status"], r["n"]) for r in rows] == [("queued", 12)]
    async with pool.connection() as conn:
        assert await push_leases.replay(conn, [push], key=KEY) == []


async def test_an_unanswered_push_lease_expires_and_is_requeued(pool: AsyncConnectionPool[Conn]) -> None:
    push, _ = await _dispatched(pool, issuer=PushLeaseIssuer(KEY, ttl_s=TTL_S))
    leased = await _rows(pool, "SELECT id, monitor_task_id FROM desktop_tasks WHERE status = 'in_progress'")
    assert len(leased) == 2
    async with pool.connection() as conn:  # nobody extended it: its 30 s ran out
        await conn.execute("UPDATE desktop_tasks SET lease_expires_at = now() - interval '1 second' "
                           "WHERE id = %(id)s", {"id": leased[0]["id"]})
        result = await run_job(JOBS["expired_leases"], conn, ReconcilerConfig())
        assert result.fixed == 1
        # No longer live: a reconnect does not replay it.
        assert [p.event.task_id for p in await push_leases.replay(conn, [push], key=KEY)] == [leased[1]["id"]]
    execution = (await _rows(pool, "SELECT status FROM desktop_tasks WHERE id = %(id)s", {"id": leased[0]["id"]}))[0]
    attempt = (await _rows(pool, "SELECT status FROM desktop_task_attempts WHERE task_id = %(id)s",
                           {"id": leased[0]["id"]}))[0]
    business = (await _rows(pool, "SELECT status, dispatch_lane FROM monitoring_collect_tasks WHERE id = %(id)s",
                            {"id": leased[0]["monitor_task_id"]}))[0]
    assert execution["status"] == "aborted"  # as any expired lease (services/reconciler/jobs/expired_leases.py)
    assert attempt["status"] == "expired"
    assert business["status"] == "pending" and business["dispatch_lane"] == "retry"  # requeued for a client


async def test_the_high_pass_pushes_a_clicks_leases_and_marks_the_request_running(
        pool: AsyncConnectionPool[Conn]) -> None:
    """The collect-now path: the high pass's pipeline has not synced since its BEGIN when the leases are issued (a
    fetch without a sync there made the outbox writer refuse the pass: every click waited for a re-election)."""
    from tests.integration.test_coordinator_high_pass import _settings, _two_tasks_for_one_client
    from tests.integration.test_coordinator_load import collect_now

    tenant, client, picked = await _two_tasks_for_one_client(pool)
    async with pool.connection() as conn:
        await push_leases.record_capability(conn, {client: True})
        request_id, _ = await collect_now(conn, tenant_id=tenant.tenant_id, client_id=client,
                                          task_ids=[r["id"] for r in picked])
    outcome = await Dispatcher(pool, push_leases=PushLeaseIssuer(KEY, ttl_s=TTL_S)).run_high_pass(
        await _settings(pool))
    assert outcome.high_dispatched == 2
    rows = await _rows(pool, "SELECT id, status, lease_epoch, lease_token_hash FROM desktop_tasks")
    assert [(r["status"], r["lease_epoch"]) for r in rows] == [("in_progress", 1)] * 2
    assert all(r["lease_token_hash"] == hash_token(push_leases.derive_token(KEY, r["id"], 1)) for r in rows)
    request = (await _rows(pool, "SELECT status, dispatched_task_count FROM monitoring_collect_requests "
                                 "WHERE id = %(r)s", {"r": request_id}))[0]
    assert request["status"] == "running" and request["dispatched_task_count"] == 2  # leased, as a lease call marks
