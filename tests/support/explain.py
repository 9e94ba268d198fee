"""Plans of every statement a piece of code runs: auto_explain loaded in the sessions of one pool (session settings
only, no server configuration), each statement's EXPLAIN (ANALYZE, BUFFERS) sent back as a notice."""

from __future__ import annotations

import re
from dataclasses import dataclass

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn

_SESSION = ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0", "SET auto_explain.log_analyze = on",
            "SET auto_explain.log_buffers = on", "SET auto_explain.log_nested_statements = on",
            "SET auto_explain.log_level = notice", "SET client_min_messages = notice")
_HIT = re.compile(r"shared hit=(\d+)")
_READ = re.compile(r"shared (?:hit=\d+ )?read=(\d+)")
_LOOPS = re.compile(r"\(actual time=\S+ rows=\d+ loops=(\d+)\)")
_REMOVED = re.compile(r"Rows Removed by (?:Join )?Filter: (\d+)")


@dataclass(frozen=True, slots=True)
class Plan:
    query: str  # the statement's text, whitespace folded
    buffers: int  # shared buffers hit + read by the whole statement (its top node)
    filtered: int  # the most rows one plan node read and threw away (its filter's or join filter's), over all its loops
    text: str  # the plan as auto_explain printed it


def parse_plan(message: str) -> Plan:
    lines = message.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Query Text:")), 0)
    top = next((i for i in range(start + 1, len(lines)) if "(cost=" in lines[i]), len(lines))
    query = " ".join(" ".join(lines[start:top])[len("Query Text:"):].split())
    buffers = next((line for line in lines[top:] if line.strip().startswith("Buffers:")), "")
    hit, read = _HIT.search(buffers), _READ.search(buffers)
    filtered, loops = 0, 1
    for line in lines[top:]:
        if found := _LOOPS.search(line):
            loops = int(found.group(1))
        elif removed := _REMOVED.search(line):  # EXPLAIN prints the average per loop
            filtered = max(filtered, int(removed.group(1)) * loops)
    return Plan(query, (int(hit.group(1)) if hit else 0) + (int(read.group(1)) if read else 0), filtered, message)


def explaining_pool(database_url: str, plans: list[Plan], *, max_size: int = 2,
                    session: tuple[str, ...] = ()) -> AsyncConnectionPool[Conn]:
    """A pool (not opened) whose every statement's plan is appended to `plans`; `session`: more statements each of
    its sessions runs first (planner settings, say)."""
    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        if diag.message_primary and "plan:" in diag.message_primary:
            plans.append(parse_plan(diag.message_primary))

    async def configure(conn: Conn) -> None:
        await conn.set_autocommit(True)
        conn.add_notice_handler(on_notice)
        for statement in (*_SESSION, *session):
            await conn.execute(statement)

    return AsyncConnectionPool(database_url, min_size=1, max_size=max_size, open=False, configure=configure,
                               kwargs={"row_factory": dict_row, "application_name": "tests-explain"})
