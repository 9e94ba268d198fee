"""§10.5 per-mode interrupt timeouts in the coordinator: a client whose interrupted execution runs in OpenAI's deep
reasoning mode (soft 60 s) is not yet overdue at 20 s, while one in the quick mode (soft 15 s) is, and no new normal
goes to it."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.dispatch_settings import load_settings
from services.dispatch_coordinator.dispatcher import read_snapshot
from tests.support.reconcile_factory import heartbeat, insert_execution, insert_moded_task, make_world


async def test_the_soft_timeout_of_an_interrupted_execution_is_its_modes(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        w = await make_world(conn, clients=2)
        for index, (client, mode) in enumerate(zip(w.clients, ("deep_reasoning", "quick"), strict=True)):
            await heartbeat(conn, client, seconds_ago=1)
            await conn.execute("UPDATE desktop_clients SET online = true WHERE id = %s", (client,))
            task = await insert_moded_task(conn, w, question_index=index, mode=mode)
            await insert_execution(conn, w, task, client, interrupted_ago=20)
        snapshot = await read_snapshot(conn, await load_settings(conn))
    overdue = {c.id: c.interrupt_overdue for c in snapshot.clients}
    deep, quick = w.clients
    assert overdue == {deep: False, quick: True}, overdue
