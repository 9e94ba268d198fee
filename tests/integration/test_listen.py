"""libs.db.listen against real Postgres: payloads delivered, and a killed LISTEN connection comes back."""

from __future__ import annotations

import asyncio

from psycopg_pool import AsyncConnectionPool

from libs.db.listen import listen_forever
from libs.db.pool import Conn
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
