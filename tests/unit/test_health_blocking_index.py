"""Migration 070's partial index over the blocking clients and the code's notion of a blocking client agree: the
index's predicate is the store's HEALTH_BLOCKING_SQL (the planner uses a partial index only for a query that repeats
its predicate), and the states both name are libs.domain.platform_health.BLOCKING_STATES. (The database's own
evaluation of the predicate against the domain's reading of reports: tests/integration/test_dispatch_client_window.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

from libs.db.migrate import Migration
from libs.domain.platform_health import BLOCKING_STATES
from libs.tasks.dispatch_reads import HEALTH_BLOCKING_SQL

MIGRATION = Path(__file__).resolve().parents[2] / "migrations" / "070_clients_health_blocking.sql"
_INDEX = re.compile(r"CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_clients_health_blocking ON desktop_clients "
                    r"\(tenant_id\)\s+WHERE (?P<predicate>.+?);?\s*$", re.S)
_STATE = re.compile(r'@ == "([a-z_]+)"')


def _predicate(migration_text: str) -> str:
    """The predicate of the migration's index build (its one statement), whitespace as one space."""
    (statement,) = Migration(70, "clients_health_blocking", migration_text).statements()
    found = _INDEX.match(statement.strip())
    assert found, statement
    return " ".join(found["predicate"].split())


def problems(migration_text: str, code_predicate: str, states: frozenset[str]) -> list[str]:
    """What keeps the migration's index from serving the code's statement, or from holding every blocking client."""
    index = _predicate(migration_text)
    code = " ".join(code_predicate.replace("c.platform_health", "platform_health").split())
    out: list[str] = []
    if index != code:
        out.append(f"the index's predicate {index!r} is not the code's {code!r}")
    if set(_STATE.findall(index)) != set(states):
        out.append(f"the index names {sorted(set(_STATE.findall(index)))}, the domain blocks on {sorted(states)}")
    return out


def test_the_migrations_index_is_over_the_codes_blocking_clients() -> None:
    text = MIGRATION.read_text()
    assert not Migration(70, "clients_health_blocking", text).transactional  # CONCURRENTLY: outside a transaction
    assert problems(text, HEALTH_BLOCKING_SQL, BLOCKING_STATES) == []


def test_a_new_blocking_state_or_another_spelling_is_caught() -> None:
    text = MIGRATION.read_text()
    # The domain learns a state the index does not hold: clients reporting only it would be missing from the index.
    assert len(problems(text, HEALTH_BLOCKING_SQL.replace('")', '" || @ == "banned")'),
                        BLOCKING_STATES | {"banned"})) == 2
    # The same states in another order: the planner would no longer match the index to the statement.
    reordered = text.replace('@ == "captcha" || @ == "login_required"', '@ == "login_required" || @ == "captcha"')
    assert reordered != text
    assert [p for p in problems(reordered, HEALTH_BLOCKING_SQL, BLOCKING_STATES) if "not the code's" in p]
