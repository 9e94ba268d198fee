"""Template databases for the per-test databases: one per migration set, named after its fingerprint.

A session holds its template's advisory lock shared for as long as it runs. Clearing stale templates
drops only one whose lock it can take exclusively and that nobody is connected to, so a template
another session (another checkout, another migration set) still clones from is never dropped."""

from __future__ import annotations

import asyncio

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from libs.db.migrate import migrate
from tests.support.env import schema_fingerprint

TEMPLATE_PREFIX = "mon_tpl_"
_BUILD_LOCK = 7401552099

_HOLD = "SELECT pg_advisory_lock_shared(hashtextextended(%(name)s, 0))"
_TRY_EXCLUSIVE = "SELECT pg_try_advisory_lock(hashtextextended(%(name)s, 0))"
_RELEASE_EXCLUSIVE = "SELECT pg_advisory_unlock(hashtextextended(%(name)s, 0))"
_OTHER_TEMPLATES = "SELECT datname FROM pg_database WHERE starts_with(datname, %(prefix)s) AND datname <> %(keep)s"

AdminConn = psycopg.Connection[tuple[object, ...]]


def hold_template(conn: AdminConn, name: str) -> None:
    """Mark `name` in use for as long as `conn` stays open."""
    conn.execute(_HOLD, {"name": name})


def prepare_template(conn: AdminConn, database_url: str) -> str:
    """The current migration set's template, built if missing and held on `conn`; stale ones dropped."""
    name = f"{TEMPLATE_PREFIX}{schema_fingerprint()}"
    hold_template(conn, name)
    # One session at a time builds the template and clears stale ones.
    conn.execute("SELECT pg_advisory_lock(%s)", (_BUILD_LOCK,))
    try:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            asyncio.run(migrate(make_conninfo(database_url, dbname=name)))
            conn.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(sql.Identifier(name)))
        drop_stale_templates(conn, keep=name)
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (_BUILD_LOCK,))
    return name


def drop_stale_templates(conn: AdminConn, *, keep: str) -> list[str]:
    """Drop the `mon_tpl_*` databases other than `keep`, skipping any a session holds or that cannot be
    dropped (a clone from it in progress, say). Returns the names dropped."""
    dropped: list[str] = []
    others = [str(row[0]) for row in conn.execute(_OTHER_TEMPLATES, {"prefix": TEMPLATE_PREFIX, "keep": keep})]
    for name in others:
        free = conn.execute(_TRY_EXCLUSIVE, {"name": name}).fetchone()
        if not free or not free[0]:
            continue
        try:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
            dropped.append(name)
        except psycopg.Error:
            pass
        finally:
            conn.execute(_RELEASE_EXCLUSIVE, {"name": name})
    return dropped
