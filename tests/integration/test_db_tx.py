"""`pipelined_transaction` (libs/db/tx.py) against real Postgres: one pipeline from BEGIN to COMMIT, and every
way out of it that is not a commit rolls back."""

from __future__ import annotations

import pytest
from psycopg import errors as pg_errors

from libs.db.pool import Conn, connect
from libs.db.tx import pipelined_transaction


@pytest.fixture
async def conn(database_url: str):
    conn = await connect(database_url)
    conn.prepare_threshold = 0  # as on the collect-now path: a failed pipeline must not leave stale prepared names
    await conn.execute("CREATE TABLE tx_probe (id int PRIMARY KEY)")
    try:
        yield conn
    finally:
        await conn.close()


async def _ids(conn: Conn) -> list[int]:
    cur = await conn.execute("SELECT coalesce(array_agg(id ORDER BY id), '{}') AS ids FROM tx_probe")
    row = await cur.fetchone()
    assert row is not None
    return list(row["ids"])


async def test_commits_with_the_last_statements_in_one_round_trip(conn: Conn) -> None:
    async with pipelined_transaction(conn) as pipe:
        first = await conn.execute("INSERT INTO tx_probe VALUES (%(id)s) RETURNING id", {"id": 1})
        await pipe.sync()
        assert await first.fetchall() == [{"id": 1}]
        assert conn.info.transaction_status.name == "INTRANS"  # a real transaction block, not autocommit
        last = await conn.execute("INSERT INTO tx_probe VALUES (%(id)s) RETURNING id", {"id": 2})
    assert await last.fetchall() == [{"id": 2}]  # readable after the block
    assert conn.info.transaction_status.name == "IDLE"
    assert await _ids(conn) == [1, 2]


async def test_an_exception_in_the_block_rolls_back(conn: Conn) -> None:
    with pytest.raises(LookupError):
        async with pipelined_transaction(conn) as pipe:
            await conn.execute("INSERT INTO tx_probe VALUES (%(id)s)", {"id": 1})
            await pipe.sync()
            raise LookupError("the caller decided against it")
    assert conn.info.transaction_status.name == "IDLE"
    assert await _ids(conn) == []


@pytest.mark.parametrize("sync_in_block", [False, True])
async def test_a_failed_statement_rolls_back_everything_and_leaves_the_connection_usable(
        conn: Conn, sync_in_block: bool) -> None:
    await conn.execute("INSERT INTO tx_probe VALUES (1)")
    with pytest.raises(pg_errors.UniqueViolation):
        async with pipelined_transaction(conn) as pipe:
            await conn.execute("INSERT INTO tx_probe VALUES (%(id)s)", {"id": 2})
            await conn.execute("INSERT INTO tx_probe VALUES (%(id)s)", {"id": 1})
            await conn.execute("SELECT %(n)s::int AS never_ran", {"n": 3})  # skipped by the aborted pipeline
            if sync_in_block:
                await pipe.sync()
    assert conn.info.transaction_status.name == "IDLE"
    assert await _ids(conn) == [1]
    cur = await conn.execute("SELECT %(n)s::int AS n", {"n": 3})  # the statement the pipeline skipped runs now
    assert await cur.fetchall() == [{"n": 3}]
