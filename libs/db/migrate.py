"""Numbered plain-SQL migrations, applied in order under an advisory lock."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from psycopg import sql

from libs.db.pool import connect

log = logging.getLogger("migrate")

# Arbitrary constant: every `migrate` run serialises on it, so two concurrent runs are safe.
MIGRATION_LOCK_KEY = 7_401_552_001

_NAME = re.compile(r"^(\d{3,})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


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
        found.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
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


async def migrate(database_url: str, directory: Path | None = None) -> list[Migration]:
    """Apply pending migrations; returns those applied (empty when nothing was pending)."""
    pending_applied: list[Migration] = []
    migrations = load_migrations(directory)
    conn = await connect(database_url, name="migrate", with_session_timeouts=False)
    try:
        await conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
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
                async with conn.transaction():
                    await conn.execute(sql.SQL(migration.sql))  # type: ignore[arg-type]
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                        (migration.version, migration.name, migration.checksum),
                    )
                log.info("migration applied", extra={"version": migration.version, "name": migration.name})
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
