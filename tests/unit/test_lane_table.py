"""The lanes in one table (libs/domain/lanes.py): the contracts' Literals, the settings' and the planner's lane lists
and the SQL lane lists derive from it, and shipped code does not compare lane names (docs/architecture.md, "How to
change X": adding a lane).

STILL_NAMING lists the modules that still compare a lane name or spell one in SQL; it only shrinks (a listed module
that has become clean fails the test too, so the list stays the truth)."""

from __future__ import annotations

import ast
import re
import typing
from dataclasses import replace
from pathlib import Path

import pytest

from libs.contracts.common import ExecutionLane, Lane
from libs.dispatch_settings import LANES, SettingError, coerce
from libs.domain import lanes
from libs.domain.aging import age_task
from libs.domain.dispatch import LANE_ORDER, NORMAL_LANES
from libs.domain.lanes import LANE_SPECS, LaneSpec, table_problems

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("services", "libs", "tools")
TABLE = ROOT / "libs" / "domain" / "lanes.py"
NAMES = frozenset(s.name for s in LANE_SPECS if s.kind == "monitor")
# A lane name quoted in SQL text: 'high', 'normal_boosted', ...
SQL_LANE = re.compile(r"'(" + "|".join(sorted(NAMES, key=len, reverse=True)) + r")'")

STILL_NAMING: frozenset[str] = frozenset()


# ---- the table and what derives from it ----------------------------------------------------------------------


def test_the_contract_literals_are_the_tables_names() -> None:
    assert sorted(typing.get_args(Lane)) == sorted(lanes.MONITOR_LANE_NAMES)
    assert sorted(typing.get_args(ExecutionLane)) == sorted(lanes.ALL_LANE_NAMES)


def test_the_lane_lists_are_the_tables() -> None:
    assert LANE_ORDER == lanes.MONITOR_LANE_NAMES == ("high", "normal_boosted", "normal", "retry")
    assert set(LANES) == NAMES and NORMAL_LANES == {"normal", "normal_boosted"}
    assert coerce("paused_lanes", "retry,high") == ("high", "retry")
    with pytest.raises(SettingError, match="unknown lane"):
        coerce("paused_lanes", "urgent")  # a publish lane is not a monitor lane


def test_the_roles_and_priorities() -> None:
    assert (lanes.CLICK_LANE.name, lanes.SCHEDULED_LANE.name, lanes.RETRY_LANE.name) == ("high", "normal", "retry")
    assert (lanes.HIGH_PRIORITY, lanes.NORMAL_PRIORITY, lanes.RETRY_PRIORITY) == (5000, 100, 50)
    assert lanes.routing_word("normal_boosted") == "normal" and lanes.routing_word("retry") == "retry"
    assert lanes.execution_source("high", from_click=True) == "collect_now"
    assert lanes.execution_source("high", from_click=False) == "daily_schedule"
    assert lanes.execution_source("retry", from_click=False) == "retry_recovery"
    assert lanes.execution_source("normal_boosted", from_click=True) == "daily_schedule"


def test_sql_lists_derive_from_the_table() -> None:
    assert lanes.sql_names(lambda s: s.budget_exempt) == "('high')"
    assert lanes.sql_names(lambda s: s.held_for_broken_login) == "('normal_boosted', 'normal', 'retry')"
    assert lanes.sql_names(lambda s: s.ages) == "('normal_boosted', 'normal')"
    assert lanes.sql_names() == "('high', 'normal_boosted', 'normal', 'retry')"
    assert lanes.sql_all_names() == "('urgent', 'high', 'normal', 'normal_boosted', 'retry')"
    assert (lanes.BUDGET_EXEMPT_SQL, lanes.PREEMPTING_SQL, lanes.PREEMPTIBLE_SQL) == (
        "('high')", "('high')", "('normal_boosted', 'normal')")
    assert lanes.AGING_LANES_SQL == lanes.NORMAL_BACKLOG_SQL == "('normal_boosted', 'normal')"
    assert lanes.HELD_FOR_BROKEN_LOGIN_SQL == "('normal_boosted', 'normal', 'retry')"
    with pytest.raises(ValueError, match="no lane matches"):
        lanes.sql_names(lambda s: False)
    assert lanes.retry_lane_sql("t.dispatch_lane") == (
        "CASE t.dispatch_lane WHEN 'high' THEN 'high' WHEN 'normal_boosted' THEN 'retry' "
        "WHEN 'normal' THEN 'retry' WHEN 'retry' THEN 'retry' END")
    assert lanes.retry_priority_sql("l", "p") == "CASE l WHEN 'high' THEN p WHEN 'normal_boosted' THEN 50 " \
                                                 "WHEN 'normal' THEN 50 WHEN 'retry' THEN p END"


def test_aging_follows_ages_into() -> None:
    aged = age_task("normal", 100, 0, 10)
    assert aged is not None and aged.lane == "normal_boosted" and aged.priority == 1000 + aged.aging_boost
    assert age_task("retry", 50, 0, 1_000) is None and age_task("high", 5000, 0, 1_000) is None


async def test_the_sql_retry_case_agrees_with_the_python_table() -> None:
    """What `retry_lane_sql` and `retry_priority_sql` say for each lane, read back as the Python table says it."""
    for spec in lanes.MONITOR_LANES:
        target = lanes.monitor_lane(spec.retries_into)
        expected = "p" if target.name == spec.name else str(target.default_priority)
        assert f"WHEN '{spec.name}' THEN {expected}" in lanes.retry_priority_sql("l", "p")
        assert f"WHEN '{spec.name}' THEN '{target.name}'" in lanes.retry_lane_sql("l")


def test_table_problems_catch_a_broken_table() -> None:
    assert table_problems(LANE_SPECS) == []
    express = LaneSpec("monitor", "express", 6000, 6999, 75, 6000, ages_into="turbo", retries_into="retry")
    assert any("'turbo' is not a monitor lane" in p for p in table_problems((*LANE_SPECS, express)))
    overlapping = LaneSpec("monitor", "express", 4000, 4500, 45, 4000, retries_into="retry")
    assert any("strictly ordered" in p for p in table_problems((*LANE_SPECS, overlapping)))
    second_click = replace(lanes.monitor_lane("retry"), entry="collect_now")
    broken = tuple(second_click if s.kind == "monitor" and s.name == "retry" else s for s in LANE_SPECS)
    assert any("entered by 'collect_now'" in p for p in table_problems(broken))
    both = replace(lanes.CLICK_LANE, preemptible=True)
    assert any("cannot be preempted" in p for p in table_problems(
        tuple(both if s is lanes.CLICK_LANE else s for s in LANE_SPECS)))
    assert any("a lane name is" in p for p in table_problems((*LANE_SPECS, replace(express, name="x'; --"))))


# ---- no lane names compared or spelled in SQL outside the table -----------------------------------------------


def _lane_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_lane_constant(e) for e in node.elts)
    return False


def _exempt(tree: ast.AST) -> set[int]:
    """Docstrings, and the contracts' `Literal[...]` of lane names (held to the table by the first test above)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            found.update(id(n) for n in ast.walk(node.slice))
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def offences(source: str) -> list[str]:
    """Lane names compared in Python (`lane == "high"`, `lane in ("normal", ...)`, `lane="normal"`), lane lists
    written out (`("normal", "normal_boosted", "retry")`) or lane names quoted in SQL text
    (`dispatch_lane = 'high'`, `IN ('normal', 'normal_boosted')`)."""
    tree = ast.parse(source)
    skip = _exempt(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare) and any(_lane_constant(n) for n in (node.left, *node.comparators)):
            found.append(f"{node.lineno}: compares a lane name")
        elif isinstance(node, ast.keyword) and node.arg in ("lane", "dispatch_lane") and _lane_constant(node.value):
            found.append(f"{node.lineno}: passes a lane name")
        elif (isinstance(node, (ast.Tuple, ast.List, ast.Set))
              and sum(1 for e in node.elts if _lane_constant(e)) >= 2):
            found.append(f"{node.lineno}: writes out a lane list")
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if SQL_LANE.search(text):
                found.append(f"{node.lineno}: a lane name in SQL")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL_LANE.search(node.value):
            found.append(f"{node.lineno}: a lane name in SQL")
    # An f-string's parts are Constants too: count each line once.
    return sorted(set(found))


def modules_naming_lanes() -> dict[str, list[str]]:
    result = {}
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == TABLE or "contracts/gen" in str(path):
                continue
            if found := offences(path.read_text()):
                result[str(path.relative_to(ROOT))] = found
    return result


def test_no_module_compares_lane_names() -> None:
    found = modules_naming_lanes()
    new = {path: lines for path, lines in found.items() if path not in STILL_NAMING}
    assert new == {}, "derive these from the lane table (libs/domain/lanes.py)"


def test_the_list_of_modules_still_naming_lanes_is_the_truth() -> None:
    assert sorted(STILL_NAMING - set(modules_naming_lanes())) == [], "now clean: remove from STILL_NAMING"


def test_the_check_catches_what_it_must_refuse() -> None:
    for source in ('x = lane == "high"', 'x = "retry" != lane', 'x = lane in ("normal", "normal_boosted")',
                   'x = "high" not in paused', 'c = Candidate(lane="normal")',
                   """Q = "WHERE t.dispatch_lane = 'high'" """, """Q = f"AND lane IN ('normal', {x})" """,
                   """Q = f"CASE WHEN l = 'retry' THEN {p} END" """,
                   'HELD = sql_list(("normal", "normal_boosted", "retry"))', 'for lane in ["high", "retry"]: pass'):
        assert offences(source), source
    for source in ('"""Aging moves normal to normal_boosted."""', 'x = r["high"]', 'x = lane == spec.name',
                   'x = code == "normal_closure"', """Q = "WHERE status = 'pending'" """,
                   'x = {"high": 1}', 'Lane = Literal["high", "normal"]',
                   'from libs.domain.lanes import sql_names\nQ = f"lane IN {sql_names()}"'):
        assert not offences(source), source
