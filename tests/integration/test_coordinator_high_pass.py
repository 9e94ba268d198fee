"""The coordinator's high-only pass (collect-now latency) and full passes yielding to it, against real Postgres."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings, load_settings, set_setting
from libs.tasks import dispatch_reads
from services.dispatch_coordinator.dispatcher import (
    CANDIDATE_CHUNK_ROWS,
    MAX_PREEMPTIONS,
    Dispatcher,
    limits_from,
    read_snapshot,
)
from services.dispatch_coordinator.scanner import scan_once
from tests.integration.test_coordinator_load import collect_now
from tests.support.dispatch_fleet import Seeded, seed_fleet
from tests.support.wait import eventually


async def _prepare(pool: AsyncConnectionPool[Conn], **settings: Any) -> Seeded:
    async with pool.connection() as conn:
        seeded = await seed_fleet(conn, plans_per_tenant=[30], clients_per_tenant=2, max_queue_depth=100)
        for key, value in settings.items():
            await set_setting(conn, key, value)
        await conn.execute("INSERT INTO platform_settings (ai_platform_id, max_concurrent) SELECT id, 100 "
                           "FROM ai_platforms ON CONFLICT (ai_platform_id) DO UPDATE SET max_concurrent = 100")
    await scan_once(pool, batch_size=1000, rollout_percentage=100)
    return seeded


async def _settings(pool: AsyncConnectionPool[Conn], **changes: Any) -> DispatchSettings:
    async with pool.connection() as conn:
        for key, value in changes.items():
            await set_setting(conn, key, value)
        return await load_settings(conn)


async def _rows(pool: AsyncConnectionPool[Conn], sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params or {})
        return list(await cur.fetchall())


async def _two_tasks_for_one_client(pool: AsyncConnectionPool[Conn]) -> tuple[Any, uuid.UUID, list[Any]]:
    """A seeded fleet with room in every budget; a tenant, one of its clients (room for 10) and two pending tasks."""
    seeded = await _prepare(pool, cluster_dispatch_per_minute=1000, tenant_dispatch_per_minute=1000)
    picked = await _rows(pool, "SELECT id FROM monitoring_collect_tasks WHERE status = 'pending' ORDER BY id LIMIT 2")
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 10")
    return seeded.tenants[0], seeded.tenants[0].clients[0], picked


async def _lanes(pool: AsyncConnectionPool[Conn]) -> dict[str, int]:
    rows = await _rows(pool, "SELECT lane, count(*) AS n FROM desktop_tasks GROUP BY lane")
    return {r["lane"]: r["n"] for r in rows}


async def test_high_only_pass_keeps_budget_and_platform_rules_and_writes_no_normal(
        pool: AsyncConnectionPool[Conn]) -> None:
    seeded = await _prepare(pool, cluster_dispatch_per_minute=4, tenant_dispatch_per_minute=100,
                            high_reserved_share=0.0, budget_window_seconds=3600)
    tenant = seeded.tenants[0]
    dispatcher = Dispatcher(pool)
    settings = await _settings(pool)
    assert (await dispatcher.run_pass(settings)).dispatched == 4  # the window's budget, all normal
    async with pool.connection() as conn:  # leased: the collect-now below interrupts them, no budget refund
        await conn.execute("UPDATE desktop_tasks SET status = 'in_progress', lease_epoch = 1")
    platform = seeded.platforms["openai"]
    picked = await _rows(pool, "SELECT t.id FROM monitoring_collect_tasks t WHERE t.status = 'pending' "
                               "AND t.ai_platform_id = %(p)s AND NOT EXISTS (SELECT 1 FROM desktop_tasks d "
                               "WHERE d.monitor_task_id = t.id) ORDER BY t.id LIMIT 3", {"p": platform})
    client = tenant.clients[0]
    async with pool.connection() as conn:
        request_id, _ = await collect_now(conn, tenant_id=tenant.tenant_id, client_id=client,
                                          task_ids=[r["id"] for r in picked])
    # Cluster budget spent: high waits too.
    assert (await dispatcher.run_high_pass(settings)).dispatched == 0
    # Budget room for 2 now, but the tenant's platform account is full: nothing goes.
    settings = await _settings(pool, cluster_dispatch_per_minute=6)
    active = await _rows(pool, "SELECT count(*) AS n FROM desktop_tasks WHERE tenant_id = %(t)s "
                               "AND ai_platform_id = %(p)s AND status IN ('queued', 'in_progress')",
                         {"t": tenant.tenant_id, "p": platform})
    async with pool.connection() as conn:
        await conn.execute("UPDATE platform_settings SET max_concurrent = %(n)s WHERE ai_platform_id = %(p)s",
                           {"n": active[0]["n"], "p": platform})
    assert (await dispatcher.run_high_pass(settings)).dispatched == 0
    async with pool.connection() as conn:
        await conn.execute("UPDATE platform_settings SET max_concurrent = 100")
    # The client runs as many as it may (2 in progress): it takes no more, high or not.
    assert (await dispatcher.run_high_pass(settings)).dispatched == 0
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 10")
    outcome = await dispatcher.run_high_pass(settings)
    assert outcome.dispatched == outcome.high_dispatched == 2  # what the budget leaves
    assert await _lanes(pool) == {"normal": 4, "high": 2}
    settings = await _settings(pool, cluster_dispatch_per_minute=100)
    assert (await dispatcher.run_high_pass(settings)).dispatched == 1
    assert await _lanes(pool) == {"normal": 4, "high": 3}  # never any normal work
    high = await _rows(pool, "SELECT target_client_id, interrupt_generation, source, collect_request_id "
                             "FROM desktop_tasks WHERE lane = 'high'")
    assert {(r["target_client_id"], r["source"], r["collect_request_id"]) for r in high} == {
        (client, "collect_now", request_id)}
    outbox = await _rows(pool, "SELECT routing_key, priority FROM outbox WHERE routing_key LIKE 'monitor.high.%%' "
                               "OR routing_key LIKE 'monitor.normal.%%'")
    assert sorted((r["routing_key"].split(".")[1], r["priority"]) for r in outbox) == (
        [("high", 1)] * 3 + [("normal", 0)] * 4)
    request = await _rows(pool, "SELECT dispatched_task_count, status, first_dispatched_at "
                                "FROM monitoring_collect_requests WHERE id = %(r)s", {"r": request_id})
    assert request[0]["dispatched_task_count"] == 3 and request[0]["status"] == "dispatching"
    assert request[0]["first_dispatched_at"] is not None


async def test_full_pass_yields_to_waiting_high_work_a_bounded_number_of_times(
        pool: AsyncConnectionPool[Conn]) -> None:
    await _prepare(pool, cluster_dispatch_per_minute=1000, tenant_dispatch_per_minute=1000)
    dispatcher = Dispatcher(pool)
    dispatcher.high_waiting = lambda: True
    settings = await _settings(pool)
    for _ in range(MAX_PREEMPTIONS):
        outcome = await dispatcher.run_pass(settings)
        assert outcome.preempted and outcome.dispatched == 0
    assert await _lanes(pool) == {}  # rolled back before any write
    outcome = await dispatcher.run_pass(settings)  # no starvation: this one writes
    assert not outcome.preempted and outcome.dispatched > 0
    dispatcher.high_waiting = lambda: False
    assert not (await dispatcher.run_pass(settings)).preempted


async def test_a_click_during_any_read_or_the_claim_of_a_full_pass_makes_it_yield_before_writing(
        pool: AsyncConnectionPool[Conn]) -> None:
    """The full pass checks for waiting high work after its snapshot, its candidates, its plan and its claim:
    whichever of them the click arrives during, nothing is written and the pass reports it yielded."""
    await _prepare(pool, cluster_dispatch_per_minute=1000, tenant_dispatch_per_minute=1000)
    settings = await _settings(pool)
    for checks_before_click in range(4):  # snapshot, candidates, plan, claim
        dispatcher = Dispatcher(pool)
        calls = {"n": 0}

        def high_waiting(calls: dict[str, int] = calls, quiet: int = checks_before_click) -> bool:
            calls["n"] += 1
            return calls["n"] > quiet

        dispatcher.high_waiting = high_waiting
        outcome = await dispatcher.run_pass(settings)
        assert outcome.preempted and outcome.dispatched == 0, checks_before_click
        assert calls["n"] == checks_before_click + 1
        assert await _lanes(pool) == {}


async def test_high_pass_skips_a_task_being_promoted_and_waits_for_a_client_being_changed(
        pool: AsyncConnectionPool[Conn], database_url: str) -> None:
    """The high pass reads under its locks: a high task another transaction holds is left to a later pass
    (never dispatched from a stale read), and a client whose row a collect-now is changing is waited for,
    so the generation the pass writes is the committed one."""
    import asyncio

    from libs.db.pool import connect

    tenant, client, picked = await _two_tasks_for_one_client(pool)
    async with pool.connection() as conn:
        await collect_now(conn, tenant_id=tenant.tenant_id, client_id=client, task_ids=[r["id"] for r in picked])
    dispatcher = Dispatcher(pool)
    settings = await _settings(pool)
    other = await connect(database_url, autocommit=False)
    try:
        # Another transaction holds the first task's row (as a collect-now promoting it would).
        await other.execute("SELECT 1 FROM monitoring_collect_tasks WHERE id = %(id)s FOR UPDATE",
                            {"id": picked[0]["id"]})
        outcome = await dispatcher.run_high_pass(settings)
        assert outcome.high_dispatched == 1
        assert [r["monitor_task_id"] for r in await _rows(pool, "SELECT monitor_task_id FROM desktop_tasks")] == [
            picked[1]["id"]]
        await other.rollback()
        # A collect-now on the client is mid-transaction (generation bumped, not committed): the pass waits
        # for it and then dispatches with the committed generation.
        await other.execute("UPDATE desktop_clients SET interrupt_generation = interrupt_generation + 1 "
                            "WHERE id = %(c)s", {"c": client})
        await other.execute("UPDATE monitoring_collect_tasks SET interrupt_generation = interrupt_generation + 1 "
                            "WHERE id = %(id)s", {"id": picked[0]["id"]})
        waiting = asyncio.create_task(dispatcher.run_high_pass(settings))

        async def pass_waits_on_a_lock() -> bool:
            found = await _rows(pool, "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                                      "AND wait_event_type = 'Lock' AND query LIKE '%%FOR SHARE OF c%%'")
            return bool(found)

        await eventually(pass_waits_on_a_lock, message="the high pass waits for the client row")
        assert not waiting.done()
        await other.commit()
        assert (await asyncio.wait_for(waiting, 10)).high_dispatched == 1
    finally:
        await other.close()
    rows = await _rows(pool, "SELECT d.monitor_task_id, d.interrupt_generation AS sent, c.interrupt_generation AS now "
                             "FROM desktop_tasks d JOIN desktop_clients c ON c.id = d.target_client_id "
                             "WHERE d.monitor_task_id = %(id)s", {"id": picked[0]["id"]})
    assert len(rows) == 1 and rows[0]["sent"] == rows[0]["now"]


async def test_high_pass_publishes_its_own_task_available_and_leaves_it_to_the_pumps_when_its_broker_is_away(
        pool: AsyncConnectionPool[Conn], settings, topology, amqp, database_url: str) -> None:
    """With a relay the pass claims its high TaskAvailable in the writing transaction and publishes it right
    after the commit (no pump involved, no NOTIFY); with the relay's broker away it writes them for the pumps
    and wakes them."""
    import msgspec

    from libs.contracts.wire import TaskAvailable
    from libs.db.pool import connect
    from libs.outbox import NOTIFY_CHANNEL
    from libs.outbox.relay import AmqpPublisher, OutboxRelay
    from tests.support.capture import capture

    tenant, client, picked = await _two_tasks_for_one_client(pool)
    async with pool.connection() as conn:
        await collect_now(conn, tenant_id=tenant.tenant_id, client_id=client, task_ids=[picked[0]["id"]])
    publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="relay-under-test")
    await publisher.start()
    listener = await connect(database_url, name="relay-notify-test")
    try:
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        dispatcher = Dispatcher(pool, relay=OutboxRelay(pool, publisher, claimed_by="coordinator-relay"))
        async with capture(amqp, topology.dispatch_exchange, f"#.monitor.high.{client}") as cap:
            assert (await dispatcher.run_high_pass(await _settings(pool))).high_dispatched == 1
            await eventually(lambda: cap.messages, message="the high TaskAvailable on the broker")
            event = msgspec.json.decode(cap.messages[0].body, type=TaskAvailable)
            assert (event.monitor_task_id, event.lane, event.target_client_id) == (picked[0]["id"], "high", client)
        outbox = await _rows(pool, "SELECT status, claimed_by, attempts FROM outbox")
        assert [(r["status"], r["claimed_by"], r["attempts"]) for r in outbox] == [
            ("published", "coordinator-relay", 1)]
        assert [n async for n in listener.notifies(timeout=0.3)] == []  # no pump was woken

        await publisher.close()  # the relay's broker goes away: the next pass leaves its event to the pumps
        async with pool.connection() as conn:
            await collect_now(conn, tenant_id=tenant.tenant_id, client_id=client, task_ids=[picked[1]["id"]])
        assert (await dispatcher.run_high_pass(await _settings(pool))).high_dispatched == 1
        outbox = await _rows(pool, "SELECT status, claimed_by FROM outbox ORDER BY id")
        assert [(r["status"], r["claimed_by"]) for r in outbox] == [
            ("published", "coordinator-relay"), ("queued", None)]
        assert [n.channel async for n in listener.notifies(timeout=1, stop_after=1)] == [NOTIFY_CHANNEL]
    finally:
        await publisher.close()
        await listener.close()


class _CountedPool:
    """The pool, its connections counting the candidate rows the passes read (HIGH_CANDIDATES, PAIR_CANDIDATES)."""

    def __init__(self, pool: AsyncConnectionPool[Conn]) -> None:
        self.pool = pool
        self.rows = 0

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        async with self.pool.connection() as conn:
            yield _CountedConn(conn, self)


class _CountedConn:
    def __init__(self, conn: Conn, counter: _CountedPool) -> None:
        self.conn = conn
        self.counter = counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        cur = await self.conn.execute(query, params, **kwargs)
        candidates = (dispatch_reads._HIGH_CANDIDATES, dispatch_reads._PAIR_CANDIDATES)
        return _CountedCursor(cur, self.counter) if query in candidates else cur


class _CountedCursor:
    def __init__(self, cur: Any, counter: _CountedPool) -> None:
        self.cur = cur
        self.counter = counter

    async def fetchall(self) -> list[Any]:
        rows: list[Any] = await self.cur.fetchall()
        self.counter.rows += len(rows)
        return rows


async def test_a_full_pass_reads_its_candidates_in_chunks_and_yields_between_them(
        pool: AsyncConnectionPool[Conn]) -> None:
    """Chunked, the candidate read finds exactly what one read finds; a click arriving during a chunk makes the
    pass yield before the next one (it waits for one chunk, not for every pair's read)."""
    await _prepare(pool, cluster_dispatch_per_minute=1000, tenant_dispatch_per_minute=1000)
    settings = await _settings(pool)
    limits = limits_from(settings, slowdown=False)
    found: list[set[int]] = []
    for chunk_rows in (CANDIDATE_CHUNK_ROWS, 1):
        dispatcher = Dispatcher(pool, candidate_chunk_rows=chunk_rows)
        async with pool.connection() as conn, conn.transaction():
            await dispatcher.pending.refresh(conn)
            snap = await read_snapshot(conn, settings)
            candidates = await dispatcher.read_candidates(conn, snap, limits, settings)
        found.append({c.id for lane in candidates.values() for c in lane})
    assert len(found[0]) > 3 and found[0] == found[1]

    # Chunks of one row: the second check is before the second chunk.
    counted = _CountedPool(pool)
    dispatcher = Dispatcher(counted, candidate_chunk_rows=1)  # type: ignore[arg-type]
    calls = {"n": 0}

    def high_waiting() -> bool:
        calls["n"] += 1
        return calls["n"] > 1  # the click arrives during the first chunk

    dispatcher.high_waiting = high_waiting
    outcome = await dispatcher.run_pass(settings)
    assert outcome.preempted and outcome.dispatched == 0 and calls["n"] == 2
    assert counted.rows < len(found[0])  # the first chunk only (in one read, every candidate before the check)
    assert await _lanes(pool) == {}
