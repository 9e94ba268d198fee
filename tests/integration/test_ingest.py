"""ingest-shard-workers against real Postgres and RabbitMQ (the worker runs in-process here)."""

from __future__ import annotations

from datetime import date

import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import LifecycleEvent
from libs.contracts.wire import TaskControl
from libs.db.pool import Conn
from libs.dispatch_settings import SettingsCache
from libs.telemetry import metrics as m
from services.ingest_shard_workers.apply import apply_batch
from tests.support.ingest_factory import (
    Execution,
    World,
    fetch,
    make_collect_request,
    make_executions,
    make_result,
    make_world,
    publish,
    redispatch,
    running_ingest,
)
from tests.support.wait import eventually

DAY = date(2026, 3, 14)


@pytest.fixture
async def world(pool: AsyncConnectionPool[Conn]) -> World:
    async with pool.connection() as conn:
        return await make_world(conn, brands=2, questions=3, platforms=2)


async def executions(pool: AsyncConnectionPool[Conn], world: World, **kw: object) -> list[Execution]:
    async with pool.connection() as conn:
        return await make_executions(conn, world, business_date=DAY, **kw)  # type: ignore[arg-type]


async def applied_count(pool: AsyncConnectionPool[Conn]) -> int:
    rows = await fetch(pool, "SELECT count(*) AS n FROM ingest_applied_results")
    return int(rows[0]["n"])  # type: ignore[call-overload]


async def test_same_result_delivered_three_times_gives_one_run(pool, settings, topology, amqp, world) -> None:
    [execution] = await executions(pool, world, count=1)
    result = make_result(execution, shards=topology.ingest_shards, citations=["https://a.example/x",
                                                                              "https://www.a.example/x/",
                                                                              "https://b.example/y?utm_source=z"])
    dupes = m.ingest_results_duplicate_count.value()
    async with running_ingest(pool, settings, topology):
        await publish(amqp, topology, [result, result, result])
        await eventually(lambda: m.ingest_results_duplicate_count.value() - dupes >= 2,
                         message="two duplicates recognised")
    runs = await fetch(pool, "SELECT * FROM question_monitor_runs")
    assert len(runs) == 1
    assert runs[0]["status"] == "succeeded" and runs[0]["result_id"] == result.result_id
    assert runs[0]["citation_count"] == 2  # the same page twice is one citation
    facts = await fetch(pool, "SELECT domain FROM monitoring_citation_facts ORDER BY domain")
    assert [f["domain"] for f in facts] == ["a.example", "b.example"]
    assert len(await fetch(pool, "SELECT 1 FROM question_monitor_parse_results")) == 2
    [ex] = await fetch(pool, "SELECT status, finished_at FROM desktop_tasks")
    assert ex["status"] == "succeeded" and ex["finished_at"] is not None
    [attempt] = await fetch(pool, "SELECT status FROM desktop_task_attempts")
    assert attempt["status"] == "succeeded"
    [task] = await fetch(pool, "SELECT status, completed_at FROM monitoring_collect_tasks")
    assert task["status"] == "completed"
    events = await fetch(pool, "SELECT routing_key, payload FROM outbox WHERE exchange = 'monitor.lifecycle'")
    assert [e["routing_key"] for e in events] == ["task.completed"]
    lifecycle = msgspec.json.decode(events[0]["payload"], type=LifecycleEvent)  # type: ignore[call-overload]
    assert lifecycle.task_id == execution.task_id and lifecycle.monitor_task_id == execution.monitor_task_id
    [queue_row] = await fetch(pool, "SELECT request_count FROM projection_rebuild_queue")
    assert queue_row["request_count"] == 1
    rebuilds = await fetch(pool, "SELECT 1 FROM outbox WHERE exchange = 'monitor.projection'")
    assert len(rebuilds) == 1
    assert await applied_count(pool) == 1


async def test_failed_after_succeeded_keeps_succeeded(pool, settings, topology, amqp, world) -> None:
    """The first execution expired and was re-dispatched; the second succeeds, then the first's late failure."""
    [execution] = await executions(pool, world, count=1)
    failed = make_result(execution, shards=topology.ingest_shards, status="failed", error="captcha")
    async with pool.connection() as conn:
        later = await redispatch(conn, execution)
    ok = make_result(later, shards=topology.ingest_shards, answer="good")
    async with running_ingest(pool, settings, topology):
        await publish(amqp, topology, [ok])
        await eventually(lambda: _applied(pool, 1), message="success applied")
        await publish(amqp, topology, [failed])
        await eventually(lambda: _applied(pool, 2), message="failure applied")
    [run] = await fetch(pool, "SELECT status, answer_text, result_id, citation_count FROM question_monitor_runs")
    assert (run["status"], run["answer_text"], run["result_id"]) == ("succeeded", "good", ok.result_id)
    assert run["citation_count"] == 2
    assert len(await fetch(pool, "SELECT 1 FROM monitoring_citation_facts")) == 2
    [task] = await fetch(pool, "SELECT status FROM monitoring_collect_tasks")
    assert task["status"] == "completed"  # a failure never undoes a completed business task
    statuses = {r["id"]: r["status"] for r in await fetch(pool, "SELECT id, status FROM desktop_tasks")}
    assert statuses == {later.task_id: "succeeded", execution.task_id: "aborted"}
    # The failure changed no run: no second projection request.
    [queue_row] = await fetch(pool, "SELECT request_count FROM projection_rebuild_queue")
    assert queue_row["request_count"] == 1


async def test_succeeded_after_failed_wins(pool, settings, topology, amqp, world) -> None:
    [execution] = await executions(pool, world, count=1)
    failed = make_result(execution, shards=topology.ingest_shards, status="failed", error="timeout")
    async with pool.connection() as conn:
        later = await redispatch(conn, execution)
    ok = make_result(later, shards=topology.ingest_shards, answer="second try", brand_mentioned=True)
    async with running_ingest(pool, settings, topology):
        await publish(amqp, topology, [failed])
        await eventually(lambda: _applied(pool, 1), message="failure applied")
        [run] = await fetch(pool, "SELECT status, error FROM question_monitor_runs")
        assert (run["status"], run["error"]) == ("failed", "timeout")
        await publish(amqp, topology, [ok])
        await eventually(lambda: _applied(pool, 2), message="success applied")
    [run] = await fetch(pool, "SELECT status, answer_text, error, brand_mentioned FROM question_monitor_runs")
    assert (run["status"], run["answer_text"], run["error"], run["brand_mentioned"]) == (
        "succeeded", "second try", None, True)
    [task] = await fetch(pool, "SELECT status FROM monitoring_collect_tasks")
    assert task["status"] == "completed"


async def test_same_business_key_in_one_batch_follows_delivery_order(pool, topology, world) -> None:
    """failed, succeeded(A), failed, succeeded(B), failed of one key applied as one batch: B is effective,
    exactly as if applied one by one; the execution is ended by the first result only."""
    [execution] = await executions(pool, world, count=1)
    sequence = [make_result(execution, shards=topology.ingest_shards, status=s, answer=a, error="e")
                for s, a in [("failed", ""), ("succeeded", "A"), ("failed", ""), ("succeeded", "B"), ("failed", "")]]
    async with pool.connection() as conn:
        outcome = await apply_batch(conn, [*sequence, sequence[1]], applied_by="t", settings=SettingsCache())
    assert [r.result_id for r in outcome.applied] == [r.result_id for r in sequence]
    assert outcome.duplicates == 1 and not outcome.rejected
    [run] = await fetch(pool, "SELECT status, answer_text, result_id FROM question_monitor_runs")
    assert (run["status"], run["answer_text"], run["result_id"]) == ("succeeded", "B", sequence[3].result_id)
    seq = [r["result_id"] for r in await fetch(pool, "SELECT result_id FROM ingest_applied_results ORDER BY seq")]
    assert seq == [r.result_id for r in sequence]
    [task] = await fetch(pool, "SELECT status FROM monitoring_collect_tasks")
    assert task["status"] == "completed"
    [ex] = await fetch(pool, "SELECT status FROM desktop_tasks")
    assert ex["status"] == "failed"
    events = await fetch(pool, "SELECT routing_key FROM outbox WHERE exchange = 'monitor.lifecycle'")
    assert [e["routing_key"] for e in events] == ["task.failed"]
    async with pool.connection() as conn:  # the whole batch again: nothing changes
        again = await apply_batch(conn, sequence, applied_by="t", settings=SettingsCache())
    assert (again.applied, again.duplicates) == ([], 5)
    assert len(await fetch(pool, "SELECT 1 FROM outbox")) == 2  # task.failed + one ProjectionRebuild


async def test_failed_result_retries_business_task(pool, settings, topology, amqp, world) -> None:
    first, second = await executions(pool, world, count=2)
    async with pool.connection() as conn:
        # `second` has used its last attempt (max_dispatch_attempts defaults to 3).
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_attempts = 3 WHERE id = %s",
                           (second.monitor_task_id,))
    results = [make_result(e, shards=topology.ingest_shards, status="failed", error="login required")
               for e in (first, second)]
    async with running_ingest(pool, settings, topology):
        await publish(amqp, topology, results)
        await eventually(lambda: _applied(pool, 2), message="both applied")
    tasks = {r["id"]: r for r in await fetch(pool, "SELECT id, status, dispatch_lane, dispatch_priority, last_error "
                                                   "FROM monitoring_collect_tasks")}
    assert (tasks[first.monitor_task_id]["status"], tasks[first.monitor_task_id]["dispatch_lane"]) == (
        "pending", "retry")
    assert tasks[first.monitor_task_id]["last_error"] == "login required"
    assert tasks[second.monitor_task_id]["status"] == "failed"
    attempts = await fetch(pool, "SELECT status, error FROM desktop_task_attempts")
    assert {(a["status"], a["error"]) for a in attempts} == {("failed", "login required")}
    events = await fetch(pool, "SELECT routing_key FROM outbox WHERE exchange = 'monitor.lifecycle'")
    assert sorted(e["routing_key"] for e in events) == ["task.failed", "task.failed"]


async def test_collect_request_progress(pool, settings, topology, amqp, world) -> None:
    brand = world.brand_ids[0]
    async with pool.connection() as conn:
        request_id = await make_collect_request(conn, world, brand, requested=3)
    ex = await executions(pool, world, brand_id=brand, count=3, collect_request_id=request_id)
    async with pool.connection() as conn:
        await conn.execute("UPDATE monitoring_collect_tasks SET dispatch_attempts = 3 WHERE id = %s",
                           (ex[2].monitor_task_id,))
    observed = m.collect_now_first_result_latency_ms.collect()[0].samples
    before = next(s.value for s in observed if s.name.endswith("_count"))
    async with running_ingest(pool, settings, topology):
        await publish(amqp, topology, [make_result(ex[0], shards=topology.ingest_shards)])
        await eventually(lambda: _applied(pool, 1), message="first result")
        [req] = await fetch(pool, "SELECT * FROM monitoring_collect_requests")
        assert req["first_result_at"] is not None and req["status"] == "running"
        assert (req["completed_task_count"], req["failed_task_count"]) == (1, 0)
        await publish(amqp, topology, [make_result(ex[1], shards=topology.ingest_shards),
                                       make_result(ex[2], shards=topology.ingest_shards, status="failed")])
        await eventually(lambda: _applied(pool, 3), message="all results")
    [req] = await fetch(pool, "SELECT * FROM monitoring_collect_requests")
    assert (req["status"], req["completed_task_count"], req["failed_task_count"]) == ("partial", 2, 1)
    assert req["finished_at"] is not None
    observed = m.collect_now_first_result_latency_ms.collect()[0].samples
    after = next(s.value for s in observed if s.name.endswith("_count"))
    assert after - before == 1  # the first result only


async def test_late_success_aborts_the_newer_execution(pool, settings, topology, amqp, world) -> None:
    [execution] = await executions(pool, world, count=1)
    late = make_result(execution, shards=topology.ingest_shards)
    async with pool.connection() as conn:
        newer = await redispatch(conn, execution)
    async with running_ingest(pool, settings, topology):
        await publish(amqp, topology, [late])
        await eventually(lambda: _applied(pool, 1), message="late result applied")
    statuses = {r["id"]: (r["status"], r["interrupt_reason"])
                for r in await fetch(pool, "SELECT id, status, interrupt_reason FROM desktop_tasks")}
    assert statuses[newer.task_id] == ("aborted", "superseded_by_result")
    [task] = await fetch(pool, "SELECT status FROM monitoring_collect_tasks")
    assert task["status"] == "completed"
    [control] = await fetch(pool, "SELECT routing_key, ordering_key, payload FROM outbox "
                                  "WHERE exchange = 'desktop.task.dispatch'")
    assert control["routing_key"] == f"monitor.control.{world.client_id}"
    assert control["ordering_key"] == f"client:{world.client_id}"
    decoded = msgspec.json.decode(control["payload"], type=TaskControl)  # type: ignore[call-overload]
    assert (decoded.task_id, decoded.control) == (newer.task_id, "cancelled")
    events = await fetch(pool, "SELECT routing_key FROM outbox WHERE exchange = 'monitor.lifecycle'")
    assert [e["routing_key"] for e in events] == ["task.aborted"]


async def test_malformed_results_are_dead_lettered_and_the_shard_keeps_flowing(
        pool, settings, topology, amqp, world) -> None:
    ex = await executions(pool, world, brand_id=world.brand_ids[0], count=4)
    shard = make_result(ex[0], shards=topology.ingest_shards).shard
    wrong_task = msgspec.structs.replace(make_result(ex[1], shards=topology.ingest_shards),
                                         monitor_task_id=ex[2].monitor_task_id)
    nul = make_result(ex[3], shards=topology.ingest_shards, answer="bad\x00byte")
    good = [make_result(e, shards=topology.ingest_shards) for e in ex[:3]]
    async with running_ingest(pool, settings, topology):
        dlq_channel = await amqp.channel()
        dlq = await dlq_channel.get_queue(topology.ingest_dlq, ensure=False)
        await publish(amqp, topology, [good[0], b"{not json", wrong_task, nul,
                                       b'{"type": "monitor_result", "result_id": "x"}', good[1], good[2]],
                      shard=shard)
        await eventually(lambda: _applied(pool, 3), message="the good results around the poison ones")
        reasons: list[str] = []

        async def drained() -> bool:
            message = await dlq.get(fail=False, no_ack=True)
            if message is not None:
                reasons.append(str((message.headers or {})["x-dead-letter-reason"]))
            return len(reasons) == 4

        await eventually(drained, message="four dead letters")
        await dlq_channel.close()
    # Decode failures are found before the batch is applied, the others by it: each with its reason. A NUL in
    # the answer (which Postgres' text cannot hold) breaks the message's contract: a decode failure naming the
    # field, not a refused statement.
    assert sorted(r.split(":")[0] for r in reasons) == ["business_key_mismatch", "invalid_message", "invalid_message",
                                                        "malformed_json"]
    assert any(r.startswith("invalid_message") and "answer_text" in r for r in reasons), reasons
    runs = await fetch(pool, "SELECT result_id FROM question_monitor_runs")
    assert {r["result_id"] for r in runs} == {r.result_id for r in good}


async def _applied(pool: AsyncConnectionPool[Conn], n: int) -> bool:
    return await applied_count(pool) >= n
