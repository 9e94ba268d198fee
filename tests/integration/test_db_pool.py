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
