"""Counts from the fuzz tests in pytest's terminal summary: shown in every `pytest` / `make test` run, output
captured or not, after the progress dots and before the short test summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

_PLUGIN_NAME = "fuzz-report"


class FuzzReport:
    """A pytest plugin object holding lines per section; registered on first use in a session."""

    def __init__(self) -> None:
        self.sections: dict[str, list[str]] = {}
        self.providers: dict[str, Callable[[], list[str]]] = {}

    def add(self, section: str, line: str) -> None:
        self.sections.setdefault(section, []).append(line)

    def provide(self, section: str, lines: Callable[[], list[str]]) -> None:
        """A section whose lines are read when the summary is printed (counts still growing until then)."""
        self.providers.setdefault(section, lines)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        sections = {**self.sections, **{name: lines() for name, lines in self.providers.items()}}
        for section, lines in sections.items():
            if lines:
                terminalreporter.section(section)
                for line in lines:
                    terminalreporter.write_line(line)


def fuzz_report(config: pytest.Config) -> FuzzReport:
    manager = config.pluginmanager
    found = manager.get_plugin(_PLUGIN_NAME)
    if isinstance(found, FuzzReport):
        return found
    report = FuzzReport()
    manager.register(report, _PLUGIN_NAME)
    return report


def error_lines(logs: str) -> list[str]:
    """A service's log lines that tell of a crash: error or critical events, anything with a traceback, and
    non-JSON lines (the services log JSON only; anything else came from an uncaught exception)."""
    found = []
    for line in logs.splitlines():
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            found.append(line)
            continue
        if not isinstance(event, dict) or event.get("level") in ("error", "critical") or "exc" in event:
            found.append(line)
    return found
