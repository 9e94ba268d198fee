"""The outbox's transition log lines and the operator's replay, against real Postgres and RabbitMQ: every state change
of a row logs one JSON line with its owner, tenant, source tuple, attempt and (for a failure) a bounded error
summary; a replay resets transient dead letters only, unless told to include permanent ones."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.mq.topology import LIFECYCLE, Topology
from libs.outbox import admin, enqueue
from libs.outbox.pump import AmqpPublisher, OutboxPump, PumpConfig
from libs.outbox.state import SOURCE_FIELDS, TRANSITION_EVENT
from libs.telemetry.logging import JsonFormatter
from tests.integration.test_outbox import lifecycle, make_tenant, monitorctl
from tests.support.capture import capture
from tests.support.wait import eventually

UNREACHABLE = "amqp://guest:guest@127.0.0.1:1/"  # a broker that is never there: every publish fails, transiently
MARKER = "PAYLOAD-MARKER-7f3a"  # in a poison payload; must never reach a log line


class Transitions:
    """The transition lines logged since the last `take()`, as the JSON the service would print."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog
        self.formatter = JsonFormatter("test")
        self.seen = 0

    def take(self) -> list[dict[str, Any]]:
        records = [r for r in self.caplog.records if r.getMessage() == TRANSITION_EVENT]
        new, self.seen = records[self.seen:], len(records)
        return [json.loads(self.formatter.format(r)) for r in new]


@pytest.fixture
def transitions(caplog: pytest.LogCaptureFixture) -> Iterator[Transitions]:
    caplog.set_level(logging.INFO, logger="outbox")
    yield Transitions(caplog)


def brief(lines: list[dict[str, Any]], ids: dict[int, str]) -> list[tuple[object, ...]]:
    """(row name, transition, from, to, owner, attempt) per line, sorted (lines of one step come in no fixed order)."""
    return sorted((ids[line["outbox_id"]], line["transition"], line["from_status"], line["to_status"], line["owner"],
                   line["attempt"]) for line in lines)


async def write_rows(pool: AsyncConnectionPool[Conn], tenant_id: int, *names: str) -> dict[str, int]:
    """Rows named for what happens to them: `ok` (valid), `poison` (does not match its contract), `once` (valid,
    key k, a single attempt allowed), `behind` (valid, key k after `once`), `late` (valid, a single attempt)."""
    ids: dict[str, int] = {}
    async with pool.connection() as conn, conn.transaction():
        for name in names:
            if name == "poison":
                cur = await conn.execute(
                    "INSERT INTO outbox (event_id, exchange, routing_key, message_type, payload, tenant_id) "
                    "VALUES (%s, 'monitor.lifecycle', 'client.online', 'lifecycle', %s, %s) RETURNING id",
                    (uuid.uuid4(), json.dumps({"type": "lifecycle", "event": MARKER}).encode(), tenant_id))
            else:
                await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=lifecycle(tenant_id),
                              tenant_id=tenant_id, ordering_key="k" if name in {"once", "behind"} else None,
                              max_attempts=1 if name in {"once", "late"} else 10)
                cur = await conn.execute("SELECT max(id) AS id FROM outbox")
            row = await cur.fetchone()
            assert row is not None
            ids[name] = int(row["id"])
    return ids


async def outbox(pool: AsyncConnectionPool[Conn]) -> dict[int, dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, status, attempts, last_error_class, last_error, next_retry_at <= now() "
                                 "AS due FROM outbox ORDER BY id")
        return {int(r["id"]): r for r in await cur.fetchall()}


def down_pump(pool: AsyncConnectionPool[Conn], name: str, **config: Any) -> OutboxPump:
    return OutboxPump(pool, AmqpPublisher(UNREACHABLE, Topology("unused.", 4), timeout=1, name=name),
                      PumpConfig(claimed_by=name, backoff_base_ms=1, backoff_max_ms=2, listen=False, **config))


async def test_a_pump_run_logs_exactly_one_line_per_transition(pool, settings, topology, amqp, transitions) -> None:
    async with pool.connection() as conn, conn.transaction():
        tenant_id = await make_tenant(conn)
    ids = await write_rows(pool, tenant_id, "ok", "poison", "once", "behind")
    name = {v: k for k, v in ids.items()}

    # 1. The broker is unreachable: poison is refused for good; the others are released with their claim's
    #    attempt given back (a broker that takes nothing is no message's failure: an outage never dead-letters).
    down = down_pump(pool, "pump-down")
    assert await down.run_once() == 4
    step1 = transitions.take()
    assert brief(step1, name) == sorted([
        ("ok", "claimed", "queued", "running", "pump-down", 1),
        ("poison", "claimed", "queued", "running", "pump-down", 1),
        ("once", "claimed", "queued", "running", "pump-down", 1),
        ("behind", "claimed", "queued", "running", "pump-down", 1),
        ("ok", "released", "running", "queued", "pump-down", 1),
        ("poison", "dead_lettered", "running", "dead_letter", "pump-down", 1),
        ("once", "released", "running", "queued", "pump-down", 1),
        ("behind", "released", "running", "queued", "pump-down", 1),
    ])
    by = {(name[line["outbox_id"]], line["transition"]): line for line in step1}
    assert by["poison", "dead_lettered"]["error_class"] == "permanent"
    assert by["poison", "dead_lettered"]["error_type"] == "ValidationError"
    assert by["poison", "dead_lettered"]["error"].startswith("payload does not match lifecycle")
    assert {by[n, "released"]["attempts_after_release"] for n in ("ok", "once", "behind")} == {0}
    rows = await outbox(pool)
    assert {name[i]: (r["status"], r["attempts"], r["last_error_class"]) for i, r in rows.items()} == {
        "ok": ("queued", 0, None), "poison": ("dead_letter", 1, "permanent"), "once": ("queued", 0, None),
        "behind": ("queued", 0, None)}

    # 2. A pump claims what is due and dies (its short lease runs out): reclaimed by another pump, back to
    #    retryable, or to a transient dead letter when out of attempts.
    ids |= await write_rows(pool, tenant_id, "late")
    name = {v: k for k, v in ids.items()}
    await eventually(lambda: _all_due(pool), message="the backoff over")
    dead = down_pump(pool, "pump-dead", lease_seconds=0.2)
    assert len(await dead.claim()) == 4
    publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="pump-up")
    await publisher.start()
    up = OutboxPump(pool, publisher, PumpConfig(claimed_by="pump-up", listen=False))
    try:
        await eventually(lambda: up.reclaim_expired(), timeout=10, message="the dead pump's claims reclaimed")
        step2 = transitions.take()
        assert brief(step2, name) == sorted([
            ("ok", "claimed", "queued", "running", "pump-dead", 1),
            ("once", "claimed", "queued", "running", "pump-dead", 1),
            ("behind", "claimed", "queued", "running", "pump-dead", 1),
            ("late", "claimed", "queued", "running", "pump-dead", 1),
            ("ok", "lease_expired", "running", "retryable", "pump-up", 1),
            ("once", "lease_expired", "running", "dead_letter", "pump-up", 1),
            ("behind", "lease_expired", "running", "retryable", "pump-up", 1),
            ("late", "lease_expired", "running", "dead_letter", "pump-up", 1),
        ])
        expired = [line for line in step2 if line["transition"] == "lease_expired"]
        assert {line["previous_owner"] for line in expired} == {"pump-dead"}
        assert {line["error_class"] for line in expired} == {"transient"}
        assert all("next_retry_at" in line for line in expired if line["to_status"] == "retryable")
        assert (await outbox(pool))[ids["late"]]["last_error_class"] == "transient"

        # 3. The broker is there: both left are published (confirmed), one line each.
        async with capture(amqp, topology.lifecycle_exchange) as cap:
            assert await up.run_once() == 2
            await eventually(lambda: len(cap.messages) == 2, message="both on the broker")
        step3 = transitions.take()
        assert brief(step3, name) == sorted([
            ("ok", "claimed", "retryable", "running", "pump-up", 2),
            ("behind", "claimed", "retryable", "running", "pump-up", 2),
            ("ok", "published", "running", "published", "pump-up", 2),
            ("behind", "published", "running", "published", "pump-up", 2),
        ])
        assert all("published_at" in line for line in step3 if line["transition"] == "published")
    finally:
        await publisher.close()

    # Every line: the owner, the tenant, the source tuple, the attempt; a failure's error bounded and payload-free.
    for line in step1 + step2 + step3:
        assert set(SOURCE_FIELDS) | {"owner", "transition", "from_status", "to_status"} <= line.keys()
        assert (line["tenant_id"], line["exchange"], line["routing_key"], line["message_type"]) == (
            tenant_id, "monitor.lifecycle", "client.online", "lifecycle")
        assert line["ordering_key"] == ("k" if name[line["outbox_id"]] in {"once", "behind"} else None)
        if line["transition"] in {"retry_scheduled", "dead_lettered", "lease_expired"}:
            assert line["error_type"] and len(line["error"]) <= 200
        assert MARKER not in json.dumps(line)


async def _all_due(pool: AsyncConnectionPool[Conn]) -> bool:
    return all(r["due"] for r in (await outbox(pool)).values() if r["status"] in {"queued", "retryable"})


async def dead_letters_of_each_kind(pool: AsyncConnectionPool[Conn]) -> dict[str, int]:
    """A transient dead letter (its pump died with its only attempt claimed), a permanent one (its payload does not
    match its contract), an unclassified one (dead-lettered before failures were classed), and a published row."""
    async with pool.connection() as conn, conn.transaction():
        tenant_id = await make_tenant(conn)
    ids = await write_rows(pool, tenant_id, "late", "poison", "ok")
    assert await down_pump(pool, "pump-down").run_once() == 3  # poison refused, the others released
    assert len(await down_pump(pool, "pump-dead", lease_seconds=0.2).claim()) == 2
    await eventually(down_pump(pool, "pump-reaper").reclaim_expired, message="the dead pump's claims reclaimed")
    rows = await write_rows(pool, tenant_id, "ok")
    async with pool.connection() as conn:
        await conn.execute("UPDATE outbox SET status = 'dead_letter', dead_lettered_at = now(), attempts = 10, "
                           "last_error = 'gave up after 10 attempts: broker connection is not ready' WHERE id = %s",
                           (ids["ok"],))
        await conn.execute("UPDATE outbox SET status = 'published', published_at = now() WHERE id = %s",
                           (rows["ok"],))
    states = await outbox(pool)
    assert [(states[i]["status"], states[i]["last_error_class"]) for i in (ids["late"], ids["poison"], ids["ok"])] == [
        ("dead_letter", "transient"), ("dead_letter", "permanent"), ("dead_letter", None)]
    return {"transient": ids["late"], "permanent": ids["poison"], "unclassified": ids["ok"], "published": rows["ok"]}


async def test_a_replay_resets_only_transient_dead_letters_unless_told_otherwise(pool, transitions) -> None:
    ids = await dead_letters_of_each_kind(pool)
    transitions.take()
    missing = ids["published"] + 1000
    async with pool.connection() as conn:
        plan = await admin.replay(conn, ids=[*ids.values(), missing], operator="monitorctl:alice")
    assert plan.reset == [ids["transient"]]
    assert [(s.id, s.error_class) for s in plan.skipped] == [(ids["permanent"], "permanent"),
                                                             (ids["unclassified"], None)]
    assert plan.skipped[0].reason.startswith("permanent: payload does not match lifecycle")
    assert plan.not_dead == {ids["published"]: "published"} and plan.not_found == [missing]
    rows = await outbox(pool)
    assert (rows[ids["transient"]]["status"], rows[ids["transient"]]["attempts"],
            rows[ids["transient"]]["last_error_class"]) == ("queued", 0, None)
    assert str(rows[ids["transient"]]["last_error"]).startswith("replayed by operator: claim lease expired")
    assert rows[ids["permanent"]]["status"] == rows[ids["unclassified"]]["status"] == "dead_letter"
    [line] = transitions.take()
    assert (line["transition"], line["from_status"], line["to_status"], line["owner"], line["outbox_id"],
            line["attempt"], line["attempts_before"], line["error_class"]) == (
        "replayed", "dead_letter", "queued", "monitorctl:alice", ids["transient"], 0, 1, "transient")
    assert {"tenant_id", "exchange", "routing_key", "ordering_key", "message_type", "event_id"} <= line.keys()

    async with pool.connection() as conn:
        everything = await admin.replay(conn, replay_all=True, include_permanent=True)
    assert everything.reset == [ids["permanent"], ids["unclassified"]] and everything.skipped == []
    assert {r["status"] for r in (await outbox(pool)).values()} == {"queued", "published"}
    assert sorted(line["error_class"] for line in transitions.take()) == ["permanent", "unclassified"]


async def test_monitorctl_replay_prints_what_it_reset_and_what_it_skipped(pool, database_url) -> None:
    ids = await dead_letters_of_each_kind(pool)
    env = {**os.environ, "DATABASE_URL": database_url}
    missing = ids["published"] + 1000

    text, audit = await monitorctl_both(env, "outbox", "replay", *(str(i) for i in (*ids.values(), missing)))
    assert text.splitlines() == [
        f"replayed 1 event(s): [{ids['transient']}]",
        "skipped 1 permanent dead letter(s) (they would fail the same way again; --include-permanent replays them "
        "anyway):",
        f"  {ids['permanent']}: permanent: payload does not match lifecycle: Invalid enum value '{MARKER}' - at "
        "`$.event`",  # the operator's view of the row (the database has the payload too); logs never quote it
        "skipped 1 unclassified dead letter(s), treated as permanent (dead-lettered before failures were classed; "
        "--include-permanent replays them):",
        f"  {ids['unclassified']}: gave up after 10 attempts: broker connection is not ready",
        f"1 id(s) not dead letters: {ids['published']} (published)",
        f"1 id(s) not found: [{missing}]",
    ]
    # The reset's transition line: JSON on stderr, apart from the command's output.
    [line] = [json.loads(raw) for raw in audit.splitlines() if raw.startswith("{")]
    assert (line["event"], line["transition"], line["outbox_id"], line["to_status"], line["error_class"]) == (
        TRANSITION_EVENT, "replayed", ids["transient"], "queued", "transient")
    assert line["owner"].startswith("monitorctl")
    listed = json.loads(await monitorctl(env, "--json", "outbox", "dead-letters"))
    assert {(r["id"], r["last_error_class"]) for r in listed} == {(ids["permanent"], "permanent"),
                                                                  (ids["unclassified"], None)}

    summary = json.loads(await monitorctl(env, "--json", "outbox", "replay", "--all"))
    assert summary["counts"] == {"replayed": 0, "skipped_permanent": 1, "skipped_unclassified": 1,
                                 "not_dead_letters": 0, "not_found": 0}
    summary = json.loads(await monitorctl(env, "--json", "outbox", "replay", "--all", "--include-permanent"))
    assert summary["replayed"] == [ids["permanent"], ids["unclassified"]]
    assert summary["counts"]["skipped_permanent"] == summary["counts"]["skipped_unclassified"] == 0
    assert {r["status"] for r in (await outbox(pool)).values()} == {"queued", "published"}


async def monitorctl_both(env: dict[str, str], *args: str) -> tuple[str, str]:
    """(stdout, stderr) of a monitorctl command that must succeed."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tools.monitorctl", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode(), err.decode()
