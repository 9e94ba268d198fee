"""A transaction sent as one pipeline: BEGIN, the caller's statements and COMMIT go out together.

psycopg's `conn.transaction()` inside `conn.pipeline()` nests two more pipelines and syncs before its COMMIT,
so the COMMIT costs a round trip of its own, plus the nested pipelines' bookkeeping in Python: measured here,
one statement in a pipelined `transaction()` took 0.75-0.80 ms against 0.30 ms with BEGIN and COMMIT queued
as plain statements. On the collect-now path every transaction is on the click's clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from psycopg import AsyncPipeline
from psycopg.pq import TransactionStatus

from libs.db.pool import Conn

_IDLE = TransactionStatus.IDLE


@asynccontextmanager
async def pipelined_transaction(conn: Conn) -> AsyncIterator[AsyncPipeline]:
    """`async with pipelined_transaction(conn) as pipe:` on an autocommit connection (the pools' setting).

    Statements executed in the block are queued behind a BEGIN; `await pipe.sync()` sends what is queued and
    makes the results so far readable (a round trip). A normal exit queues the COMMIT and sends everything
    left with it; results of statements executed after the last sync are readable after the block. An
    exception in the block (or a failed statement or COMMIT) rolls the transaction back and propagates.
    """
    try:
        async with conn.pipeline() as pipe:
            await conn.execute("BEGIN")
            yield pipe
            await conn.execute("COMMIT")
    except BaseException:
        # A Python error in the block, or a statement's: whatever ran is undone. (`rollback()` leaves a
        # "pipeline aborted" state first, and forgets statements that a failed pipeline may not have prepared.)
        if not conn.closed and conn.pgconn.transaction_status != _IDLE:
            await conn.rollback()
        raise
