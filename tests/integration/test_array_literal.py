"""libs/db/arrays.py: the one-text array parameter reads back in Postgres as the list it was made from."""

from __future__ import annotations

import uuid

from psycopg_pool import AsyncConnectionPool

from libs.db.arrays import array_literal
from libs.db.pool import Conn


async def test_uuid_and_bigint_literals_read_back_as_the_lists(pool: AsyncConnectionPool[Conn]) -> None:
    ids = [uuid.uuid4() for _ in range(3)]
    tenants = [1, 20, 9_000_000_000]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT %(ids)s::uuid[] AS ids, %(tenants)s::bigint[] AS tenants, "
                                 "cardinality(%(none)s::uuid[]) AS none",
                                 {"ids": array_literal(ids), "tenants": array_literal(tenants),
                                  "none": array_literal([])})
        row = await cur.fetchone()
    assert row is not None
    assert (row["ids"], row["tenants"], row["none"]) == (ids, tenants, 0)
