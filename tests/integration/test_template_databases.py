"""Stale template databases are cleared at session start, but never one a session holds or uses."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests.support.env import Backends
from tests.support.templates import TEMPLATE_PREFIX, drop_stale_templates, hold_template


def _connect(url: str, dbname: str = "postgres") -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(make_conninfo(url, dbname=dbname), autocommit=True)


def _exists(conn: psycopg.Connection[tuple[object, ...]], name: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


@pytest.fixture
def stale(backend: Backends) -> Iterator[str]:
    """An old-fingerprint template (dropped again if the test leaves it)."""
    name = f"{TEMPLATE_PREFIX}stale{uuid.uuid4().hex[:8]}"
    with _connect(backend.database_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield name
        finally:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_held_or_used_templates_survive_and_free_ones_go(backend: Backends, template_db: str, stale: str) -> None:
    with _connect(backend.database_url) as admin:
        with _connect(backend.database_url) as other_session:
            hold_template(other_session, stale)
            assert stale not in drop_stale_templates(admin, keep=template_db)
            assert _exists(admin, stale)
        with _connect(backend.database_url, stale):   # someone connected to it (a clone in progress, say)
            assert stale not in drop_stale_templates(admin, keep=template_db)
            assert _exists(admin, stale)
        drop_stale_templates(admin, keep=template_db)
        assert not _exists(admin, stale)
        # The current template is never a candidate, held or not.
        assert _exists(admin, template_db)
        assert template_db not in drop_stale_templates(admin, keep=template_db)
