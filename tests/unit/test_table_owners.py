"""One owner per table (docs/architecture.md "Write matrix"): the shared tables of a task's life are written only by
the owner modules of libs/tasks. A service runs their statements and transitions; it never writes these tables with
SQL of its own."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNED = ("desktop_tasks", "desktop_task_attempts", "monitoring_collect_tasks", "monitoring_collect_requests",
         "legacy_leases")
WRITE = re.compile(r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+(" + "|".join(OWNED) + r")\b", re.IGNORECASE)
OWNERS = ROOT / "libs" / "tasks"
# Code that ships in the services' images: everything under these directories outside libs/tasks.
SHIPPED = ("services", "libs", "tools")


def writes_outside_owners() -> list[str]:
    found = []
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if OWNERS in path.parents:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.lstrip().startswith("#") and (m := WRITE.search(line)):
                    found.append(f"{path.relative_to(ROOT)}:{n}: writes {m.group(1)}")
    return found


def test_only_libs_tasks_writes_the_task_tables() -> None:
    assert writes_outside_owners() == []


def test_the_check_sees_a_write_it_must_refuse() -> None:
    # The pattern itself: what a service statement writing an owned table looks like, in its common forms.
    for statement in ("UPDATE desktop_tasks SET", "update monitoring_collect_tasks t set", "WITH x AS (\n"
                      "    INSERT INTO legacy_leases (id)", "DELETE FROM monitoring_collect_requests WHERE"):
        assert WRITE.search(statement), statement
    for harmless in ("SELECT * FROM desktop_tasks", "FOR UPDATE OF desktop_tasks_x", "UPDATE desktop_clients SET"):
        assert not WRITE.search(harmless), harmless


def test_every_owner_module_writes_its_table() -> None:
    # The other direction: the statements moved here, not away (each owner module holds its table's writes).
    expected = {"executions.py": "desktop_tasks", "business.py": "monitoring_collect_tasks",
                "requests.py": "monitoring_collect_requests", "legacy.py": "legacy_leases"}
    for module, table in expected.items():
        tables = {m.group(1) for m in WRITE.finditer((OWNERS / module).read_text())}
        assert table in tables, module


# The hub fleet's own tables (migration 055): written only by the dispatch-hub service.
HUB_OWNED = ("hub_sockets", "hub_instances")
HUB_WRITE = re.compile(r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+(" + "|".join(HUB_OWNED) + r")\b", re.IGNORECASE)
HUB_OWNER = ROOT / "services" / "dispatch_hub"


def test_only_the_hub_writes_its_fleet_tables() -> None:
    found = []
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if HUB_OWNER in path.parents:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.lstrip().startswith("#") and (m := HUB_WRITE.search(line)):
                    found.append(f"{path.relative_to(ROOT)}:{n}: writes {m.group(1)}")
    assert found == []
    assert HUB_WRITE.search("DELETE FROM hub_sockets WHERE") and HUB_WRITE.search("insert into hub_instances (x)")
