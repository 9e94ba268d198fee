"""ingest-shard-workers and messages that cannot be applied, against real Postgres and RabbitMQ.

The faults are real: triggers installed in the test's own database refuse one answer text (a stand-in for a
bug on one input) or terminate their own backend (a lost connection mid-transaction), and the ingest DLQ is
unbound from the dead-letter exchange on the test's own broker prefix.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import date

import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import MonitorResult
from libs.db.pool import Conn, make_pool
from libs.db.roles import apply_roles, drop_roles, role_name
from libs.mq.topology import Topology, declare_ingest
from libs.telemetry import metrics as m
from tests.support.ingest_factory import (
    Execution,
    World,
    fetch,
    make_executions,
    make_result,
    make_world,
    publish,
    running_ingest,
)
from tests.support.wait import eventually

DAY = date(2026, 3, 17)
REFUSED_ANSWER = "an answer the test trigger refuses"

# A bug on one input, simulated: Postgres refuses one answer text (SQLSTATE P0001, not a data or
# constraint error, so nothing that a list of "known bad data" errors would catch).
REFUSE_ONE_ANSWER = """
CREATE FUNCTION test_refuse_answer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.answer_text = 'an answer the test trigger refuses' THEN
        RAISE EXCEPTION 'simulated bug: this answer cannot be stored';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_refuse_answer BEFORE INSERT OR UPDATE ON question_monitor_runs
    FOR EACH ROW EXECUTE FUNCTION test_refuse_answer();
"""

# A lost connection, for real: ending the listed executions terminates the backend doing it, the first two
# times (a sequence, so the count survives the rollback).
KILL_BACKEND_TWICE = """
CREATE TABLE test_kill_on_end (task_id uuid PRIMARY KEY);
CREATE SEQUENCE test_kills;
CREATE FUNCTION test_kill_backend() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM test_kill_on_end WHERE task_id = NEW.id) THEN
        IF nextval('test_kills') <= 2 THEN
            PERFORM pg_terminate_backend(pg_backend_pid());
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_kill_backend BEFORE UPDATE ON desktop_tasks
    FOR EACH ROW EXECUTE FUNCTION test_kill_backend();
"""


@pytest.fixture
async def world(pool: AsyncConnectionPool[Conn]) -> World:
    async with pool.connection() as conn:
        return await make_world(conn, brands=1, questions=11, platforms=2)


async def executions(pool: AsyncConnectionPool[Conn], world: World) -> list[Execution]:
    """22 in-progress executions of one brand and day (one shard): a batch of 20 and two for later."""
    async with pool.connection() as conn:
        return await make_executions(conn, world, business_date=DAY)


async def execute(pool: AsyncConnectionPool[Conn], statement: str, *args: object) -> None:
    async with pool.connection() as conn:
        await conn.execute(statement, args or None)


async def declared(amqp: AbstractRobustConnection, topology: Topology) -> None:
    """The shard queues exist before anything is published (results then wait for the worker as one batch)."""
    async with amqp.channel() as channel:
        await declare_ingest(channel, topology)


async def ready_count(amqp: AbstractRobustConnection, queue: str) -> int:
    async with amqp.channel() as channel:
        declared_queue = await channel.declare_queue(queue, passive=True)
        return int(declared_queue.declaration_result.message_count or 0)


async def drain_dlq(amqp: AbstractRobustConnection, topology: Topology) -> list[tuple[dict[str, object], bytes]]:
    async with amqp.channel() as channel:
        dlq = await channel.get_queue(topology.ingest_dlq, ensure=False)
        letters = []
        while (message := await dlq.get(fail=False, no_ack=True)) is not None:
            letters.append((dict(message.headers or {}), message.body))
        return letters


async def applied_ids(pool: AsyncConnectionPool[Conn]) -> list[uuid.UUID]:
    return [r["result_id"] for r in await fetch(pool, "SELECT result_id FROM ingest_applied_results ORDER BY seq")]  # type: ignore[misc]


async def test_one_refused_result_is_dead_lettered_and_the_other_nineteen_applied_once(
        pool, settings, topology, amqp, world) -> None:
    await execute(pool, REFUSE_ONE_ANSWER)
    ex = await executions(pool, world)
    results = [make_result(e, shards=topology.ingest_shards, answer=REFUSED_ANSWER if i == 7 else f"answer {i}")
               for i, e in enumerate(ex[:20])]
    bad, good = results[7], [r for i, r in enumerate(results) if i != 7]
    shard = bad.shard
    assert {r.shard for r in results} == {shard}
    applied_before = m.ingest_results_applied_count.value(status="succeeded")
    fallbacks = m.ingest_poison_fallback_count.value()
    await declared(amqp, topology)
    await publish(amqp, topology, list(results))  # one batch: they wait in the queue for the worker
    async with running_ingest(pool, settings, topology, batch_size=50):
        await eventually(lambda: _n_applied(pool, 19), message="the nineteen good results applied")
        letters: list[tuple[dict[str, object], bytes]] = []

        async def dead_lettered() -> bool:
            letters.extend(await drain_dlq(amqp, topology))
            return len(letters) >= 1

        await eventually(dead_lettered, message="the refused result dead-lettered")
        # The shard keeps consuming.
        later = make_result(ex[20], shards=topology.ingest_shards)
        await publish(amqp, topology, [later])
        await eventually(lambda: _n_applied(pool, 20), message="a result published afterwards applied")
    # Stopped: its channels are closed, so anything it left unacked would be back in the queue.
    assert await ready_count(amqp, topology.ingest_queue(shard)) == 0
    assert await drain_dlq(amqp, topology) == []
    [(headers, body)] = letters
    reason = str(headers["x-dead-letter-reason"])
    assert reason.startswith("db_rejected: RaiseException P0001: simulated bug: this answer cannot be stored"), reason
    assert REFUSED_ANSWER not in reason
    assert headers["x-original-routing-key"] == f"shard.{shard}"
    assert msgspec.json.decode(body, type=MonitorResult).result_id == bad.result_id

    # Exactly once: one ledger entry, one run, one ended execution and one lifecycle event per good result.
    assert await applied_ids(pool) == [r.result_id for r in good] + [later.result_id]
    assert m.ingest_results_applied_count.value(status="succeeded") - applied_before == 20
    assert m.ingest_poison_fallback_count.value() - fallbacks >= 1  # the batch was refused, then split
    runs = await fetch(pool, "SELECT result_id FROM question_monitor_runs")
    assert sorted(str(r["result_id"]) for r in runs) == sorted(str(r.result_id) for r in [*good, later])
    statuses = {r["id"]: r["status"] for r in await fetch(pool, "SELECT id, status FROM desktop_tasks")}
    assert statuses[bad.task_id] == "in_progress"
    assert {statuses[r.task_id] for r in [*good, later]} == {"succeeded"}
    events = await fetch(pool, "SELECT payload FROM outbox WHERE routing_key = 'task.completed'")
    assert len(events) == 20


async def test_a_dead_letter_the_broker_cannot_route_keeps_the_original(pool, settings, topology, amqp,
                                                                        world) -> None:
    [one, two] = (await executions(pool, world))[:2]
    ok = make_result(one, shards=topology.ingest_shards)
    unconfirmed = m.ingest_dead_letter_unconfirmed_count.value()
    async with running_ingest(pool, settings, topology):
        async with amqp.channel() as channel:
            dlq = await channel.get_queue(topology.ingest_dlq, ensure=False)
            # Nothing routes the consumer's copies to the DLQ any more: a dead letter published now vanishes unless
            # it is refused.
            await dlq.unbind(topology.dlx_exchange, routing_key=topology.ingest_dlq_copy_key)
        await publish(amqp, topology, [ok, b"{not json"], shard=ok.shard)
        await eventually(lambda: _n_applied(pool, 1), message="the good result applied")
        # A delivery tries its dead letter three times, then gives the original back: a fourth refusal is
        # the redelivered original trying again.
        await eventually(lambda: m.ingest_dead_letter_unconfirmed_count.value() - unconfirmed >= 4,
                         message="the dead letter refused on the redelivery too")
        async with amqp.channel() as channel:
            dlq = await channel.get_queue(topology.ingest_dlq, ensure=False)
            await dlq.bind(topology.dlx_exchange, routing_key=topology.ingest_dlq_copy_key)
        letters: list[tuple[dict[str, object], bytes]] = []

        async def dead_lettered() -> bool:
            letters.extend(await drain_dlq(amqp, topology))
            return len(letters) >= 1

        await eventually(dead_lettered, timeout=20, message="the redelivered original dead-lettered once routable")
        # The shard is not stuck behind it.
        later = make_result(two, shards=topology.ingest_shards)
        await publish(amqp, topology, [later])
        await eventually(lambda: _n_applied(pool, 2), message="a later result applied")
    assert await ready_count(amqp, topology.ingest_queue(ok.shard)) == 0
    [(headers, body)] = letters
    assert body == b"{not json"
    assert str(headers["x-dead-letter-reason"]).startswith("malformed_json")
    assert await applied_ids(pool) == [ok.result_id, later.result_id]


async def test_a_killed_backend_mid_batch_is_retried_and_dead_letters_nothing(pool, settings, topology, amqp,
                                                                              world) -> None:
    await execute(pool, KILL_BACKEND_TWICE)
    ex = (await executions(pool, world))[:20]
    await execute(pool, "INSERT INTO test_kill_on_end (task_id) VALUES (%s)", ex[12].task_id)
    results = [make_result(e, shards=topology.ingest_shards) for e in ex]
    transient, dead = m.ingest_transient_error_count.value(), _dead_letters()
    await declared(amqp, topology)
    await publish(amqp, topology, list(results))
    async with running_ingest(pool, settings, topology):
        await eventually(lambda: _n_applied(pool, 20), message="every result applied")
    [kills] = await fetch(pool, "SELECT last_value FROM test_kills")
    assert kills["last_value"] == 3  # killed twice, then the third apply of that result went through
    assert m.ingest_transient_error_count.value() - transient >= 2
    assert _dead_letters() == dead
    assert await drain_dlq(amqp, topology) == []
    assert await ready_count(amqp, topology.ingest_queue(results[0].shard)) == 0
    assert sorted(map(str, await applied_ids(pool))) == sorted(str(r.result_id) for r in results)
    assert len(await fetch(pool, "SELECT 1 FROM question_monitor_runs")) == 20


async def test_a_killed_backend_while_isolating_a_refused_result_is_retried_not_dead_lettered(
        pool, settings, topology, amqp, world) -> None:
    """The batch is refused (one answer the test trigger refuses), so it is applied one result at a time; one of
    those transactions then loses its connection twice. Only the refused result is dead-lettered."""
    await execute(pool, REFUSE_ONE_ANSWER)
    await execute(pool, KILL_BACKEND_TWICE)
    ex = await executions(pool, world)
    await execute(pool, "INSERT INTO test_kill_on_end (task_id) VALUES (%s)", ex[12].task_id)
    results = [make_result(e, shards=topology.ingest_shards, answer=REFUSED_ANSWER if i == 4 else "fine")
               for i, e in enumerate(ex[:20])]
    transient = m.ingest_transient_error_count.value()
    await declared(amqp, topology)
    await publish(amqp, topology, list(results))
    async with running_ingest(pool, settings, topology):
        await eventually(lambda: _n_applied(pool, 19), message="the nineteen storable results applied")
        letters: list[tuple[dict[str, object], bytes]] = []

        async def dead_lettered() -> bool:
            letters.extend(await drain_dlq(amqp, topology))
            return len(letters) >= 1

        await eventually(dead_lettered, message="the refused result dead-lettered")
        # The shard survived the lost connections: it keeps consuming.
        later = make_result(ex[20], shards=topology.ingest_shards)
        await publish(amqp, topology, [later])
        await eventually(lambda: _n_applied(pool, 20), message="a result published afterwards applied")
    [kills] = await fetch(pool, "SELECT last_value FROM test_kills")
    assert kills["last_value"] == 3
    assert m.ingest_transient_error_count.value() - transient >= 2
    [(headers, body)] = letters
    assert str(headers["x-dead-letter-reason"]).startswith("db_rejected: RaiseException P0001")
    assert msgspec.json.decode(body, type=MonitorResult).result_id == results[4].result_id
    assert await drain_dlq(amqp, topology) == []
    assert await ready_count(amqp, topology.ingest_queue(results[0].shard)) == 0
    expected = [r.result_id for i, r in enumerate(results) if i != 4]
    assert await applied_ids(pool) == [*expected, later.result_id]  # once each, in delivery order


def _dead_letters() -> float:
    samples = m.ingest_dead_letter_count.collect()[0].samples
    return sum(s.value for s in samples)


async def _n_applied(pool: AsyncConnectionPool[Conn], n: int) -> bool:
    return len(await applied_ids(pool)) >= n


async def test_a_refused_grant_holds_the_results_until_it_is_granted_and_dead_letters_none(
        pool, settings, topology, amqp, world) -> None:
    """A rolling deploy between `migrate` and `db-roles`: the ingest role lacks a grant its statements need
    (here INSERT on question_monitor_runs, a real role and login). The shard holds its results and retries, as
    through a database outage, and applies them once the grant comes; none goes to the dead-letter queue (before,
    InsufficientPrivilege was taken for the message's fault: every result was dead-lettered)."""
    prefix = f"igr{uuid.uuid4().hex[:8]}_"
    login = prefix + "login"
    ingest_role = role_name(prefix, "ingest-shard-workers")
    ex = await executions(pool, world)
    results = [make_result(e, shards=topology.ingest_shards) for e in ex[:3]]
    async with pool.connection() as conn:
        await apply_roles(conn, prefix)
        await conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(login),
                                                                               sql.Identifier(ingest_role)))
        await conn.execute(sql.SQL("REVOKE INSERT ON question_monitor_runs FROM {}").format(
            sql.Identifier(ingest_role)))
    login_pool = make_pool(replace(settings, database_url=make_conninfo(settings.database_url, user=login)),
                           name="ingest-as-login", min_size=1, max_size=2)
    await login_pool.open(wait=True)
    transient_before = m.ingest_transient_error_count.value()
    try:
        await declared(amqp, topology)
        await publish(amqp, topology, list(results))
        async with running_ingest(login_pool, settings, topology, batch_size=50):
            await eventually(lambda: m.ingest_transient_error_count.value() - transient_before >= 3,
                             message="the refused grant retried as a transient error")
            assert await applied_ids(pool) == []
            async with pool.connection() as conn:
                await apply_roles(conn, prefix)  # the deploy's db-roles step
            await eventually(lambda: _n_applied(pool, 3), message="the results applied once granted")
        assert await drain_dlq(amqp, topology) == []
        assert sorted(map(str, await applied_ids(pool))) == sorted(str(r.result_id) for r in results)
    finally:
        await login_pool.close()
        async with pool.connection() as conn:
            await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(login)))
            await drop_roles(conn, prefix)
