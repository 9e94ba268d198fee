"""Postgres pools: created without I/O, opened at start-up, closed at shutdown."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import psycopg
from psycopg import AsyncConnection
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings

Conn = AsyncConnection[DictRow]
# psycopg's default: a query is prepared server-side after its fifth execution on a connection.
DEFAULT_PREPARE_THRESHOLD = 5
# For rare latency-critical paths (a collect-now request, the coordinator's high pass): prepared on first use.
# With the default, a query that runs once per click on one of several pooled connections is parsed and
# planned anew nearly every time (the high pass in-process: 11.7 ms unprepared, 7.1 prepared). Bulk paths keep
# psycopg's default: their queries run often enough to be prepared soon anyway, and `bench outbox` showed no
# difference either way within its run-to-run spread (3,500-5,400 events/s on the same code).
PREPARE_ON_FIRST_USE = 0


log = logging.getLogger("db.pool")

# Statements (with parameters that match nothing) a new pooled connection plans before the pool hands it out.
WarmUp = Sequence[tuple[str, Mapping[str, Any]]]


def _configure(prepare_threshold: int | None, warm_up: WarmUp = ()) -> Callable[[Conn], Awaitable[None]]:
    async def configure(conn: Conn) -> None:
        # Autocommit outside explicit transactions: every write goes through `conn.transaction()`.
        await conn.set_autocommit(True)
        conn.prepare_threshold = prepare_threshold
        await _warm(conn, warm_up)

    return configure


async def _warm(conn: Conn, warm_up: WarmUp) -> None:
    """EXPLAIN (plan, run nothing) each statement: a new server backend loads the catalogs of every table, index
    and type the statements touch, which the first real use would otherwise wait for (collect-now's read statement
    on a new connection: 7.6-7.9 ms the first time, 2.5-2.7 ms after this). A failing statement leaves the
    connection cold, never unusable (autocommit: no transaction is left aborted); a lost connection is discarded."""
    for query, params in warm_up:
        try:
            await conn.execute("EXPLAIN " + query, params, prepare=False)
        except psycopg.Error as exc:
            if conn.broken:
                raise  # the pool discards it and connects again
            log.warning("warming a new connection failed; it starts cold", extra={"error": str(exc)[:300]})


class LifoConnectionPool(AsyncConnectionPool[Conn]):
    """psycopg's pool hands out the connection idle the longest (FIFO), so consecutive requests rotate over every
    pooled connection and each finds its server backend cold (CPU caches, and with the default prepare threshold
    its statements not yet prepared). This one hands out the connection returned last, like PgBouncer's default
    (`server_round_robin = 0`): a few connections carry the load and stay warm, and the idle ones are the ones
    `max_idle` closes. On the collect-now path (three processes, four transactions) it took click ->
    `task_available` from 15.1-15.9 to 13.7 ms at p50 (docs/benchmarks.md)."""

    async def _get_ready_connection(self, timeout: float | None) -> Conn | None:
        # Called under the pool's lock; the pool pops from the left and returns connections to the right.
        self._pool.rotate(1)
        return await super()._get_ready_connection(timeout)


def session_timeouts(settings: Settings) -> str:
    """libpq `options` that set the session's statement, lock-wait and idle-in-transaction timeouts."""
    return (f"-c statement_timeout={settings.db_statement_timeout_ms} -c lock_timeout={settings.db_lock_timeout_ms} "
            f"-c idle_in_transaction_session_timeout={settings.db_idle_in_transaction_timeout_ms}")


def make_pool(
    settings: Settings, *, name: str, min_size: int | None = None, max_size: int | None = None,
    prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD, warm_up: WarmUp = (),
) -> AsyncConnectionPool[Conn]:
    """A pool that opens nothing until `await pool.open()`. `warm_up`: statements every new connection plans
    before it is handed out (for latency-critical paths that run rarely, so often on a new connection)."""
    return LifoConnectionPool(
        settings.database_url,
        min_size=settings.db_pool_min if min_size is None else min_size,
        max_size=settings.db_pool_max if max_size is None else max_size,
        kwargs={"row_factory": dict_row, "application_name": name, "options": session_timeouts(settings)},
        configure=_configure(prepare_threshold, warm_up),
        open=False,
        name=name,
        timeout=10.0,
    )


@asynccontextmanager
async def open_pool(
    settings: Settings, *, name: str, min_size: int | None = None, max_size: int | None = None, warm_up: WarmUp = ()
) -> AsyncIterator[AsyncConnectionPool[Conn]]:
    pool = make_pool(settings, name=name, min_size=min_size, max_size=max_size, warm_up=warm_up)
    await pool.open(wait=True, timeout=30.0)
    try:
        yield pool
    finally:
        await pool.close()


async def connect(url: str, *, autocommit: bool = True, name: str = "monitoring", options: str = "") -> Conn:
    """A dedicated connection (leader lock, LISTEN, the CLI); `options`: server settings for its session."""
    extra: dict[str, Any] = {"options": options} if options else {}
    conn: Conn = await AsyncConnection.connect(
        url, autocommit=autocommit, row_factory=dict_row, application_name=name, **extra
    )
    return conn


def json_records(rows: Iterable[Mapping[str, Any]], keys: Sequence[str]) -> str:
    """A batch of rows as one JSON parameter of named records (`keys` of each row), for
    `json_to_recordset(%(rows)s::json) AS r(name type, ...)`: the statement names each column and its type, the
    caller each value, and nothing depends on an order both sides must keep. Encoded by msgspec in C."""
    return msgspec.json.encode([{k: row[k] for k in keys} for row in rows]).decode()
