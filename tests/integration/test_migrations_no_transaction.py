"""Non-transactional migrations (`-- migrate: no-transaction`): a concurrent index build while a writer keeps writing
the table, and a re-run after a failed concurrent build (the INVALID index it left is rebuilt, not taken for done)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import make_conninfo

from libs.db.migrate import ensure_database, migrate
from libs.db.pool import connect
from tests.support.env import Backends

# The index expression sleeps 1 ms a row: building it over ROWS rows takes at least ROWS ms whatever the machine's
# load, which is how long a build that locks the table blocks its writers.
ROWS = 1_000
TABLE = f"""
CREATE TABLE events (id bigserial PRIMARY KEY, k int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION slow_key(v int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS
$$ BEGIN PERFORM pg_sleep(0.001); RETURN v; END $$;
INSERT INTO events (k) SELECT g FROM generate_series(1, {ROWS}) g;
"""
CONCURRENT = """-- migrate: no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_events_slow_key ON events (slow_key(k));
"""
LOCKING = "CREATE INDEX IF NOT EXISTS ix_events_slow_key ON events (slow_key(k));\n"
# A writer's insert may wait this long at most while the concurrent build runs (its waits are for the writer's own
# short transactions); the locking build holds every insert for the whole build, ROWS ms or more.
STALL_BOUND_S = 0.5


@pytest.fixture
async def empty_database(backend: Backends) -> AsyncIterator[str]:
    name = f"mon_m_{uuid.uuid4().hex[:12]}"
    url = make_conninfo(backend.database_url, dbname=name)
    await ensure_database(url)
    try:
        yield url
    finally:
        admin = await connect(make_conninfo(backend.database_url, dbname="postgres"))
        await admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        await admin.close()


async def _write_until(url: str, stop: asyncio.Event, going: asyncio.Event,
                       latencies: list[tuple[float, float]]) -> None:
    """Insert one row at a time (each its own transaction, ~150 a second) until `stop`; (commit time, latency) of
    each."""
    conn = await connect(url, name="writer")
    try:
        while not stop.is_set():
            started = time.monotonic()
            await conn.execute("INSERT INTO events (k) VALUES (0)")
            done = time.monotonic()
            latencies.append((done, done - started))
            if len(latencies) >= 20:
                going.set()
            await asyncio.sleep(0.005)  # pacing: every row it writes makes the build evaluate the slow key once more
    finally:
        await conn.close()


async def _migrate_while_writing(url: str, folder: Path, index_migration: str) -> tuple[float, int]:
    """Apply the table's migration, then the index's while a writer writes: (the writer's longest insert in seconds,
    inserts committed while the index migration ran)."""
    (folder / "001_events.sql").write_text(TABLE)
    await migrate(url, folder)
    (folder / "002_events_index.sql").write_text(index_migration)
    stop, going, latencies = asyncio.Event(), asyncio.Event(), []  # type: ignore[var-annotated]
    writer = asyncio.create_task(_write_until(url, stop, going, latencies))
    await asyncio.wait_for(going.wait(), timeout=10)
    started = time.monotonic()
    applied = await migrate(url, folder)
    finished = time.monotonic()
    await asyncio.sleep(0.05)  # an insert held by the build ends just after it: let its latency be recorded
    stop.set()
    await writer
    assert [m.version for m in applied] == [2]
    during = [lat for at, lat in latencies if started <= at <= finished]
    longest = max(lat for at, lat in latencies if at >= started)
    conn = await connect(url)
    try:
        cur = await conn.execute("SELECT i.indisvalid AS valid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                                 "WHERE c.relname = 'ix_events_slow_key'")
        row = await cur.fetchone()
        assert row is not None and row["valid"], "the index must exist and be valid"
    finally:
        await conn.close()
    return longest, len(during)


async def test_a_concurrent_index_build_does_not_block_the_writers(empty_database: str, tmp_path: Path) -> None:
    longest, during = await _migrate_while_writing(empty_database, tmp_path, CONCURRENT)
    assert longest < STALL_BOUND_S, f"an insert waited {longest:.2f} s for the concurrent index build"
    assert during > 10, f"only {during} inserts committed during the build"


async def test_the_stall_bound_catches_a_locking_index_build(empty_database: str, tmp_path: Path) -> None:
    """The check above fails on the same build run in a transaction (CREATE INDEX, not CONCURRENTLY)."""
    longest, _ = await _migrate_while_writing(empty_database, tmp_path, LOCKING)
    assert longest >= STALL_BOUND_S, f"a locking build held the writer only {longest:.2f} s"


async def test_a_failed_concurrent_build_is_rebuilt_on_the_next_run(empty_database: str, tmp_path: Path) -> None:
    (tmp_path / "001_keys.sql").write_text(
        "CREATE TABLE keys (id bigserial PRIMARY KEY, k int NOT NULL);\nINSERT INTO keys (k) VALUES (1), (1), (2);\n")
    (tmp_path / "002_keys_unique.sql").write_text(
        "-- migrate: no-transaction\nCREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS ux_keys_k ON keys (k);\n")
    with pytest.raises(pg_errors.UniqueViolation):
        await migrate(empty_database, tmp_path)
    conn = await connect(empty_database)
    try:
        valid = ("SELECT i.indisvalid AS valid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                 "WHERE c.relname = 'ux_keys_k'")
        row = await (await conn.execute(valid)).fetchone()
        assert row is not None and not row["valid"], "the failed build leaves an INVALID index behind"
        cur = await conn.execute("SELECT version FROM schema_migrations ORDER BY 1")
        assert [r["version"] for r in await cur.fetchall()] == [1], "a failed migration is not recorded"
        await conn.execute("DELETE FROM keys WHERE id = (SELECT max(id) FROM keys WHERE k = 1)")
        # IF NOT EXISTS alone would skip the invalid index and record the migration as done.
        assert [m.version for m in await migrate(empty_database, tmp_path)] == [2]
        row = await (await conn.execute(valid)).fetchone()
        assert row is not None and row["valid"]
        with pytest.raises(pg_errors.UniqueViolation):
            await conn.execute("INSERT INTO keys (k) VALUES (2)")
        assert await migrate(empty_database, tmp_path) == []
    finally:
        await conn.close()
