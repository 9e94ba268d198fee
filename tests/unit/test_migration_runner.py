"""The migration runner's reading of a migration: the no-transaction header, statements split by Postgres's parser,
the concurrent index builds it must guard, and the refusal of a re-run-unsafe index build."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.db.migrate import ConcurrentIndex, Migration, concurrent_index, load_migrations

NO_TX = """-- Builds an index without locking writes.
-- migrate: no-transaction

CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_a ON a (x);
CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END; $$;
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS ix_b ON s.b (y);
"""


def test_the_header_in_the_leading_comments_makes_a_migration_non_transactional() -> None:
    assert not Migration(1, "a", NO_TX).transactional
    assert Migration(1, "a", "-- an ordinary one\nCREATE TABLE a (x int);").transactional
    # Only the leading comment block counts: the words later in the file are not a header.
    assert Migration(1, "a", "CREATE TABLE a (x int);\n-- migrate: no-transaction\n").transactional


def test_statements_are_split_by_the_postgres_parser() -> None:
    statements = Migration(1, "a", NO_TX).statements()
    assert len(statements) == 3
    assert statements[1].endswith("$$ BEGIN RETURN 1; END; $$")  # the semicolons inside the body stay in it


def test_concurrent_builds_are_found_with_their_schema() -> None:
    found = [concurrent_index(s) for s in Migration(1, "a", NO_TX).statements()]
    assert found == [ConcurrentIndex(None, "ix_a"), None, ConcurrentIndex("s", "ix_b")]
    assert concurrent_index("CREATE INDEX ix_c ON a (x)") is None


def test_a_no_transaction_index_build_without_if_not_exists_is_refused(tmp_path: Path) -> None:
    (tmp_path / "001_ok.sql").write_text(NO_TX)
    assert [m.version for m in load_migrations(tmp_path)] == [1]
    (tmp_path / "002_unsafe.sql").write_text("-- migrate: no-transaction\nCREATE INDEX CONCURRENTLY ix_d ON a (x);\n")
    with pytest.raises(ValueError, match="IF NOT EXISTS"):
        load_migrations(tmp_path)


def test_the_repository_migrations_load() -> None:
    assert load_migrations()
