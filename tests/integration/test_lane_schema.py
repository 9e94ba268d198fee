"""The migrated schema agrees with the lane table (libs/domain/lanes.py): every CHECK constraint on a lane column,
every partial index, trigger and function that compares a lane holds exactly the lanes the table says, read back
from the catalog of a freshly migrated database. A migration that adds a lane comparison says here which lanes it
stands for (`EXPECTED`); one the table no longer matches (a lane added to LANE_SPECS without its migration, or to a
migration without the table) fails with the object and the lanes missing or extra."""

from __future__ import annotations

import re
from collections.abc import Callable

from libs.db.pool import Conn, connect
from libs.domain.lanes import AGING_LANES_SQL, LANE_SPECS, LaneSpec

Specs = tuple[LaneSpec, ...]


def _monitor(specs: Specs, where: Callable[[LaneSpec], bool] = lambda s: True) -> frozenset[str]:
    return frozenset(s.name for s in specs if s.kind == "monitor" and where(s))


# Each schema object that compares a lane, and the lanes it must hold, from a lane table.
EXPECTED: dict[str, Callable[[Specs], frozenset[str]]] = {
    # The lane columns hold a lane of their kind: business tasks and legacy offers are monitor work, executions
    # are of either kind.
    "check monitoring_collect_tasks_dispatch_lane_check": _monitor,
    "check legacy_leases_lane_check": _monitor,
    "check desktop_tasks_lane_check": lambda specs: frozenset(s.name for s in specs),
    # Aging's walk (migrations 021, 023): the ready tasks of the lanes that age.
    "index ix_collect_tasks_aging": lambda specs: _monitor(specs, lambda s: s.ages),
    # The budget ledger's lane class (migrations 021, 023): work that counts against the cluster budget only.
    "function dispatch_budget_ledger_rows": lambda specs: _monitor(specs, lambda s: s.budget_exempt),
    "function dispatch_budget_ledger_update": lambda specs: _monitor(specs, lambda s: s.budget_exempt),
    "trigger tr_desktop_tasks_budget_update": lambda specs: _monitor(specs, lambda s: s.budget_exempt),
    "trigger tr_legacy_leases_budget_update": lambda specs: _monitor(specs, lambda s: s.budget_exempt),
}

# A lane comparison as the catalog deparses it (`(dispatch_lane)::text = ANY ((ARRAY['a'::character varying, ...`,
# `(old.lane)::text = 'high'::text`) or as a function's source spells it (`n.lane = 'high'`, `lane IN ('a', 'b')`).
_COMPARISON = re.compile(
    r"lane\)?(?:::[a-z ]+)?\s*(?:=|<>|!=)\s*(?:ANY\s*\(\(ARRAY\[(?P<array>[^\]]*)\]|'(?P<one>[a-z_]+)')"
    r"|lane\s+(?:NOT\s+)?IN\s*\((?P<list>[^)]*)\)", re.IGNORECASE)
_QUOTED = re.compile(r"'([^']*)'")

CATALOG = """
SELECT 'check ' || conname AS what, pg_get_constraintdef(oid) AS text FROM pg_constraint
WHERE contype = 'c' AND connamespace = 'public'::regnamespace
UNION ALL
SELECT 'index ' || indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'
UNION ALL
SELECT 'function ' || proname, prosrc FROM pg_proc WHERE pronamespace = 'public'::regnamespace
UNION ALL
SELECT 'trigger ' || tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal
UNION ALL
SELECT 'view ' || viewname, definition FROM pg_views WHERE schemaname = 'public'
"""


def lanes_compared(text: str) -> frozenset[str]:
    names: set[str] = set()
    for m in _COMPARISON.finditer(text):
        if m.group("one"):
            names.add(m.group("one"))
        else:
            names.update(_QUOTED.findall(m.group("array") or m.group("list")))
    return frozenset(names)


async def schema_lane_comparisons(conn: Conn) -> dict[str, frozenset[str]]:
    """Every schema object that compares a lane column with lane names, and the names it holds."""
    cur = await conn.execute(CATALOG)
    found: dict[str, frozenset[str]] = {}
    for row in await cur.fetchall():
        if names := lanes_compared(row["text"]):
            found[row["what"]] = found.get(row["what"], frozenset()) | names
    return found


def lane_drift(found: dict[str, frozenset[str]], specs: Specs) -> list[str]:
    """Where the schema and a lane table disagree (empty: nowhere)."""
    problems = []
    for what, names in sorted(found.items()):
        expected = EXPECTED.get(what)
        if expected is None:
            problems.append(f"{what} compares lanes {sorted(names)}: say in EXPECTED which lanes it stands for")
            continue
        want = expected(specs)
        if missing := sorted(want - names):
            problems.append(f"{what} lacks {missing}")
        if extra := sorted(names - want):
            problems.append(f"{what} holds {extra}, which the lane table does not")
    problems += [f"{what} is not in the schema any more" for what in sorted(set(EXPECTED) - set(found))]
    return problems


async def _comparisons(database_url: str) -> dict[str, frozenset[str]]:
    conn = await connect(database_url)
    try:
        return await schema_lane_comparisons(conn)
    finally:
        await conn.close()


async def test_the_migrated_schema_agrees_with_the_lane_table(database_url: str) -> None:
    found = await _comparisons(database_url)
    assert set(found) == set(EXPECTED)
    assert lane_drift(found, LANE_SPECS) == []


async def test_a_lane_added_to_the_table_without_its_migration_is_caught(database_url: str) -> None:
    express = LaneSpec("monitor", "express", 6000, 6999, 75, 6000, budget_exempt=True, retries_into="express")
    drift = lane_drift(await _comparisons(database_url), (*LANE_SPECS, express))
    assert "check legacy_leases_lane_check lacks ['express']" in drift
    assert "check desktop_tasks_lane_check lacks ['express']" in drift
    assert "function dispatch_budget_ledger_update lacks ['express']" in drift
    assert not any("ix_collect_tasks_aging" in p for p in drift)  # express does not age
    gone = tuple(s for s in LANE_SPECS if not (s.kind == "monitor" and s.name == "retry"))
    assert "check monitoring_collect_tasks_dispatch_lane_check holds ['retry'], which the lane table does not" in \
        lane_drift(await _comparisons(database_url), gone)


async def test_a_migration_that_disagrees_with_the_table_is_caught(database_url: str) -> None:
    conn = await connect(database_url)
    try:
        await conn.execute("ALTER TABLE legacy_leases DROP CONSTRAINT legacy_leases_lane_check, ADD CONSTRAINT "
                           "legacy_leases_lane_check CHECK (lane IN ('high', 'normal', 'normal_boosted', 'retry', "
                           "'express')) NOT VALID")
        await conn.execute("DROP INDEX ix_collect_tasks_aging")
        await conn.execute("CREATE INDEX ix_collect_tasks_aging ON monitoring_collect_tasks (enqueued_at, id) "
                           "WHERE status = 'pending' AND dispatch_lane = 'normal'")
        await conn.execute("CREATE INDEX ix_lane_probe ON monitoring_collect_tasks (id) WHERE dispatch_lane <> 'high'")
        await conn.commit()
        drift = lane_drift(await schema_lane_comparisons(conn), LANE_SPECS)
    finally:
        await conn.close()
    assert drift == [
        "check legacy_leases_lane_check holds ['express'], which the lane table does not",
        "index ix_collect_tasks_aging lacks ['normal_boosted']",
        "index ix_lane_probe compares lanes ['high']: say in EXPECTED which lanes it stands for",
    ]


async def test_the_derived_aging_list_uses_the_aging_index(database_url: str) -> None:
    """The table's spelling of the aging lanes (in dispatch order) still lets the planner prove the partial index's
    predicate (written in another order in migration 023)."""
    conn = await connect(database_url)

    async def plan(lanes_sql: str) -> str:
        cur = await conn.execute(f"""EXPLAIN SELECT t.enqueued_at, t.id FROM monitoring_collect_tasks t
            WHERE t.status = 'pending' AND t.dispatch_lane IN {lanes_sql} ORDER BY t.enqueued_at, t.id LIMIT 1""")
        return " ".join(str(next(iter(dict(r).values()))) for r in await cur.fetchall())

    try:
        await conn.execute("SET enable_seqscan = off")
        derived, wider = await plan(AGING_LANES_SQL), await plan("('normal', 'retry')")
    finally:
        await conn.close()
    assert AGING_LANES_SQL == "('normal_boosted', 'normal')" and "ix_collect_tasks_aging" in derived, derived
    assert "ix_collect_tasks_aging" not in wider, wider  # a lane the index does not hold: it cannot serve


def test_the_comparison_reader() -> None:
    assert lanes_compared("WHERE (((dispatch_lane)::text = ANY ((ARRAY['normal'::character varying, "
                          "'normal_boosted'::character varying])::text[])))") == {"normal", "normal_boosted"}
    assert lanes_compared("(((old.lane)::text = 'high'::text) IS DISTINCT FROM") == {"high"}
    assert lanes_compared("n.tenant_id, n.lane = 'high' AS high") == {"high"}
    assert lanes_compared("WHERE l.lane NOT IN ('retry', 'normal')") == {"retry", "normal"}
    assert lanes_compared("WHERE status = 'pending' AND lane_weight > 3") == frozenset()
