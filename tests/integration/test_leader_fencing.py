"""Leader fencing (libs/leader.py, migration 024): a deposed leader that has not noticed yet cannot commit, a write
it started before the takeover holds the takeover back, and every table carries the fence."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn, make_pool
from libs.leader import LeaderLock, fence_pools, is_fenced
from tests.support.wait import eventually

ROLE = "dispatch-coordinator"
# Every statement-level fence check fires even when the statement matches no row.
LEADER_WRITE = "UPDATE tenants SET id = id WHERE false"

UNFENCED_TABLES = """
SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND c.relname NOT IN ('leader_terms', 'schema_migrations')
  AND NOT EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = c.oid AND t.tgname = 'leader_fence')
ORDER BY 1
"""


async def _unfenced_tables(pool: AsyncConnectionPool[Conn]) -> list[str]:
    async with pool.connection() as conn:
        cur = await conn.execute(UNFENCED_TABLES)
        return [row["relname"] for row in await cur.fetchall()]


@contextlib.asynccontextmanager
async def _leading(settings: Settings, holder: str, **timing: float) -> AsyncIterator[tuple[LeaderLock, Any]]:
    pool = make_pool(settings, name=f"fenced-{holder}", min_size=1, max_size=2)
    await pool.open(wait=True)
    lock = LeaderLock(settings.database_url, ROLE, holder=holder, fenced=[pool], retry_interval=0.1, **timing)
    stop = asyncio.Event()

    async def lead(leading_stop: asyncio.Event) -> None:
        await leading_stop.wait()

    task = asyncio.create_task(lock.run(stop, lead))
    try:
        yield lock, pool
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await pool.close()


async def _terminate_lock_session(pool: AsyncConnectionPool[Conn]) -> None:
    """The lock's session ends as when the server gives up on a silent node: its lock is free at once."""
    async with pool.connection() as conn:
        await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE application_name = %s AND datname = current_database()", (f"{ROLE}-leader",))


async def _write(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        await conn.execute(LEADER_WRITE)


# A leader that notices a lost lock only after 8 s: long enough for the test to act as its successor.
SLOW_TO_NOTICE = {"check_interval": 5.0, "renew_deadline": 8.0, "lease_seconds": 12.0}


async def test_a_deposed_leader_cannot_write_after_its_successor_took_a_term(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    # `deposed`: the pooled sessions of a leader that has not noticed its loss (they keep its term).
    deposed = make_pool(settings, name="deposed", min_size=1, max_size=1)
    await deposed.open(wait=True)
    try:
        async with _leading(settings, "old") as (old, old_pool):
            await eventually(old.is_leader.is_set, message="the first replica leading")
            first_term = old.term
            assert first_term is not None
            await fence_pools([deposed], ROLE, first_term, 12.0)
            await _write(old_pool)  # the leader's own term: accepted
            await _write(deposed)
            await _terminate_lock_session(pool)
            async with _leading(settings, "new") as (new, new_pool):
                await eventually(new.is_leader.is_set, timeout=5, message="the standby leading")
                assert new.term == first_term + 1
                with pytest.raises(psycopg.Error) as refused:
                    await _write(deposed)
                assert is_fenced(refused.value), refused.value
                await _write(new_pool)
                # The old replica stepped down: its sessions carry no term, a standby's ordinary writes pass.
                await eventually(lambda: not old.is_leader.is_set(), timeout=5, message="the old one stepping down")
                await _write(old_pool)
    finally:
        await deposed.close()


async def test_a_write_started_before_the_takeover_holds_the_new_term_back(
        settings: Settings, pool: AsyncConnectionPool[Conn]) -> None:
    async with _leading(settings, "old", **SLOW_TO_NOTICE) as (old, old_pool):
        await eventually(old.is_leader.is_set, message="the first replica leading")
        async with old_pool.connection() as conn:
            async with conn.transaction():
                await conn.execute(LEADER_WRITE)  # the fence's share lock on the term, until this commits
                await _terminate_lock_session(pool)
                async with _leading(settings, "new") as (new, _):
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(new.is_leader.wait(), 1.5)
                    # Committing lets the takeover through; the old term's write is ordered before it.
                    await conn.execute("COMMIT")
                    await conn.execute("BEGIN")
                    await eventually(new.is_leader.is_set, timeout=5, message="the takeover after the commit")
                    with pytest.raises(psycopg.Error) as refused:
                        await conn.execute(LEADER_WRITE)
                    assert is_fenced(refused.value)


async def test_every_table_carries_the_fence_and_the_check_catches_one_that_does_not(
        pool: AsyncConnectionPool[Conn]) -> None:
    assert await _unfenced_tables(pool) == []
    async with pool.connection() as conn:
        await conn.execute("CREATE TABLE fence_probe (id int)")
    assert await _unfenced_tables(pool) == ["fence_probe"]


def test_the_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="check_interval < renew_deadline < lease_seconds"):
        LeaderLock("postgresql://unused", ROLE, check_interval=5, renew_deadline=4, lease_seconds=15)
