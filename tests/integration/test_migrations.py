"""`monitorctl migrate`: ordered, locked, idempotent, and loud about edited migrations."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from libs.db.migrate import ensure_database, load_migrations, migrate
from libs.db.pool import connect
from tests.support.env import Backends


@pytest.fixture
async def empty_database(backend: Backends):
    name = f"mon_m_{uuid.uuid4().hex[:12]}"
    url = make_conninfo(backend.database_url, dbname=name)
    assert await ensure_database(url) is True
    assert await ensure_database(url) is False
    try:
        yield url
    finally:
        admin = await connect(make_conninfo(backend.database_url, dbname="postgres"))
        await admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        await admin.close()


async def test_two_concurrent_runs_apply_each_migration_once(empty_database: str) -> None:
    first, second = await asyncio.gather(migrate(empty_database), migrate(empty_database))
    applied = sorted(m.version for m in [*first, *second])
    assert applied == [m.version for m in load_migrations()]
    assert await migrate(empty_database) == [], "a second run must be a no-op"
    conn = await connect(empty_database)
    try:
        cur = await conn.execute("SELECT count(*) AS n FROM schema_migrations")
        row = await cur.fetchone()
        assert row is not None and row["n"] == len(load_migrations())
        cur = await conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'uq_desktop_tasks_monitor_active'")
        index = await cur.fetchone()
        assert index is not None and "WHERE" in index["indexdef"] and "unknown" in index["indexdef"]
    finally:
        await conn.close()


async def test_an_edited_applied_migration_is_refused(empty_database: str, tmp_path: Path) -> None:
    await migrate(empty_database)
    for migration in load_migrations():
        text = migration.sql + ("\n-- edited after release\n" if migration.version == 1 else "")
        (tmp_path / f"{migration.version:03d}_{migration.name}.sql").write_text(text)
    with pytest.raises(RuntimeError, match="changed after it was applied"):
        await migrate(empty_database, tmp_path)


async def test_business_key_and_write_matrix_are_enforced(pool) -> None:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT conname FROM pg_constraint WHERE conname = 'ck_collect_tasks_write_matrix'")
        assert await cur.fetchone() is not None
        cur = await conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'uq_monitoring_collect_tasks_business_key'")
        row = await cur.fetchone()
        assert row is not None and "UNIQUE" in row["indexdef"]
        for column in ("tenant_id", "brand_id", "question_id", "ai_platform_id", "collector_type", "run_mode",
                       "business_date"):
            assert column in row["indexdef"]
