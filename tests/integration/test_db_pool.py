"""Pool wiring (libs/db/pool.py) against real Postgres."""

from __future__ import annotations

import logging

import pytest
from psycopg.pq import TransactionStatus

from libs.config import Settings
from libs.db.pool import DEFAULT_PREPARE_THRESHOLD, PREPARE_ON_FIRST_USE, WarmUp, make_pool, open_pool
from services.collect_now_api import queries as collect_now_queries
from services.dispatch_coordinator import dispatcher


async def test_pools_prepare_on_first_use_only_where_asked(settings) -> None:
    """collect-now-api and the coordinator prepare statements on first use; other pools keep psycopg's default."""
    async with open_pool(settings, name="default-pool", min_size=1, max_size=1) as pool, pool.connection() as conn:
        assert conn.prepare_threshold == DEFAULT_PREPARE_THRESHOLD
    eager = make_pool(settings, name="eager-pool", min_size=1, max_size=1, prepare_threshold=PREPARE_ON_FIRST_USE)
    await eager.open(wait=True)
    try:
        async with eager.connection() as conn:
            assert conn.prepare_threshold == 0
            await conn.execute("SELECT 1")
            cur = await conn.execute("SELECT count(*) AS n FROM pg_prepared_statements")
            row = await cur.fetchone()
            assert row is not None and row["n"] >= 1  # prepared on its first execution
    finally:
        await eager.close()


async def test_pool_hands_out_the_connection_returned_last(settings) -> None:
    """LIFO: after three connections go back in the order a, b, c, the next request gets c (psycopg's own pool
    would give a), and a request after that gets b; the one idle longest stays at the back."""
    async with open_pool(settings, name="lifo-pool", min_size=3, max_size=3) as pool:
        conns = [await pool.getconn() for _ in range(3)]
        pids = [conn.info.backend_pid for conn in conns]
        assert len(set(pids)) == 3
        for conn in conns:
            await pool.putconn(conn)
        first = await pool.getconn()
        second = await pool.getconn()
        assert [first.info.backend_pid, second.info.backend_pid] == [pids[2], pids[1]]
        await pool.putconn(second)
        await pool.putconn(first)
        async with pool.connection() as again:
            assert again.info.backend_pid == pids[2]  # first went back last


@pytest.mark.parametrize("warm_up", [collect_now_queries.WARM_UP, dispatcher.WARM_UP],
                         ids=["collect-now-api", "dispatch-coordinator"])
async def test_each_services_warm_up_statements_plan_cleanly(settings: Settings, warm_up: WarmUp,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Every statement a service warms new connections with is valid against the schema with its parameters: a
    warning here means one stopped warming (its SQL or parameters changed)."""
    assert len(warm_up) >= 6
    with caplog.at_level(logging.WARNING, logger="db.pool"):
        async with open_pool(settings, name="warm-pool", min_size=1, max_size=1, warm_up=warm_up) as pool, \
                pool.connection() as conn:
            await conn.execute("SELECT 1")
    assert [r.getMessage() for r in caplog.records if r.name == "db.pool"] == []


async def test_a_failing_warm_up_statement_leaves_the_connection_usable(settings: Settings,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    warm_up = [("SELECT * FROM no_such_table WHERE id = %(id)s", {"id": 1}), ("SELECT %(n)s::int", {"n": 1})]
    with caplog.at_level(logging.WARNING, logger="db.pool"):
        async with open_pool(settings, name="warm-pool", min_size=1, max_size=1, warm_up=warm_up) as pool, \
                pool.connection() as conn:
            cur = await conn.execute("SELECT 41 + 1 AS n")
            assert await cur.fetchone() == {"n": 42}
            assert conn.info.transaction_status == TransactionStatus.IDLE
    warnings = [r for r in caplog.records if r.name == "db.pool"]
    assert len(warnings) == 1 and "no_such_table" in warnings[0].__dict__["error"]


async def test_every_pooled_connection_has_statement_lock_and_idle_timeouts(settings: Settings) -> None:
    from dataclasses import replace

    import psycopg

    tight = replace(settings, db_statement_timeout_ms=300, db_lock_timeout_ms=200,
                    db_idle_in_transaction_timeout_ms=5000)
    async with open_pool(tight, name="timeouts", min_size=1, max_size=2) as pool:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT current_setting('statement_timeout') AS st, "
                                     "current_setting('lock_timeout') AS lt, "
                                     "current_setting('idle_in_transaction_session_timeout') AS it")
            assert await cur.fetchone() == {"st": "300ms", "lt": "200ms", "it": "5s"}
            with pytest.raises(psycopg.errors.QueryCanceled):
                await conn.execute("SELECT pg_sleep(2)")
        async with pool.connection() as holder, pool.connection() as waiter:
            await holder.execute("BEGIN")
            await holder.execute("SELECT pg_advisory_xact_lock(4242)")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                await waiter.execute("SELECT pg_advisory_lock(4242)")
            await holder.execute("ROLLBACK")
