"""A database that goes away and comes back, for one client: a TCP proxy (tests/support/tcpproxy.py) between a pool
(or a connection) and the shared Postgres is cut and restored, so nothing is stopped for the other tests. Also
what every connection carries (keepalives, server-side keepalives, timeouts) and a multi-host failover URL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from libs.config import Settings
from libs.db.migrate import ensure_database
from libs.db.pool import connect, make_pool, open_pool
from libs.runtime import pool_ready_check
from tests.support.desktop import running_hub
from tests.support.tcpproxy import TcpProxy

# Long enough that psycopg_pool's own schedule (1, 2, 4, 8, 16 s apart: attempts 1, 3, 7, 15, 31 s into the outage)
# has its next attempt ~11 s after the restore; the capped one has it within a second.
OUTAGE_S = 20.0
BACK_WITHIN_S = 5.0


@pytest.fixture
async def proxy(settings: Settings) -> AsyncIterator[TcpProxy]:
    params = conninfo_to_dict(settings.database_url)
    proxy = TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


def through(proxy: TcpProxy, settings: Settings) -> Settings:
    return replace(settings, database_url=make_conninfo(settings.database_url, host="127.0.0.1", port=str(proxy.port)))


async def _ready(check: object) -> bool:
    try:
        await check()  # type: ignore[operator]
    except Exception:
        return False
    return True


@pytest.mark.timeout(90)
async def test_a_pool_and_its_readiness_are_back_within_seconds_of_a_long_outage(settings: Settings,
                                                                                proxy: TcpProxy) -> None:
    """The database unreachable for 20 s while the service keeps using its pool (readiness probes): readiness is
    false throughout, and within 5 s of the restore it is true and the pool hands out a working connection. With
    psycopg_pool's uncapped backoff the first connection came ~11 s after the restore."""
    pool = make_pool(through(proxy, settings), name="outage", min_size=2, max_size=2)
    await pool.open(wait=True)
    ready = pool_ready_check(pool)  # what /readyz runs ("postgres")
    try:
        assert await _ready(ready)
        await proxy.cut()
        down_until = time.monotonic() + OUTAGE_S
        while time.monotonic() < down_until:  # the probes find the connections dead and the pool reconnecting
            assert not await _ready(ready), "ready while the database is unreachable"
            await pool.check()
        await proxy.restore()
        restored = time.monotonic()
        while not await _ready(ready):
            assert time.monotonic() - restored < BACK_WITHIN_S, "readiness not back within 5 s of the database"
        async with pool.connection(timeout=BACK_WITHIN_S) as conn:
            cur = await conn.execute("SELECT 1 AS one")
            assert await cur.fetchone() == {"one": 1}
        assert time.monotonic() - restored < BACK_WITHIN_S
    finally:
        await pool.close()


@pytest.mark.timeout(90)
async def test_a_real_services_readiness_is_back_within_seconds_of_a_long_outage(settings: Settings,
                                                                                 proxy: TcpProxy) -> None:
    """The dispatch-hub app (in process, its pool through the proxy, its heartbeat flushes running): /readyz
    answers 503 with `postgres` failing while the database is away for 20 s, and 200 within 5 s of its return."""

    async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, str]]:
        async with http.get(url) as resp:
            return resp.status, (await resp.json())["checks"]

    async with running_hub(through(proxy, settings)) as hub, aiohttp.ClientSession() as http:
        url = str(hub.make_url("/readyz"))
        assert (await readyz(http, url))[0] == 200
        await proxy.cut()
        down_until = time.monotonic() + OUTAGE_S
        while time.monotonic() < down_until:
            status, checks = await readyz(http, url)
            assert status == 503 and checks["postgres"] == "failing", "ready while the database is unreachable"
        await proxy.restore()
        restored = time.monotonic()
        while (await readyz(http, url))[0] != 200:
            assert time.monotonic() - restored < BACK_WITHIN_S, "/readyz not back within 5 s of the database"


async def test_a_pool_whose_connections_all_died_serves_the_next_request_at_once(settings: Settings,
                                                                                proxy: TcpProxy) -> None:
    """Every pooled connection lost at once (a restart, a failover) while the database stays reachable: the
    first request on a dead connection fails, and after `check()` (collect-now's retry-once path) the next gets a
    new connection right away, not after the pool's 10 s timeout."""
    pool = make_pool(through(proxy, settings), name="all-died", min_size=2, max_size=2)
    await pool.open(wait=True)
    try:
        await proxy.cut()
        await proxy.restore()  # the connections are gone, the database is reachable again
        await pool_ready_check(pool)()  # ready at the first probe: it replaces the dead connections and retries
        await proxy.cut()
        await proxy.restore()
        with pytest.raises(psycopg.OperationalError):
            async with pool.connection() as conn:
                await conn.execute("SELECT 1")
        started = time.monotonic()
        await pool.check()
        async with pool.connection(timeout=2.0) as conn:
            await conn.execute("SELECT 1")
        assert time.monotonic() - started < 2.0
    finally:
        await pool.close()


async def test_connect_carries_keepalives_timeouts_and_server_side_keepalives(settings: Settings) -> None:
    conn = await connect(settings.database_url, name="connect-under-test", settings=settings)
    try:
        assert conn.info.get_parameters()["keepalives_idle"] == "4"
        assert conn.info.get_parameters()["tcp_user_timeout"] == "10000"
        assert conn.info.get_parameters()["connect_timeout"] == "5"
        cur = await conn.execute(
            "SELECT current_setting('statement_timeout') AS st, current_setting('lock_timeout') AS lt, "
            "current_setting('idle_in_transaction_session_timeout') AS it, "
            "current_setting('tcp_keepalives_idle') AS ki, current_setting('tcp_keepalives_interval') AS kv, "
            "current_setting('tcp_keepalives_count') AS kc, current_setting('tcp_user_timeout') AS ut")
        assert await cur.fetchone() == {"st": "30s", "lt": "10s", "it": "1min", "ki": "4", "kv": "2", "kc": "3",
                                        "ut": "10000"}
    finally:
        await conn.close()
    explicit = make_conninfo(settings.database_url, options="-c statement_timeout=1234")
    conn = await connect(explicit, name="connect-under-test", settings=settings, server_keepalive=False)
    try:
        cur = await conn.execute("SELECT current_setting('statement_timeout') AS st, "
                                 "current_setting('tcp_keepalives_idle') AS ki")
        row = await cur.fetchone()
        assert row is not None and row["st"] == "1234ms"  # the URL's own wins
        assert row["ki"] != "4"  # the server's default (0: the kernel's), not ours
    finally:
        await conn.close()


async def test_a_multi_host_url_fails_over_to_the_writable_host(settings: Settings) -> None:
    """libpq does the choosing: the first host refuses, the second (the real server) is read-write."""
    params = conninfo_to_dict(settings.database_url)
    multi = make_conninfo(settings.database_url, host=f"127.0.0.1,{params.get('host') or '127.0.0.1'}",
                          port=f"1,{params.get('port') or 5432}", target_session_attrs="read-write")
    failover = replace(settings, database_url=multi)
    async with open_pool(failover, name="multi-host", min_size=1, max_size=1) as pool, pool.connection() as conn:
        cur = await conn.execute("SELECT pg_is_in_recovery() AS standby")
        assert await cur.fetchone() == {"standby": False}
    conn = await connect(multi, name="multi-host", settings=failover)
    try:
        assert conn.info.port == int(params.get("port") or 5432)
    finally:
        await conn.close()
    assert await ensure_database(multi) is False  # the database exists; found through the second host


async def test_connect_gives_up_on_an_unreachable_host_after_its_connect_timeout(settings: Settings) -> None:
    """A host that never answers (a black hole: TEST-NET-1 is not routed) costs connect_timeout, not minutes."""
    quick = replace(settings, db_connect_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        await asyncio.wait_for(connect(make_conninfo(settings.database_url, host="192.0.2.1"), settings=quick), 20)
    assert time.monotonic() - started < 6
