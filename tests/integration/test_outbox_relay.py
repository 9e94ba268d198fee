"""A writer relaying its own outbox rows (libs/outbox/relay.py), against real Postgres and RabbitMQ: claimed in
the writing transaction, published after the commit, per-key order kept, and the pumps take over whatever the
writer does not finish."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import LifecycleEvent
from libs.db.pool import Conn, connect
from libs.mq.topology import LIFECYCLE
from libs.outbox import NOTIFY_CHANNEL, OutboxEvent, enqueue, enqueue_many
from libs.outbox.relay import AmqpPublisher, ClaimedEvent, OutboxRelay, PublishError, claim_own
from libs.outbox.writer import PRIORITY_WAKE
from tests.integration.test_outbox import running_pump
from tests.support.capture import capture
from tests.support.wait import eventually


def _event(n: int) -> LifecycleEvent:
    return LifecycleEvent(event="client.online", tenant_id=1, occurred_at=datetime.now(UTC), reason=f"seq:{n}")


def _seq(body: bytes) -> int:
    return int(msgspec.json.decode(body, type=LifecycleEvent).reason.split(":")[1])  # type: ignore[union-attr]


async def _write_and_claim(pool: AsyncConnectionPool[Conn], seqs: list[int], *, key: str | None, lease: float = 5.0,
                           claimed_by: str = "writer") -> tuple[list[uuid.UUID], list[ClaimedEvent]]:
    """One transaction: write `seqs` (one ordering key), claim them for the writer; the claimed rows."""
    async with pool.connection() as conn:
        async with conn.transaction():
            ids = await enqueue_many(conn, [OutboxEvent(exchange=LIFECYCLE, routing_key="client.online",
                                                        message=_event(n), ordering_key=key, priority=1)
                                            for n in seqs])
            own = await claim_own(conn, ids, claimed_by=claimed_by, lease_seconds=lease)
        return ids, await own.events()


async def _rows(pool: AsyncConnectionPool[Conn]) -> dict[int, dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, status, attempts, claimed_by, payload FROM outbox ORDER BY id")
        return {_seq(r["payload"]): r for r in await cur.fetchall()}


class _Refusing:
    """A broker that nacks everything."""

    def ready(self) -> bool:
        return True

    async def wait_ready(self, timeout: float) -> bool:
        return True

    async def publish(self, event: ClaimedEvent) -> None:
        raise PublishError("transient", "broker refused the message")


async def test_writer_publishes_its_own_rows_after_commit_without_waking_the_pumps(
        pool, settings, topology, amqp, database_url) -> None:
    listener = await connect(database_url, name="relay-notify-test")
    publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="relay-test")
    await publisher.start()
    try:
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        relay = OutboxRelay(pool, publisher, claimed_by="writer")
        async with capture(amqp, topology.lifecycle_exchange) as cap:
            _, claimed = await _write_and_claim(pool, [1, 2, 3], key="client:a")
            rows = await _rows(pool)
            assert {n: (r["status"], r["attempts"], r["claimed_by"]) for n, r in rows.items()} == {
                n: ("running", 1, "writer") for n in (1, 2, 3)}
            assert [_seq(e.payload) for e in sorted(claimed, key=lambda e: e.id)] == [1, 2, 3]
            assert await relay.process(claimed) == 3
            await eventually(lambda: len(cap.messages) == 3, message="three events on the broker")
            assert [_seq(b) for b in cap.bodies] == [1, 2, 3]  # one key: commit order
        assert {r["status"] for r in (await _rows(pool)).values()} == {"published"}
        # Every row was claimed in the writing transaction: no NOTIFY was sent for the pumps.
        assert [n async for n in listener.notifies(timeout=0.3)] == []
    finally:
        await publisher.close()
        await listener.close()


async def test_a_row_behind_an_unfinished_row_of_its_key_is_left_to_the_pumps(pool, database_url) -> None:
    async with pool.connection() as conn, conn.transaction():  # an earlier, unpublished event of key "client:a"
        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=_event(0),
                      ordering_key="client:a", priority=1)
    listener = await connect(database_url, name="relay-notify-test")
    try:
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        _, claimed_a = await _write_and_claim(pool, [1, 2], key="client:a")
        _, claimed_b = await _write_and_claim(pool, [3], key="client:b")
        _, claimed_none = await _write_and_claim(pool, [4], key=None)
        assert claimed_a == []  # behind event 0: the writer must not overtake it
        assert [_seq(e.payload) for e in claimed_b + claimed_none] == [3, 4]
        status = {n: r["status"] for n, r in (await _rows(pool)).items()}
        assert status == {0: "queued", 1: "queued", 2: "queued", 3: "running", 4: "running"}
        # The commit that left rows queued woke the pumps' priority loop; the others woke nobody.
        assert [n.payload async for n in listener.notifies(timeout=0.3)] == [PRIORITY_WAKE]
    finally:
        await listener.close()


async def test_a_failed_relay_publish_goes_back_to_the_pumps_with_backoff(pool, settings, topology, amqp) -> None:
    _, claimed = await _write_and_claim(pool, [1, 2], key="client:a")
    relay = OutboxRelay(pool, _Refusing(), claimed_by="writer", backoff_base_ms=50, backoff_max_ms=50)
    assert await relay.process(claimed) == 0
    rows = await _rows(pool)
    # The first failed (attempt counted, retryable); the second was never tried (attempt given back).
    assert {n: (r["status"], r["attempts"], r["claimed_by"]) for n, r in rows.items()} == {
        1: ("retryable", 1, None), 2: ("queued", 0, None)}
    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(pool, settings, topology,
                                                                                poll_interval_s=0.05):
        await eventually(lambda: len(cap.messages) == 2, message="the pump published both")
        assert [_seq(b) for b in cap.bodies] == [1, 2]


async def test_rows_of_a_writer_that_died_after_its_commit_are_reclaimed_by_a_pump(
        pool, settings, topology, amqp) -> None:
    await _write_and_claim(pool, [1], key="client:a", lease=0.2, claimed_by="dead-writer")  # never relayed
    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(pool, settings, topology,
                                                                                poll_interval_s=0.05):
        await eventually(lambda: len(cap.messages) == 1, message="the pump published the abandoned row")
    rows = await _rows(pool)
    assert (rows[1]["status"], rows[1]["attempts"], rows[1]["claimed_by"]) == ("published", 2, "pump-a")


async def test_claim_own_outside_a_transaction_is_refused(pool) -> None:
    async with pool.connection() as conn:
        with pytest.raises(RuntimeError, match="inside the writing transaction"):
            await claim_own(conn, [uuid.uuid4()], claimed_by="writer", lease_seconds=5)


async def test_the_relay_of_a_rolled_back_transaction_has_nothing_to_publish(pool) -> None:
    with pytest.raises(RuntimeError):
        async with pool.connection() as conn, conn.transaction():
            ids = await enqueue_many(conn, [OutboxEvent(exchange=LIFECYCLE, routing_key="client.online",
                                                        message=_event(1), priority=1)])
            await claim_own(conn, ids, claimed_by="writer", lease_seconds=5)
            raise RuntimeError("business failure after the claim")
    assert await _rows(pool) == {}
