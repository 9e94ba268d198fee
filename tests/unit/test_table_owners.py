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


# Tables one service owns outright: only its own code (a module, or a package) writes them.
SERVICE_TABLES = {
    "collect_now_idempotency_keys": ROOT / "services" / "collect_now_api" / "queries.py",
    # The hub fleet's own tables (migration 055).
    "hub_sockets": ROOT / "services" / "dispatch_hub",
    "hub_instances": ROOT / "services" / "dispatch_hub",
}
SERVICE_WRITE = re.compile(r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+(" + "|".join(SERVICE_TABLES) + r")\b",
                           re.IGNORECASE)


def _owned_by(path: Path, owner: Path) -> bool:
    return path == owner or owner in path.parents


def test_a_service_table_is_written_only_by_its_service() -> None:
    found = []
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if (not line.lstrip().startswith("#") and (m := SERVICE_WRITE.search(line))
                        and not _owned_by(path, SERVICE_TABLES[m.group(1)])):
                    found.append(f"{path.relative_to(ROOT)}:{n}: writes {m.group(1)}")
    assert found == []
    idempotency = SERVICE_TABLES["collect_now_idempotency_keys"]
    assert {m.group(1) for m in SERVICE_WRITE.finditer(idempotency.read_text())} == {"collect_now_idempotency_keys"}
    # The pattern sees a write.
    assert SERVICE_WRITE.search("DELETE FROM collect_now_idempotency_keys k")
    assert SERVICE_WRITE.search("DELETE FROM hub_sockets WHERE")
    assert SERVICE_WRITE.search("insert into hub_instances (x)")
