"""Pool wiring (libs/db/pool.py) against real Postgres."""

from __future__ import annotations

from libs.db.pool import DEFAULT_PREPARE_THRESHOLD, PREPARE_ON_FIRST_USE, make_pool, open_pool


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
