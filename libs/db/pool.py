"""Postgres pools: created without I/O, opened at start-up, closed at shutdown."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool
from psycopg_pool.base import AttemptWithBackoff

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


class CappedBackoff(AttemptWithBackoff):
    """psycopg_pool's reconnect schedule, capped: 0.2, 0.4, 0.8 s, then every `max_delay` (less up to half of it,
    at random, so replicas do not reconnect in step). psycopg's own doubles from 1 s without a cap (attempts 1, 3,
    7, 15, 31, 63, 127 s into an outage: after a 75 s one, the next came up to ~50 s after the database was back;
    36 s was measured) and gives up after `reconnect_timeout`."""

    INITIAL_DELAY = 0.2

    def __init__(self, *, timeout: float, max_delay: float) -> None:
        super().__init__(timeout=timeout)
        self.max_delay = max_delay

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        if self.delay > self.max_delay:
            self.delay = self.max_delay * random.uniform(0.5, 1.0)


class LifoConnectionPool(AsyncConnectionPool[Conn]):
    """psycopg_pool's pool (its waiting queue, growing, shrinking, reconnect tasks and stats are what we want; a
    hand-written pool would have to get all of that right again), changed in two places:

    - It hands out the connection returned last, not the one idle the longest (FIFO): consecutive requests would
      rotate over every pooled connection and each find its server backend cold (CPU caches, and with the default
      prepare threshold its statements not yet prepared). Like PgBouncer's default (`server_round_robin = 0`), a
      few connections carry the load and stay warm, and the idle ones are the ones `max_idle` closes. On the
      collect-now path (three processes, four transactions) it took click -> `task_available` from 15.1-15.9 to
      13.7 ms at p50 (docs/benchmarks.md).
    - A lost connection is re-made on a capped schedule (`CappedBackoff`), for as long as the database is away
      (`reconnect_timeout` infinite: a pool that gave up would stay short of connections after a long outage)."""

    def __init__(self, conninfo: str, *, max_reconnect_delay: float = 1.0, **kwargs: Any) -> None:
        kwargs.setdefault("reconnect_timeout", float("inf"))
        super().__init__(conninfo, **kwargs)
        self.max_reconnect_delay = max_reconnect_delay

    async def _get_ready_connection(self, timeout: float | None) -> Conn | None:
        # Called under the pool's lock; the pool pops from the left and returns connections to the right.
        self._pool.rotate(1)
        return await super()._get_ready_connection(timeout)

    async def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        # The first attempt of a (re)connect comes with no schedule; psycopg_pool carries the one given here on
        # to every retry (AddConnection(pool, attempt)).
        if attempt is None:
            attempt = CappedBackoff(timeout=self.reconnect_timeout, max_delay=self.max_reconnect_delay)
        await super()._add_connection(attempt, growing)


def session_timeouts(settings: Settings) -> str:
    """libpq `options` that set the session's statement, lock-wait and idle-in-transaction timeouts."""
    return (f"-c statement_timeout={settings.db_statement_timeout_ms} -c lock_timeout={settings.db_lock_timeout_ms} "
            f"-c idle_in_transaction_session_timeout={settings.db_idle_in_transaction_timeout_ms}")


def server_keepalives(settings: Settings) -> str:
    """libpq `options` for the server's side of the session: Postgres probes a silent client and ends its session
    (its locks, its transaction) within about as long as the client takes to notice a silent server."""
    return (f"-c tcp_keepalives_idle={settings.db_keepalives_idle_s} "
            f"-c tcp_keepalives_interval={settings.db_keepalives_interval_s} "
            f"-c tcp_keepalives_count={settings.db_keepalives_count} "
            f"-c tcp_user_timeout={settings.db_tcp_user_timeout_ms}")


def connection_params(url: str, settings: Settings, *, server_keepalive: bool | None = None,
                      with_session_timeouts: bool = True) -> dict[str, Any]:
    """The libpq parameters every connection gets on top of `url`: keepalives, `tcp_user_timeout`,
    `connect_timeout`, and as `options` the session timeouts (unless `with_session_timeouts` is False) and the
    server-side keepalives (unless `server_keepalive` is False, or None and DB_SERVER_KEEPALIVE off). A parameter
    `url` sets itself is left to it; its `options` come after ours, so its `-c` settings win (Postgres applies
    them in order)."""
    given = conninfo_to_dict(url)
    params: dict[str, Any] = {
        "keepalives": 1,
        "keepalives_idle": settings.db_keepalives_idle_s,
        "keepalives_interval": settings.db_keepalives_interval_s,
        "keepalives_count": settings.db_keepalives_count,
        "tcp_user_timeout": settings.db_tcp_user_timeout_ms,
        "connect_timeout": settings.db_connect_timeout_s,
    }
    params = {key: value for key, value in params.items() if key not in given}
    options = [session_timeouts(settings)] if with_session_timeouts else []
    if settings.db_server_keepalive if server_keepalive is None else server_keepalive:
        options.append(server_keepalives(settings))
    if given.get("options"):
        options.append(str(given["options"]))
    if options:
        params["options"] = " ".join(options)
    return params


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
        kwargs={"row_factory": dict_row, "application_name": name,
                **connection_params(settings.database_url, settings)},
        max_reconnect_delay=settings.db_reconnect_max_delay_ms / 1000,
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


async def connect(url: str, *, autocommit: bool = True, name: str = "monitoring", settings: Settings | None = None,
                  server_keepalive: bool | None = None, with_session_timeouts: bool = True, options: str = "") -> Conn:
    """One connection outside the pools (leader locks, LISTEN, migrations, monitorctl), with the same dead-peer
    detection and session timeouts as a pooled one (`connection_params`). `settings`: where those come from (the
    environment's, `Settings.from_env()`, when not given); `server_keepalive`: whether the server side of the session
    gets keepalives too (None: DB_SERVER_KEEPALIVE, on by default) -- a leader's session needs them, so that the
    server ends it, and frees its advisory lock, when the leader's node goes silent. `with_session_timeouts=False`:
    no statement, lock-wait or idle timeouts (migrations: an index build may take minutes, and a second migrator
    waits for the first one's lock for as long as it takes). `options`: server settings of this session's own, after
    (so over) the ones above (the leader lock's keepalives, sized to its lease)."""
    params = connection_params(url, Settings.from_env() if settings is None else settings,
                               server_keepalive=server_keepalive, with_session_timeouts=with_session_timeouts)
    if options:
        params["options"] = f"{params.get('options', '')} {options}".strip()
    conn: Conn = await AsyncConnection.connect(
        url, autocommit=autocommit, row_factory=dict_row, application_name=name, **params
    )
    return conn


def json_records(rows: Iterable[Mapping[str, Any]], keys: Sequence[str]) -> str:
    """A batch of rows as one JSON parameter of named records (`keys` of each row), for
    `json_to_recordset(%(rows)s::json) AS r(name type, ...)`: the statement names each column and its type, the
    caller each value, and nothing depends on an order both sides must keep. Encoded by msgspec in C."""
    return msgspec.json.encode([{k: row[k] for k in keys} for row in rows]).decode()
