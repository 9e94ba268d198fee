"""The transactional outbox against real Postgres and RabbitMQ."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from urllib.parse import urlparse

import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import LifecycleEvent
from libs.db.pool import Conn
from libs.mq.topology import LIFECYCLE, Topology
from libs.outbox import enqueue
from libs.outbox.pump import AmqpPublisher, ClaimedEvent, OutboxPump, PumpConfig
from tests.support.capture import capture
from tests.support.tcpproxy import TcpProxy
from tests.support.wait import eventually


def lifecycle(tenant_id: int, n: int = 0) -> LifecycleEvent:
    return LifecycleEvent(event="client.online", tenant_id=tenant_id, occurred_at=datetime.now(UTC),
                          reason=f"seq:{n}")


async def make_tenant(conn: Conn, name: str = "acme") -> int:
    cur = await conn.execute("INSERT INTO tenants (name) VALUES (%s) RETURNING id", (name,))
    row = await cur.fetchone()
    assert row is not None
    return int(row["id"])


@contextlib.asynccontextmanager
async def running_pump(pool: AsyncConnectionPool[Conn], settings: Settings, topology: Topology, *,
                       amqp_url: str | None = None, name: str = "pump-a", **config: object) -> (
    AsyncIterator[OutboxPump]
):
    publisher = AmqpPublisher(amqp_url or settings.amqp_url, topology, timeout=5, name=name)
    await publisher.start()
    pump = OutboxPump(pool, publisher, PumpConfig(claimed_by=name, **config),  # type: ignore[arg-type]
                      listen_url=settings.database_url)
    stop = asyncio.Event()
    task = asyncio.create_task(pump.run(stop))
    try:
        yield pump
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await publisher.close()


async def outbox_rows(pool: AsyncConnectionPool[Conn]) -> list[dict[str, object]]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT * FROM outbox ORDER BY id")
        return list(await cur.fetchall())


async def test_committed_event_is_published_with_trace_context(pool, settings, topology, amqp) -> None:
    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(pool, settings, topology) as pump:
        await eventually(lambda: pump.listening.is_set(), message="pump listening")
        async with pool.connection() as conn, conn.transaction():
            tenant_id = await make_tenant(conn)
            await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=lifecycle(tenant_id),
                          tenant_id=tenant_id, notify=True)
        await asyncio.wait_for(cap.arrived.wait(), 10)
        message = cap.messages[0]
        decoded = msgspec.json.decode(message.body, type=LifecycleEvent)
        assert decoded.tenant_id == tenant_id
        assert message.headers is not None
        rows = await outbox_rows(pool)
        assert message.headers["traceparent"] == rows[0]["traceparent"]
        await eventually(lambda: _status_is(pool, "published"), message="row marked published")


async def test_rolled_back_transaction_publishes_nothing(pool, settings, topology, amqp) -> None:
    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(pool, settings, topology) as pump:
        with contextlib.suppress(RuntimeError):
            async with pool.connection() as conn, conn.transaction():
                tenant_id = await make_tenant(conn)
                await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online",
                              message=lifecycle(tenant_id), notify=True)
                raise RuntimeError("business failure after the outbox write")
        # A marker committed afterwards proves the pump ran past the point of the rollback.
        async with pool.connection() as conn, conn.transaction():
            marker = await make_tenant(conn, "marker")
            await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=lifecycle(marker),
                          notify=True)
        await asyncio.wait_for(cap.arrived.wait(), 10)
        await eventually(lambda: _status_is(pool, "published"), message="marker marked published")
        assert pump.published_total == 1
        tenants = [msgspec.json.decode(b, type=LifecycleEvent).tenant_id for b in cap.bodies]
        assert tenants == [marker]
        assert len(await outbox_rows(pool)) == 1


async def test_enqueue_outside_a_transaction_is_refused(pool) -> None:
    async with pool.connection() as conn:
        with pytest.raises(RuntimeError, match="inside the caller's transaction"):
            await enqueue(conn, exchange=LIFECYCLE, routing_key="x", message=lifecycle(1))


async def test_broker_down_event_is_retried_and_published_when_back(pool, settings, topology, amqp) -> None:
    url = urlparse(settings.amqp_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 5672)
    await proxy.start()
    proxied = settings.amqp_url.replace(f"{url.hostname}:{url.port or 5672}", f"127.0.0.1:{proxy.port}")
    try:
        async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(
                pool, settings, topology, amqp_url=proxied, backoff_base_ms=50, backoff_max_ms=200):
            await proxy.cut()
            async with pool.connection() as conn, conn.transaction():
                tenant_id = await make_tenant(conn)
                await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online",
                              message=lifecycle(tenant_id), notify=True)
            # While the broker is unreachable the event stays pending and nothing is delivered.
            rows = await outbox_rows(pool)
            assert rows[0]["status"] in {"queued", "retryable", "running"}
            assert not cap.messages
            await proxy.restore()
            await asyncio.wait_for(cap.arrived.wait(), 30)
            await eventually(lambda: _status_is(pool, "published"), timeout=10, message="published after recovery")
            assert len(cap.messages) == 1
    finally:
        await proxy.close()


async def test_pump_killed_after_claiming_is_taken_over_after_the_lease(pool, settings, topology, amqp) -> None:
    async with pool.connection() as conn, conn.transaction():
        tenant_id = await make_tenant(conn)
        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=lifecycle(tenant_id))
    # Pump A claims with a short lease and dies before publishing (it is never run again).
    dead_publisher = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="dead")
    dead = OutboxPump(pool, dead_publisher, PumpConfig(claimed_by="pump-dead", lease_seconds=1.0))
    claimed = await dead.claim()
    assert [e.attempts for e in claimed] == [1]
    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(
            pool, settings, topology, name="pump-b", poll_interval_s=0.2):
        # Not before the lease expires...
        assert (await outbox_rows(pool))[0]["status"] == "running"
        await asyncio.wait_for(cap.arrived.wait(), 15)
        await eventually(lambda: _status_is(pool, "published"), message="taken over and published")
        rows = await outbox_rows(pool)
        assert rows[0]["attempts"] == 2
        assert len(cap.messages) == 1


async def test_poison_event_is_dead_lettered_with_its_reason(pool, settings, topology, amqp) -> None:
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO outbox (event_id, exchange, routing_key, message_type, payload) "
            "VALUES (%s, 'monitor.lifecycle', 'client.online', 'lifecycle', %s)",
            (uuid.uuid4(), b'{"type": "lifecycle", "event": "client.online"}'))
    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(pool, settings, topology):
        await eventually(lambda: _status_is(pool, "dead_letter"), message="poison dead-lettered")
        row = (await outbox_rows(pool))[0]
        assert "payload does not match lifecycle" in str(row["last_error"])
        assert "tenant_id" in str(row["last_error"])
        assert row["attempts"] == 1
        assert not cap.messages


async def test_dead_letter_is_replayed_only_by_command(pool, settings, topology, amqp, database_url) -> None:
    # An event that exhausted its attempts: the pump holding its only attempt died (its claim's lease ran out). An
    # unreachable broker alone never spends an attempt.
    async with pool.connection() as conn, conn.transaction():
        tenant_id = await make_tenant(conn)
        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=lifecycle(tenant_id),
                      max_attempts=1)
    unreachable = AmqpPublisher("amqp://guest:guest@127.0.0.1:1/", topology, timeout=1, name="down")
    for _ in range(3):
        await OutboxPump(pool, unreachable, PumpConfig(claimed_by="pump-down")).run_once()
    row = (await outbox_rows(pool))[0]
    assert (row["status"], row["attempts"]) == ("queued", 0)
    dead = OutboxPump(pool, unreachable, PumpConfig(claimed_by="pump-dead", lease_seconds=0.2))
    assert len(await dead.claim()) == 1
    await eventually(dead.reclaim_expired, message="the dead pump's claim reclaimed")
    row = (await outbox_rows(pool))[0]
    assert row["status"] == "dead_letter"
    assert "claim lease expired" in str(row["last_error"])

    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(
            pool, settings, topology, poll_interval_s=0.2):
        # A running pump does not replay dead letters on its own.
        await asyncio.sleep(0)  # let the pump take a first turn
        async with pool.connection() as conn:
            await conn.execute("SELECT 1")
        assert (await outbox_rows(pool))[0]["status"] == "dead_letter"
        env = {**os.environ, "DATABASE_URL": database_url}
        listed = await monitorctl(env, "--json", "outbox", "dead-letters")
        assert str(row["id"]) in listed and "claim lease expired" in listed
        done = await monitorctl(env, "outbox", "replay", str(row["id"]))
        assert f"replayed 1 event(s): [{row['id']}]" in done
        await asyncio.wait_for(cap.arrived.wait(), 10)
        await eventually(lambda: _status_is(pool, "published"), message="replayed event published")


async def test_two_pumps_publish_5000_events_once_each_in_key_order(pool, settings, topology, amqp) -> None:
    keys = [f"client-{k}" for k in range(20)]
    async with pool.connection() as conn, conn.transaction():
        tenant_id = await make_tenant(conn)
    async with capture(amqp, topology.lifecycle_exchange) as cap, running_pump(
            pool, settings, topology, name="pump-1", batch_size=250), running_pump(
            pool, settings, topology, name="pump-2", batch_size=250):
        sequence = 0
        for _ in range(10):  # 10 transactions of 500 events, keys interleaved
            async with pool.connection() as conn, conn.transaction():
                for _ in range(500):
                    key = keys[sequence % len(keys)]
                    await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online",
                                  message=lifecycle(tenant_id, sequence), ordering_key=key)
                    sequence += 1
                await conn.execute("SELECT pg_notify('outbox_pending', '')")
        await eventually(lambda: len(cap.messages) >= 5000, timeout=60, message="5000 deliveries")
        await eventually(lambda: _status_count(pool, "published", 5000), timeout=10, message="all marked")
    seqs = [int(msgspec.json.decode(b, type=LifecycleEvent).reason.split(":")[1]) for b in cap.bodies]  # type: ignore[union-attr]
    assert len(seqs) == 5000
    assert len(set(seqs)) == 5000, "an event was published twice"
    per_key: dict[int, list[int]] = collections.defaultdict(list)
    for seq in seqs:
        per_key[seq % len(keys)].append(seq)
    for key, received in per_key.items():
        assert received == sorted(received), f"ordering key {key} delivered out of order"


class _ConfirmClock:
    """The real publisher; notes when each publish returned (= its broker confirm arrived)."""

    def __init__(self, inner: AmqpPublisher, slow_reason: str) -> None:
        self.inner = inner
        self.slow_reason = slow_reason
        self.confirmed: dict[int, datetime] = {}

    def ready(self) -> bool:
        return self.inner.ready()

    async def wait_ready(self, timeout: float) -> bool:
        return await self.inner.wait_ready(timeout)

    async def publish(self, event: ClaimedEvent) -> None:
        if self.slow_reason.encode() in event.payload:
            await asyncio.sleep(0.3)  # holds up the end of the batch (and its mark) on purpose
        await self.inner.publish(event)
        self.confirmed[event.id] = datetime.now(UTC)


async def test_published_at_is_the_broker_confirm_time_of_each_event(pool, settings, topology, amqp) -> None:
    """published_at is each event's own confirm time, not the time the batch was marked."""
    tenant_id = await _tenant(pool)
    async with pool.connection() as conn, conn.transaction():
        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=lifecycle(tenant_id, 1))
        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=lifecycle(tenant_id, 2))
    inner = AmqpPublisher(settings.amqp_url, topology, timeout=5, name="confirm-clock")
    await inner.start()
    publisher = _ConfirmClock(inner, slow_reason="seq:2")
    pump = OutboxPump(pool, publisher, PumpConfig(claimed_by="confirm-clock", listen=False))
    try:
        async with capture(amqp, topology.lifecycle_exchange) as cap:
            assert await pump.run_once() == 2
            await eventually(lambda: len(cap.messages) == 2, message="both delivered")
    finally:
        await inner.close()
    rows = {int(r["id"]): r for r in await outbox_rows(pool)}  # type: ignore[call-overload]
    for outbox_id, confirmed in publisher.confirmed.items():
        assert abs((rows[outbox_id]["published_at"] - confirmed).total_seconds()) < 0.05
    fast, slow = sorted(publisher.confirmed, key=lambda i: publisher.confirmed[i])
    # Both were marked after the slow one's confirm; the fast one's published_at is still its own.
    assert (rows[slow]["published_at"] - rows[fast]["published_at"]).total_seconds() >= 0.25


async def _tenant(pool: AsyncConnectionPool[Conn]) -> int:
    async with pool.connection() as conn, conn.transaction():
        return await make_tenant(conn)


async def monitorctl(env: dict[str, str], *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tools.monitorctl", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def _status_is(pool: AsyncConnectionPool[Conn], status: str) -> bool:
    rows = await outbox_rows(pool)
    return bool(rows) and all(r["status"] == status for r in rows)


async def _status_count(pool: AsyncConnectionPool[Conn], status: str, n: int) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS c FROM outbox WHERE status = %s", (status,))
        row = await cur.fetchone()
        return row is not None and int(row["c"]) >= n
