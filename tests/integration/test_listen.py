"""libs.db.listen against real Postgres: payloads delivered, and a killed or cut-off LISTEN connection comes back
(followed by a catch-up call) within about a second of the database being reachable."""

from __future__ import annotations

import asyncio
import time

from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from libs.db.listen import listen_forever
from libs.db.pool import Conn
from tests.support.tcpproxy import TcpProxy
from tests.support.wait import eventually


async def test_listen_delivers_payloads_and_reconnects_after_its_connection_dies(
        pool: AsyncConnectionPool[Conn], database_url: str) -> None:
    received: list[str | None] = []
    stop, listening = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(listen_forever(database_url, "listen_test", received.append, stop=stop,
                                              listening=listening, name="listen-under-test", meanwhile="waiting"))
    try:
        await asyncio.wait_for(listening.wait(), 10)
        async with pool.connection() as conn:
            await conn.execute("SELECT pg_notify('listen_test', 'p')")
        await eventually(lambda: received == [None, "p"], message="the connect call and the payload")

        async with pool.connection() as conn:  # the LISTEN connection dies (a failover, an idle timeout)
            await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE application_name = 'listen-under-test'")
        # Back, and the reconnect is reported (None) so the caller looks for what it missed.
        await eventually(lambda: received[-1] is None and len(received) == 3 and listening.is_set(),
                         message="reconnected")
        async with pool.connection() as conn:
            await conn.execute("SELECT pg_notify('listen_test', '')")
        await eventually(lambda: received[-1] == "", message="a notification after the reconnect")
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_listen_is_back_with_a_catch_up_within_seconds_of_an_outage(
        pool: AsyncConnectionPool[Conn], database_url: str) -> None:
    """The database unreachable for a few seconds (a TCP proxy cut): LISTEN retries at most a second apart, so
    it is back, and has called for a catch-up, within ~1 s of the restore (it waited up to 5 s before)."""
    params = conninfo_to_dict(database_url)
    proxy = TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    await proxy.start()
    received: list[str | None] = []
    stop, listening = asyncio.Event(), asyncio.Event()
    url = make_conninfo(database_url, host="127.0.0.1", port=str(proxy.port))
    task = asyncio.create_task(listen_forever(url, "listen_test", received.append, stop=stop, listening=listening,
                                              name="listen-through-proxy", meanwhile="waiting"))
    try:
        await asyncio.wait_for(listening.wait(), 10)
        await proxy.cut()
        await eventually(lambda: not listening.is_set(), message="the lost connection noticed")
        down_until = time.monotonic() + 6.0  # long enough for the old schedule to wait 3.2 s between attempts
        await eventually(lambda: time.monotonic() >= down_until, timeout=10, interval=0.5, message="the outage")
        assert received == [None] and not listening.is_set()
        await proxy.restore()
        await eventually(lambda: listening.is_set() and received == [None, None], timeout=2.0,
                         message="reconnected with a catch-up within 2 s of the restore")
        async with pool.connection() as conn:
            await conn.execute("SELECT pg_notify('listen_test', 'after')")
        await eventually(lambda: received[-1] == "after", message="a notification after the outage")
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await proxy.close()
