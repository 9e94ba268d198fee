"""`monitorctl db-roles` (libs/db/roles.py) on the real Postgres: a group role per service with exactly its grants,
idempotent, converging (a privilege granted by hand is revoked on the next run), and refusing what a role was not
granted. The whole stack under these roles (and per-service broker users): tests/deploy/test_least_privilege_e2e.py
(`make test-deploy`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.migrate import ensure_database, load_migrations, migrate
from libs.db.pool import Conn
from libs.db.roles import GRANTED_TO_NONE, GRANTS, SERVICES, apply_roles, drop_roles, role_name
from libs.tasks.retention import purge_history_batch
from tests.support.env import Backends
from tests.support.reconcile_factory import insert_task, make_world, today


@pytest.fixture
async def prefix(pool: AsyncConnectionPool[Conn]) -> AsyncIterator[str]:
    prefix = f"lpt{uuid.uuid4().hex[:8]}_"
    try:
        yield prefix
    finally:
        async with pool.connection() as conn:
            await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(prefix + "hub_login")))
            await drop_roles(conn, prefix)


async def _privileges(pool: AsyncConnectionPool[Conn], role: str) -> dict[str, set[str]]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT table_name, privilege_type FROM information_schema.role_table_grants "
                                 "WHERE grantee = %s", (role,))
        found: dict[str, set[str]] = {}
        for row in await cur.fetchall():
            found.setdefault(row["table_name"], set()).add(row["privilege_type"])
    return found


async def test_each_role_holds_exactly_its_grants_and_a_rerun_converges(
        pool: AsyncConnectionPool[Conn], prefix: str) -> None:
    async with pool.connection() as conn:
        await apply_roles(conn, prefix)
        hub = role_name(prefix, "dispatch-hub")
        # Something granted by hand (or by an older release's map) goes on the next run.
        await conn.execute(sql.SQL("GRANT DELETE ON outbox, question_monitor_runs TO {}").format(sql.Identifier(hub)))
        await apply_roles(conn, prefix)
    for service in SERVICES:
        expected = {table: set(privileges) for table, privileges in GRANTS[service].items()}
        assert await _privileges(pool, role_name(prefix, service)) == expected, service


async def test_every_table_of_the_schema_is_granted_to_a_service_or_said_to_be_nobodys(
        pool: AsyncConnectionPool[Conn]) -> None:
    """A migration's new table that no service's grants name would be refused to the service that uses it in a
    least-privilege deployment only: caught here instead."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                                 "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm') "
                                 "AND NOT c.relispartition")
        tables = {row["relname"] for row in await cur.fetchall()}
    granted = {table for grants in GRANTS.values() for table in grants}
    assert sorted(tables - granted - set(GRANTED_TO_NONE)) == [], ", ".join(sorted(tables - granted))
    assert sorted((granted | set(GRANTED_TO_NONE)) - tables) == [], "grants of tables that do not exist"


async def test_a_login_of_the_hub_role_works_on_its_tables_and_is_refused_elsewhere(
        settings: Settings, pool: AsyncConnectionPool[Conn], prefix: str) -> None:
    async with pool.connection() as conn:
        await apply_roles(conn, prefix)
        await conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
            sql.Identifier(prefix + "hub_login"), sql.Identifier(role_name(prefix, "dispatch-hub"))))
    url = make_conninfo(settings.database_url, user=prefix + "hub_login")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT count(*) FROM desktop_tasks")
        await conn.execute("UPDATE desktop_clients SET workspace_id = workspace_id WHERE false")
        for forbidden in ("INSERT INTO question_monitor_runs (tenant_id) VALUES (1)",  # an ingest table
                          "SELECT * FROM outbox",  # insert-only: the hub cannot read the backlog
                          "DELETE FROM desktop_tasks",  # no DELETE on the task tables
                          "TRUNCATE desktop_task_attempts",
                          "CREATE TABLE intruder (id int)",  # no DDL
                          "SELECT * FROM dispatch_budget_ledger"):  # written by triggers only, as their owner
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await conn.execute(forbidden)


def test_role_names_carry_the_prefix_and_refuse_a_bad_one() -> None:
    assert role_name("md_", "dispatch-hub") == "md_dispatch_hub"
    for bad in ("MD_", "1md_", 'md"; DROP ROLE postgres; --', ""):
        with pytest.raises(ValueError):
            role_name(bad, "dispatch-hub")
    with pytest.raises(ValueError):
        role_name("md_", "tenant-api")


async def test_the_migration_job_needs_no_superuser(backend: Backends) -> None:
    """What the migration Job does, as the role it runs with: a non-superuser owning the database (CREATEROLE for
    the group roles) applies every migration from an empty database, then sets the services' grants."""
    unique = uuid.uuid4().hex[:8]
    migrator, database, prefix = f"lpm{unique}_migrator", f"mon_t_lpm{unique}", f"lpm{unique}_"
    admin = make_conninfo(backend.database_url, dbname="postgres")
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE NOSUPERUSER").format(sql.Identifier(migrator)))
        await conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database),
                                                                        sql.Identifier(migrator)))
    url = make_conninfo(backend.database_url, dbname=database, user=migrator)
    try:
        assert not await ensure_database(url)
        applied = await migrate(url)
        assert applied and applied[-1].version == max(m.version for m in load_migrations())
        async with await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row) as conn:
            granted = await apply_roles(conn, prefix)
            assert set(granted) == set(SERVICES)
            cur = await conn.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'desktop_tasks'")
            assert (await cur.fetchone()) == {"tableowner": migrator}
    finally:
        async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
            for service in SERVICES:
                await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role_name(prefix, service))))
            await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(migrator)))


async def test_a_login_of_the_reconciler_role_deletes_old_business_tasks_and_not_without_its_grant(
        settings: Settings, pool: AsyncConnectionPool[Conn], prefix: str) -> None:
    """history_retention (libs/tasks/retention.py) under the reconciler's role: its DELETE on the business tasks is
    granted (a missing grant would only show in a least-privilege deployment, a year after the upgrade)."""
    async with pool.connection() as conn:
        await apply_roles(conn, prefix)
        await conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
            sql.Identifier(prefix + "hub_login"),  # the login name the fixture drops
            sql.Identifier(role_name(prefix, "reconciler"))))
        world = await make_world(conn, questions=2)
        for question in (0, 1):
            await insert_task(conn, world, question_index=question, status="completed",
                              business_date=today() - timedelta(days=500))
    url = make_conninfo(settings.database_url, user=prefix + "hub_login")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row) as conn:
        purged = await purge_history_batch(conn, execution_days=35, request_days=35, business_days=400, batch=1)
        assert purged.business_tasks == 1
        async with pool.connection() as admin:
            await admin.execute(sql.SQL("REVOKE DELETE ON monitoring_collect_tasks FROM {}").format(
                sql.Identifier(role_name(prefix, "reconciler"))))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await purge_history_batch(conn, execution_days=35, request_days=35, business_days=400, batch=1)
