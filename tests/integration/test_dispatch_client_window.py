"""A full pass reads the clients of the tenants its candidate windows reach, not the fleet (docs/architecture.md
"Full pass: clients of the window"), on real Postgres: over many tenants it reads a few of their clients, plans what a
pass over every client plans, and still dispatches a high candidate of a tenant outside its window; the
platform-health pauses come from the blocking clients alone (migration 070), whatever the tenant's pending work; and a
lane with work in one pair among hundreds reaches it in the first pass (the pending pairs per lane)."""

from __future__ import annotations

import json
import math
from typing import Any

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings, load_settings, set_setting
from libs.domain.dispatch import plan_pass
from libs.domain.lanes import CLICK_LANE, SCHEDULED_LANE, monitor_lane
from libs.domain.platform_health import BLOCKING_STATES, ClientHealth, paused_pairs
from libs.tasks import dispatch_reads
from services.dispatch_coordinator.dispatcher import Dispatcher, limits_from, read_snapshot
from tests.support.backlog import Tenants, load_outstanding, load_ready, load_tenants
from tests.support.explain import Plan, explaining_pool

TENANTS = 60
CLIENTS_PER_TENANT = 2
BATCH = 10  # a window of ~20 candidate rows: a few of the 180 pairs' tenants a pass
BOOSTED = monitor_lane(SCHEDULED_LANE.name).ages_into


async def _world(pool: AsyncConnectionPool[Conn], *, tenants: int = TENANTS, ready: int = 1_200) -> Tenants:
    async with pool.connection() as conn:
        loaded = await load_tenants(conn, tenants=tenants, clients_per_tenant=CLIENTS_PER_TENANT)
        await load_ready(conn, loaded, ready)
        await load_outstanding(conn, loaded, 1)  # clients with different loads: the least-loaded choice matters
        await conn.execute("UPDATE platform_settings SET max_concurrent = 1000")
        for key, value in {"dispatch_batch_size": BATCH, "cluster_dispatch_per_minute": 1_000_000,
                           "tenant_dispatch_per_minute": 1_000_000, "cluster_dispatch_per_minute_ceiling": 1_000_000,
                           "tenant_dispatch_per_minute_ceiling": 1_000_000}.items():
            await set_setting(conn, key, value)
    return loaded


async def _settings(pool: AsyncConnectionPool[Conn]) -> DispatchSettings:
    async with pool.connection() as conn:
        return await load_settings(conn)


async def _promote(conn: Conn, task_id: int, lane: str) -> None:
    await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_lane = %(lane)s, dispatch_priority = %(p)s "
                       "WHERE id = %(id)s", {"lane": lane, "p": monitor_lane(lane).default_priority, "id": task_id})


async def _a_task_of(conn: Conn, tenant_id: int) -> int:
    """A ready task of the tenant (pending, no execution)."""
    cur = await conn.execute("SELECT min(t.id) AS id FROM monitoring_collect_tasks t WHERE t.tenant_id = %(t)s "
                             "AND t.status = 'pending' AND NOT EXISTS (SELECT 1 FROM desktop_tasks d "
                             "WHERE d.monitor_task_id = t.id)", {"t": tenant_id})
    row = await cur.fetchone()
    assert row is not None and row["id"] is not None
    return int(row["id"])


async def _plan(pool: AsyncConnectionPool[Conn], dispatcher: Dispatcher, settings: DispatchSettings, *,
                all_clients: bool) -> tuple[list[tuple[int, str]], dict[str, int], set[int]]:
    """What `dispatcher`'s next full pass would decide (nothing written, its cursors left as they were): the
    (task, client) decisions, the rejections, and the tenants of the clients it read."""
    limits = limits_from(settings, slowdown=False)
    cursors = dict(dispatcher._read_after)
    async with pool.connection() as conn, conn.transaction(force_rollback=True):
        if not dispatcher.pending.read_at:
            await dispatcher.pending.refresh(conn)
        snap = await read_snapshot(conn, settings, all_clients=all_clients)
        candidates = await dispatcher.read_candidates(conn, snap, limits, settings)
    dispatcher._read_after = cursors
    plan = plan_pass(candidates, snap.clients, snap.ledger, limits, last_served=dispatcher.last_served,
                     max_dispatches=settings.dispatch_batch_size)
    return ([(d.task.id, str(d.client_id)) for d in plan.decisions], dict(plan.rejections),
            {c.tenant_id for c in snap.clients})


async def test_a_pass_reads_the_clients_of_its_window_and_plans_what_a_read_of_every_client_plans(
        pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool)
    last = world.ids[-1]
    async with pool.connection() as conn:
        # A collect-now of the last tenant (outside the first windows) and a task bound to a client of another tenant
        # (a client the window's tenants do not have).
        high_task = await _promote_a_click(conn, last)
        bound = await _a_task_of(conn, world.ids[0])
        cur = await conn.execute("SELECT id FROM desktop_clients WHERE tenant_id = %(t)s ORDER BY id LIMIT 1",
                                 {"t": world.ids[-2]})
        row = await cur.fetchone()
        assert row is not None
        foreign = row["id"]
        await conn.execute("UPDATE monitoring_collect_tasks SET target_client_id = %(c)s, "
                           "enqueued_at = now() - interval '1 day' WHERE id = %(id)s",  # first of its pair
                           {"c": foreign, "id": bound})
        # A broken login somewhere: the room of that tenant's clients changes, not the comparison.
        await conn.execute("UPDATE desktop_clients SET platform_health = %(h)s WHERE tenant_id = %(t)s",
                           {"h": json.dumps({"openai": "login_required"}), "t": world.ids[1]})
    settings = await _settings(pool)
    windowed, fleet = Dispatcher(pool), Dispatcher(pool)
    total_clients = TENANTS * CLIENTS_PER_TENANT
    for n in range(4):  # the windows move on from pass to pass: each one compared
        decided, rejected, tenants_read = await _plan(pool, windowed, settings, all_clients=False)
        # The same dispatcher state (cursors, rotation, pending pairs), reading every client.
        fleet._read_after, fleet.last_served = dict(windowed._read_after), dict(windowed.last_served)
        fleet.pending.by_lane, fleet.pending.read_at = windowed.pending.by_lane, windowed.pending.read_at
        expected, expected_rejected, every_tenant = await _plan(pool, fleet, settings, all_clients=True)
        assert decided == expected and rejected == expected_rejected, n
        assert len(decided) == BATCH and len(every_tenant) == TENANTS
        assert windowed.client_reads.rows < total_clients / 3, windowed.client_reads
        if n == 0:
            assert last in tenants_read  # the high candidate's tenant, read for it
            assert high_task in {task for task, _ in decided}
            assert (bound, str(foreign)) in decided  # its client read by id, as a read of every client finds it
        outcome = await windowed.run_pass(settings)  # moves the cursors on as a pass that writes does
        assert outcome.dispatched == BATCH and outcome.high_dispatched == (1 if n == 0 else 0)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE monitor_task_id = %(id)s",
                                 {"id": high_task})
        row = await cur.fetchone()
        assert row is not None and row["n"] == 1


async def _promote_a_click(conn: Conn, tenant_id: int) -> int:
    task = await _a_task_of(conn, tenant_id)
    await _promote(conn, task, CLICK_LANE.name)
    return task


async def test_the_tenants_read_are_those_of_the_pairs_the_window_visits(pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool)
    settings = await _settings(pool)
    dispatcher = Dispatcher(pool)
    async with pool.connection() as conn:
        await dispatcher.pending.refresh(conn)
    _, _, tenants_read = await _plan(pool, dispatcher, settings, all_clients=False)
    # No high work: the first window's stretch, from the first pair on (3 pairs a tenant), and nothing else.
    first = world.ids[:len(tenants_read)]
    assert tenants_read == set(first), (sorted(tenants_read), first)
    assert dispatcher.client_reads.rows == len(tenants_read) * CLIENTS_PER_TENANT
    assert dispatcher.client_reads.statements >= 1


async def _budgets_that_bite(pool: AsyncConnectionPool[Conn], per_tenant: int) -> None:
    """A tenant budget of `per_tenant` in an hour's window (no rollover between two reads a test compares)."""
    async with pool.connection() as conn:
        for key, value in {"tenant_dispatch_per_minute": per_tenant, "tenant_dispatch_per_minute_ceiling": per_tenant,
                           "budget_window_seconds": 3600}.items():
            await set_setting(conn, key, value)


async def _ledger_tenants(pool: AsyncConnectionPool[Conn], settings: DispatchSettings) -> int:
    """How many tenants have budget use in the current window (what a read of every tenant's use returns)."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT extract(epoch FROM now())::bigint AS now")
        row = await cur.fetchone()
        assert row is not None
        window = settings.budget_window_seconds
        use = await dispatch_reads.budget_use(conn, window_start=row["now"] // window * window,
                                              window_seconds=window)
    return len({r.tenant_id for r in use})


async def test_a_pass_reads_the_budget_use_of_its_windows_tenants_and_plans_what_every_tenants_reading_plans(
        pool: AsyncConnectionPool[Conn]) -> None:
    await _world(pool)
    await _budgets_that_bite(pool, 2)  # each tenant's outstanding execution already counts: one more a window
    settings = await _settings(pool)
    windowed, fleet = Dispatcher(pool), Dispatcher(pool)
    rejected_for_budget = 0
    for n in range(6):
        decided, rejected, tenants_read = await _plan(pool, windowed, settings, all_clients=False)
        fleet._read_after, fleet.last_served = dict(windowed._read_after), dict(windowed.last_served)
        fleet.pending.by_lane, fleet.pending.read_at = windowed.pending.by_lane, windowed.pending.read_at
        expected, expected_rejected, _ = await _plan(pool, fleet, settings, all_clients=True)
        assert decided == expected and rejected == expected_rejected, n
        rejected_for_budget += rejected.get("tenant_budget", 0)
        # The budget rows read are those of the tenants read (a row per lane class with use), not every tenant's.
        assert windowed.client_reads.budget_rows <= 2 * len(tenants_read), windowed.client_reads
        assert len(tenants_read) < TENANTS / 2
        assert (await windowed.run_pass(settings)).dispatched == len(decided)
    assert rejected_for_budget > 0  # the budgets did bite: the comparison covered them
    assert await _ledger_tenants(pool, settings) == TENANTS


async def test_a_pass_with_every_tenant_budget_spent_counts_each_pairs_rejection(
        pool: AsyncConnectionPool[Conn]) -> None:
    """No non-high candidate is read: the rejection of every pending pair is told from every tenant's use, as the
    snapshot's read of it told it before."""
    await _world(pool, tenants=200, ready=2_000)  # more pairs than a pass's windows visit
    await _budgets_that_bite(pool, 1)  # spent by each tenant's outstanding execution
    settings = await _settings(pool)
    dispatcher = Dispatcher(pool)
    outcome = await dispatcher.run_pass(settings)
    assert outcome.dispatched == 0
    assert outcome.rejections == {"tenant_budget": len(dispatcher.pairs)}, outcome.rejections
    assert len(dispatcher.pairs) == 200 * 3
    assert dispatcher.client_reads.rows < 200 * CLIENTS_PER_TENANT  # the windows reached some tenants only


async def test_a_lane_with_work_in_one_pair_among_hundreds_reaches_it_in_the_first_pass(
        pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool, tenants=200, ready=2_000)
    async with pool.connection() as conn:
        boosted = await _a_task_of(conn, world.ids[-1])
        await _promote(conn, boosted, BOOSTED)
        by_lane = await dispatch_reads.pending_lane_pairs(conn)
    assert len(by_lane[BOOSTED]) == 1 and len(by_lane[SCHEDULED_LANE.name]) == 200 * 3
    dispatcher = Dispatcher(pool)
    assert (await dispatcher.run_pass(await _settings(pool))).dispatched == BATCH
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM desktop_tasks WHERE monitor_task_id = %(id)s",
                                 {"id": boosted})
        row = await cur.fetchone()
    assert row is not None and row["n"] == 1


async def _pauses_over_every_client(conn: Conn, settings: DispatchSettings) -> dict[tuple[int, int], str]:
    """`paused_pairs` over every eligible client (what the pass computed before migration 070)."""
    snap = await read_snapshot(conn, settings, all_clients=True)
    return dict(paused_pairs((ClientHealth(c.id, c.tenant_id, c.blocked_platforms) for c in snap.clients),
                             snap.overrides, snap.platform_codes))


async def test_the_health_pauses_come_from_the_blocking_clients_and_agree_with_every_clients_reading(
        pool: AsyncConnectionPool[Conn]) -> None:
    world = await _world(pool, tenants=6, ready=0)  # no pending work at all: a pause shows all the same
    settings = await _settings(pool)
    a, b, c, d, e, f = world.ids
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, tenant_id FROM desktop_clients ORDER BY tenant_id, id")
        clients: dict[int, list[Any]] = {}
        for r in await cur.fetchall():
            clients.setdefault(r["tenant_id"], []).append(r["id"])

        async def health(client: Any, report: object) -> None:
            await conn.execute("UPDATE desktop_clients SET platform_health = %(h)s WHERE id = %(id)s",
                               {"h": json.dumps(report) if report is not None else None, "id": client})

        for client in clients[a]:  # every client blocks openai: paused
            await health(client, {"openai": "login_required", "gemini": "healthy"})
        await health(clients[b][0], {"openai": "captcha"})  # one of two: not paused
        for client in clients[c]:  # both block, by different states, one also gemini: openai paused only
            await health(client, {"openai": "rate_limited"})
        await health(clients[c][0], {"openai": "captcha", "gemini": "login_required"})
        await health(clients[d][0], {"openai": "login_required"})  # the other one is offline: paused
        await conn.execute("UPDATE desktop_clients SET online = false WHERE id = %(id)s", {"id": clients[d][1]})
        for client in clients[e]:  # an unknown platform code and a state that does not block: nothing
            await health(client, {"nosuch": "login_required", "openai": "degraded"})
        for client in clients[f]:  # paused by health, lifted by the operator
            await health(client, {"gemini": "captcha"})
        await conn.execute("INSERT INTO platform_health_overrides (tenant_id, ai_platform_id, mode, reason) "
                           "SELECT %(t)s, id, 'ignore_health', 'stale' FROM ai_platforms WHERE code = 'gemini'",
                           {"t": f})
        snap = await read_snapshot(conn, settings, all_clients=False)
        expected = await _pauses_over_every_client(conn, settings)
        code = {pid: c for pid, c in snap.platform_codes.items()}
        assert {(t, code[p]): s for (t, p), s in snap.platform_pauses.items()} == {
            (a, "openai"): "health", (c, "openai"): "health", (d, "openai"): "health"}
        assert snap.platform_pauses == expected
        assert snap.clients == []  # the pass read no client for them
        # The statement reads the blocking clients through the partial index.
        await conn.execute("SET enable_seqscan = off")  # a 12-client table is read whole otherwise
        cur = await conn.execute("EXPLAIN (FORMAT JSON) " + dispatch_reads._HEALTH_PAUSES,
                                 {"heartbeat_timeout_s": 30})
        row = await cur.fetchone()
        assert row is not None
        plan = json.dumps(row["QUERY PLAN"])
        assert "ix_clients_health_blocking" in plan, plan


async def test_the_indexs_predicate_is_the_codes_blocking_client(pool: AsyncConnectionPool[Conn]) -> None:
    """The database's own reading of migration 070's predicate against libs.domain.platform_health's: a report blocks
    when one of its states is a blocking one."""
    reports: list[object] = [None, {}, {"openai": "healthy"}, {"openai": "degraded", "gemini": "unknown"},
                             ["login_required"], "captcha", {"openai": 1}, {"x": "LOGIN_REQUIRED"}]
    reports += [{"openai": state} for state in BLOCKING_STATES]
    reports += [{"openai": "healthy", "gemini": state} for state in BLOCKING_STATES]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT pg_get_expr(i.indpred, i.indrelid) AS pred FROM pg_index i JOIN pg_class c "
                                 "ON c.oid = i.indexrelid WHERE c.relname = 'ix_clients_health_blocking'")
        row = await cur.fetchone()
        assert row is not None
        predicate = row["pred"]
        for report in reports:
            cur = await conn.execute(f"SELECT coalesce(({predicate}), false) AS blocks "
                                     "FROM (SELECT %(h)s::jsonb AS platform_health) c",
                                     {"h": json.dumps(report) if report is not None else None})
            got = await cur.fetchone()
            assert got is not None
            expected = isinstance(report, dict) and any(s in BLOCKING_STATES for s in report.values())
            assert got["blocks"] == expected, report


async def test_pairs_of_tenants_without_an_eligible_client_take_a_few_client_statements(
        pool: AsyncConnectionPool[Conn]) -> None:
    """The stretches double while their pairs have no room: a window walking 80 pairs of tenants whose clients are all
    offline reads their clients in 3 statements (16, 32, 32 pairs), not 5 of 16 pairs; three windows, 9."""
    world = await _world(pool, tenants=200, ready=2_000)
    async with pool.connection() as conn:
        await conn.execute("UPDATE desktop_clients SET online = false WHERE tenant_id = ANY(%(t)s)",
                           {"t": world.ids[:190]})
    dispatcher = Dispatcher(pool)
    outcome = await dispatcher.run_pass(await _settings(pool))
    assert outcome.dispatched == 0 and outcome.rejections == {"no_eligible_client": 240}, outcome
    assert dispatcher.client_reads.rows == 0
    assert dispatcher.client_reads.statements == 9, dispatcher.client_reads


_LEDGER_OF_MANY_TENANTS = """
INSERT INTO dispatch_budget_ledger (window_start, window_seconds, tenant_id, high, source, used)
SELECT %(ws)s, 60, g, false, 0, 1 FROM generate_series(1, %(tenants)s) g
"""


async def test_the_budget_use_of_some_tenants_is_a_probe_per_tenant_whatever_the_statistics(
        pool: AsyncConnectionPool[Conn], settings: Settings) -> None:
    """The ledger analyzed while it held nothing of the window (the planner estimates one row for it), then 5,000
    tenants' use in it: the use of 20 of them reads their rows, not every tenant's (the tenants as a filter over the
    window's rows read all 5,000 and threw 4,980 away)."""
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO dispatch_budget_ledger_tracking (window_seconds, since_window_start) "
                           "VALUES (60, 0)")
        await conn.execute("ANALYZE dispatch_budget_ledger")
        await conn.execute(_LEDGER_OF_MANY_TENANTS, {"ws": 600, "tenants": 5_000})
    plans: list[Plan] = []
    explained = explaining_pool(settings.database_url, plans)
    await explained.open(wait=True)
    try:
        async with explained.connection() as conn:
            read = await dispatch_reads.clients_of(conn, tenants=list(range(100, 2_100, 100)), window_start=600,
                                                   window_seconds=60, heartbeat_timeout_s=30)
    finally:
        await explained.close()
    assert sorted((u.tenant_id, u.n) for u in read.budget) == [(t, 1) for t in range(100, 2_100, 100)]
    (budget,) = [p for p in plans if "FROM dispatch_budget_ledger l" in p.query]
    assert budget.filtered == 0 and budget.buffers < 200, budget.text


async def test_the_pending_pairs_read_in_slices_are_the_whole_read_and_a_sweep_finds_what_changed(
        pool: AsyncConnectionPool[Conn], monkeypatch: Any) -> None:
    """Above `SLICE_MIN_ENTRIES` the background re-read reads a slice of the pairs at a time (docs/architecture.md "The
    pending pairs"): the slices, each cut before the pair its limit fell in, are the whole read, and a sweep of them
    finds a pair whose work went out and one that got work in another lane, outside the scanner."""
    from services.dispatch_coordinator import pending_pairs

    world = await _world(pool, tenants=200, ready=2_000)
    async with pool.connection() as conn:
        boosted = await _a_task_of(conn, world.ids[50])
        await _promote(conn, boosted, BOOSTED)
        whole = await dispatch_reads.pending_lane_pairs(conn)
        sliced: dict[str, set[tuple[int, int]]] = {}
        start, slices = None, 0
        while True:
            by_lane, end = await dispatch_reads.pending_lane_pairs_slice(conn, start=start, limit=97)
            assert sum(len(p) for p in by_lane.values()) <= 97
            for lane, pairs in by_lane.items():
                assert pairs == sorted(pairs) and all(start is None or pair >= start for pair in pairs)
                assert all(end is None or pair < end for pair in pairs)
                sliced.setdefault(lane, set()).update(pairs)
            slices += 1
            if end is None:
                break
            assert start is None or end > start
            start = end
        assert sliced == whole and slices == math.ceil(601 / 96)  # 601 entries, 96 a slice (cut pair)

    monkeypatch.setattr(pending_pairs, "SLICE_MIN_ENTRIES", 100)
    dispatcher = Dispatcher(pool)
    async with pool.connection() as conn:
        await dispatcher.pending.refresh(conn)
        assert dispatcher.pending.by_lane == whole
        gone = world.ids[120]  # its work goes out; another tenant's task moves lanes (not the scanner's doing)
        await conn.execute("UPDATE monitoring_collect_tasks SET status = 'skipped' WHERE tenant_id = %(t)s "
                           "AND status = 'pending'", {"t": gone})
        moved = await _a_task_of(conn, world.ids[180])
        await _promote(conn, moved, BOOSTED)
        cur = await conn.execute("SELECT ai_platform_id FROM monitoring_collect_tasks WHERE id = %(id)s",
                                 {"id": moved})
        row = await cur.fetchone()
        assert row is not None
        read_at, sweep = dispatcher.pending.read_at, 0
        while dispatcher.pending.read_at == read_at:  # not every pair was read again yet
            sweep += 1
            assert sweep <= 10
            await dispatcher.pending.refresh_slice(conn)
        assert sweep >= 6  # ~600 entries at 100 a slice (less the pair each slice was cut in)
        truth = await dispatch_reads.pending_lane_pairs(conn)
    assert dispatcher.pending.by_lane == {lane: truth.get(lane, set()) for lane in dispatcher.pending.by_lane}
    assert not dispatcher.pending.has_pending(gone) and (world.ids[180], row["ai_platform_id"]) in truth[BOOSTED]
    assert all(dispatcher.pending.sorted_lane_pairs(lane) == sorted(truth.get(lane, ()))
               for lane in dispatcher.pending.by_lane)


async def test_the_clients_read_answers_their_blocking_health_only_whatever_else_a_row_holds(
        pool: AsyncConnectionPool[Conn]) -> None:
    """`clients_of` answers one JSON array (decoded by msgspec) and a client's platform_health as the pass uses it: its
    blocking entries, as text. A value that is not a string, another state, or a health that is not an object (a row
    written by hand) neither fails the read of the other clients nor blocks anything."""
    world = await _world(pool, tenants=3, ready=0)
    blocking = sorted(BLOCKING_STATES)[0]
    healths = [{"openai": blocking, "gemini": "healthy", "perplexity": 5}, "junk", {"gemini": ["x"]}]
    async with pool.connection() as conn:
        for tenant, health in zip(world.ids, healths, strict=True):
            await conn.execute("UPDATE desktop_clients SET platform_health = %(h)s::jsonb WHERE tenant_id = %(t)s",
                               {"h": json.dumps(health), "t": tenant})
        read = await dispatch_reads.clients_of(conn, tenants=world.ids, heartbeat_timeout_s=30)
    by_tenant = {c.tenant_id: c.platform_health for c in read.clients}
    assert len(read.clients) == 3 * CLIENTS_PER_TENANT
    assert by_tenant == {world.ids[0]: {"openai": blocking}, world.ids[1]: None, world.ids[2]: None}
