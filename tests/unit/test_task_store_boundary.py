"""The task store's boundary (docs/architecture.md "The task store"): the task tables are read and written only
through the operations of libs/tasks. Outside it no module holds SQL text that names a task table, and none takes a
statement or SQL fragment out of libs/tasks to run it itself; a service calls an operation and gets a typed answer.

STILL_OUTSIDE lists the modules not yet moved behind the store; it only shrinks (a listed module that has become
clean fails the test too, so the list stays the truth)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "libs" / "tasks"
SHIPPED = ("services", "libs", "tools")
TASK_TABLES = ("desktop_tasks", "desktop_task_attempts", "legacy_leases", "monitoring_collect_tasks",
               "monitoring_collect_requests")
# SQL that names a task table as a relation (FROM, JOIN, UPDATE, INTO, DELETE FROM), not as a word in a sentence.
TABLE_SQL = re.compile(r"\b(?:FROM|JOIN|UPDATE|INTO)\s+(" + "|".join(TASK_TABLES) + r")\b", re.IGNORECASE)
# A string that is SQL or a fragment of it: a keyword, or a quoted literal list such as "('queued', 'in_progress')".
SQL_LIKE = re.compile(r"\b(?:SELECT|UPDATE|INSERT|DELETE|FROM|WHERE|JOIN|AND|OR|NOT|IN|IS|NULL|CASE)\b|'[^']*'")

STILL_OUTSIDE: frozenset[str] = frozenset({
})


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal of a module, an f-string as the text of its literal parts."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            found.append((node.lineno, "".join(v.value for v in node.values if isinstance(v, ast.Constant))))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
    return found


def _is_sql(value: object) -> bool:
    return isinstance(value, str) and bool(SQL_LIKE.search(value))


def _store_sql_taken(tree: ast.AST) -> list[tuple[int, str]]:
    """Statements and fragments taken out of the store: `from libs.tasks.x import NAME` or `x.NAME` of an imported
    store module, where NAME is an upper-case module constant holding SQL."""
    modules: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[:2] == ["libs", "tasks"]:
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == "libs.tasks":
                    modules[bound] = f"libs.tasks.{alias.name}"
                elif alias.name.isupper() and _is_sql(getattr(importlib.import_module(node.module), alias.name, None)):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.isupper()
                and _is_sql(getattr(importlib.import_module(modules[node.value.id]), node.attr, None))):
            found.append((node.lineno, f"{modules[node.value.id]}.{node.attr}"))
    return found


def offences(source: str) -> list[str]:
    tree = ast.parse(source)
    found = [f"{n}: SQL on {m.group(1)}" for n, text in _strings(tree) if (m := TABLE_SQL.search(text))]
    found += [f"{n}: takes {name} from the store" for n, name in _store_sql_taken(tree)]
    return found


def modules_outside_the_store() -> dict[str, list[str]]:
    result = {}
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if STORE in path.parents:
                continue
            if found := offences(path.read_text()):
                result[str(path.relative_to(ROOT))] = found
    return result


def test_no_module_outside_the_store_runs_task_table_sql() -> None:
    found = modules_outside_the_store()
    new = {path: lines for path, lines in found.items() if path not in STILL_OUTSIDE}
    assert new == {}, "move these behind an operation of libs/tasks"


def test_the_list_of_modules_still_outside_is_the_truth() -> None:
    assert sorted(STILL_OUTSIDE - set(modules_outside_the_store())) == [], "now clean: remove from STILL_OUTSIDE"


def test_the_check_catches_what_it_must_refuse() -> None:
    for source in ('Q = "SELECT id FROM desktop_tasks WHERE x"',
                   'Q = f"""UPDATE legacy_leases SET x = {y}"""',
                   'Q = "... JOIN monitoring_collect_tasks t ON ..."',
                   "from libs.tasks.statuses import ACTIVE_EXECUTION_SQL",
                   "from libs.tasks import executions\nx = executions._MARK_LEASED",
                   "from libs.tasks import legacy as l\nx = l._EXTEND"):
        assert offences(source), source
    for source in ('"""The desktop_tasks row of a lease."""',
                   'Q = "SELECT 1 FROM desktop_clients"',
                   "from libs.tasks.transitions import DISPATCH_WAKE_CHANNEL",
                   "from libs.tasks import executions\nx = executions.create"):
        assert not offences(source), source
