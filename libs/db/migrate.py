"""Numbered plain-SQL migrations, applied in order under an advisory lock.

A migration runs in one transaction, unless its leading comments carry the header

    -- migrate: no-transaction

Such a migration (what Postgres refuses inside a transaction block: `CREATE INDEX CONCURRENTLY`, `DROP INDEX
CONCURRENTLY`, `ALTER TABLE .. DETACH PARTITION .. CONCURRENTLY`, and partition attaches that should not hold one long
lock) runs one statement at a time, each committed on its own, so no big table is locked for the length of a build
during a rolling deploy. It is recorded as applied only after its last statement, so a run that failed half-way runs
it again from the start: its statements must be idempotent (`IF NOT EXISTS`, `IF EXISTS`; a `CREATE INDEX` in one is
refused without `IF NOT EXISTS`). A concurrent index build that failed leaves an INVALID index of that name behind,
which `IF NOT EXISTS` would then take for done: before each concurrent build the runner drops an invalid index of the
name it builds (`DROP INDEX CONCURRENTLY`), so the re-run builds it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pglast
from pglast import ast
from psycopg import sql

from libs.db.pool import Conn, connect

log = logging.getLogger("migrate")

# Arbitrary constant: every `migrate` run serialises on it, so two concurrent runs are safe.
MIGRATION_LOCK_KEY = 7_401_552_001
# How often a run waiting for another run's lock tries again (see `_lock`).
LOCK_POLL_S = 0.2

_NAME = re.compile(r"^(\d{3,})_([a-z0-9_]+)\.sql$")
_NO_TRANSACTION = re.compile(r"^--\s*migrate:\s*no-transaction\s*$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def transactional(self) -> bool:
        """False when the leading comment lines carry `-- migrate: no-transaction`."""
        for line in self.sql.splitlines():
            text = line.strip()
            if not text:
                continue
            if not text.startswith("--"):
                return True
            if _NO_TRANSACTION.match(text):
                return False
        return True

    def statements(self) -> list[str]:
        """The migration's statements, split by Postgres's own parser (dollar quotes, comments and all)."""
        return list(pglast.split(self.sql))


@dataclass(frozen=True, slots=True)
class ConcurrentIndex:
    """A `CREATE INDEX CONCURRENTLY` of a no-transaction migration: the index it builds."""

    schema: str | None
    name: str


def concurrent_index(statement: str) -> ConcurrentIndex | None:
    """The index a statement builds concurrently, if it is such a build."""
    for raw in pglast.parse_sql(statement):
        stmt = raw.stmt
        if isinstance(stmt, ast.IndexStmt) and stmt.concurrent and stmt.idxname:
            return ConcurrentIndex(stmt.relation.schemaname if stmt.relation else None, stmt.idxname)
    return None


def _check(migration: Migration) -> None:
    """A no-transaction migration runs again from its start after a failure: its index builds must say IF NOT
    EXISTS (a plain CREATE INDEX would fail the re-run on the index the first run built)."""
    if migration.transactional:
        return
    for statement in migration.statements():
        for raw in pglast.parse_sql(statement):
            stmt = raw.stmt
            if isinstance(stmt, ast.IndexStmt) and not stmt.if_not_exists:
                raise ValueError(f"migration {migration.version:03d}_{migration.name} runs without a transaction: "
                                 f"its CREATE INDEX {stmt.idxname or ''} must say IF NOT EXISTS (it may run twice)")


def migrations_dir() -> Path:
    override = os.environ.get("MIGRATIONS_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "migrations"


def load_migrations(directory: Path | None = None) -> list[Migration]:
    folder = directory or migrations_dir()
    found: list[Migration] = []
    for path in sorted(folder.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise ValueError(f"migration file name {path.name!r} must look like 001_name.sql")
        migration = Migration(int(match.group(1)), match.group(2), path.read_text())
        _check(migration)
        found.append(migration)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError("two migrations share a version number")
    return found


CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version     int         PRIMARY KEY,
    name        text        NOT NULL,
    checksum    varchar(64) NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)
"""
RECORD = "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)"
# An index of this name (in this schema, else the first of the search path) that a failed concurrent build left
# INVALID.
INVALID_INDEX = """
SELECT n.nspname AS schema, c.relname AS name
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = %(name)s AND n.nspname = coalesce(%(schema)s, current_schema()) AND NOT i.indisvalid
"""


async def _lock(conn: Conn) -> None:
    """Take the migration lock, polling: a session waiting in pg_advisory_lock holds a snapshot, and a concurrent index
    build of the run holding the lock waits for every such snapshot to go (a deadlock the server would break by
    failing one of the two)."""
    waited_since = time.monotonic()
    while True:
        cur = await conn.execute("SELECT pg_try_advisory_lock(%s) AS locked", (MIGRATION_LOCK_KEY,))
        row = await cur.fetchone()
        if row is not None and row["locked"]:
            return
        if time.monotonic() - waited_since > 30:
            log.info("waiting for another migration run to finish")
            waited_since = time.monotonic()
        await asyncio.sleep(LOCK_POLL_S)


async def _apply_in_transaction(conn: Conn, migration: Migration) -> None:
    async with conn.transaction():
        await conn.execute(sql.SQL(migration.sql))  # type: ignore[arg-type]
        await conn.execute(RECORD, (migration.version, migration.name, migration.checksum))


async def _apply_without_transaction(conn: Conn, migration: Migration) -> None:
    """Each statement committed on its own (the connection is in autocommit); an INVALID index a failed concurrent build
    left is dropped before the build runs again; the ledger row last."""
    for statement in migration.statements():
        index = concurrent_index(statement)
        if index is not None:
            cur = await conn.execute(INVALID_INDEX, {"schema": index.schema, "name": index.name})
            invalid = await cur.fetchone()
            if invalid is not None:
                log.warning("dropping an invalid index a failed concurrent build left",
                            extra={"version": migration.version, "index": f"{invalid['schema']}.{invalid['name']}"})
                await conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}.{}").format(
                    sql.Identifier(invalid["schema"]), sql.Identifier(invalid["name"])))
        await conn.execute(sql.SQL(statement))  # type: ignore[arg-type]
    await conn.execute(RECORD, (migration.version, migration.name, migration.checksum))


async def migrate(database_url: str, directory: Path | None = None) -> list[Migration]:
    """Apply pending migrations; returns those applied (empty when nothing was pending)."""
    pending_applied: list[Migration] = []
    migrations = load_migrations(directory)
    conn = await connect(database_url, name="migrate", with_session_timeouts=False)
    try:
        await _lock(conn)
        try:
            await conn.execute(CREATE_LEDGER)
            cur = await conn.execute("SELECT version, checksum FROM schema_migrations")
            applied = {row["version"]: row["checksum"] for row in await cur.fetchall()}
            for migration in migrations:
                if migration.version in applied:
                    if applied[migration.version] != migration.checksum:
                        raise RuntimeError(
                            f"migration {migration.version:03d}_{migration.name} changed after it was applied"
                        )
                    continue
                if migration.transactional:
                    await _apply_in_transaction(conn, migration)
                else:
                    await _apply_without_transaction(conn, migration)
                log.info("migration applied", extra={"version": migration.version, "name": migration.name,
                                                     "transactional": migration.transactional})
                pending_applied.append(migration)
        finally:
            await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    finally:
        await conn.close()
    return pending_applied


async def ensure_database(database_url: str) -> bool:
    """Create the database named in the URL if it does not exist; True when created."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(database_url)
    dbname = str(params.get("dbname") or "postgres")
    admin_url = make_conninfo(database_url, dbname="postgres")
    conn = await connect(admin_url, name="migrate", with_session_timeouts=False)
    try:
        cur = await conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
        if await cur.fetchone():
            return False
        await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        return True
    finally:
        await conn.close()
