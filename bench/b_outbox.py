"""Outbox: events/s from one pump process, and commit -> delivered latency with LISTEN/NOTIFY vs 200 ms polling."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aio_pika
import msgspec

from bench.common import bench_environment, summary
from libs.config import Settings
from libs.contracts.amqp import LifecycleEvent
from libs.db.pool import make_pool
from libs.mq.topology import LIFECYCLE, Topology
from libs.outbox import OutboxEvent, enqueue, enqueue_many
from tests.support.procs import ServiceProcess, service_env


def _event(tenant_id: int, reason: str) -> LifecycleEvent:
    return LifecycleEvent(event="client.online", tenant_id=tenant_id, occurred_at=datetime.now(UTC), reason=reason)


PROBE_KEY = "client.online"
BACKGROUND_KEY = "client.offline"


async def _consumer(settings: Settings) -> tuple[aio_pika.abc.AbstractRobustConnection, asyncio.Queue[bytes]]:
    """The probes' consumer (probes only). Background events are routed to a queue of their own that nobody
    drains, so the broker takes each of them but this process does not also consume 500 messages/s on the
    2 cores it shares with the pump, Postgres and RabbitMQ."""
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    connection = await aio_pika.connect_robust(settings.amqp_url)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=2000)
    exchange = await channel.declare_exchange(topology.lifecycle_exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    sink = await channel.declare_queue(exclusive=True, auto_delete=True)
    await sink.bind(exchange, BACKGROUND_KEY)
    queue = await channel.declare_queue(exclusive=True, auto_delete=True)
    await queue.bind(exchange, PROBE_KEY)
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        received.put_nowait(message.body)
        await message.ack()

    await queue.consume(on_message)
    return connection, received


async def throughput(settings: Settings, events: int, log_dir: Path) -> float:
    """Events/s published (broker-confirmed) by one pump process, from the outbox's own published_at
    timestamps. The events are routed to a bound queue that nobody drains, so the broker persists each one
    but a consumer in this process does not share the 2 cores as a second bottleneck."""
    pool = make_pool(settings, name="bench", min_size=1, max_size=2)
    await pool.open()
    async with pool.connection() as conn, conn.transaction():
        for i in range(events):
            await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=_event(1, str(i)))
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    connection = await aio_pika.connect_robust(settings.amqp_url)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(topology.lifecycle_exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exclusive=True, auto_delete=True)
    await queue.bind(exchange, "#")
    pump = ServiceProcess("outbox-pump", service_env(settings, OUTBOX_BATCH_SIZE=500), log_dir=log_dir)
    await asyncio.to_thread(pump.start)
    async with pool.connection() as conn:
        while True:
            cur = await conn.execute(
                "SELECT count(*) AS n, extract(epoch FROM max(published_at) - min(published_at)) AS span "
                "FROM outbox WHERE status = 'published'")
            row = await cur.fetchone()
            assert row is not None
            if row["n"] == events:
                break
            await asyncio.sleep(0.2)  # polling the database for the pump's progress
    await asyncio.to_thread(pump.stop)
    await connection.close()
    await pool.close()
    return float(events) / float(row["span"])


async def latency(settings: Settings, *, listen: bool, poll_ms: int, seconds: float, background_rate: int,
                  log_dir: Path) -> tuple[list[float], list[float]]:
    """(commit -> delivered to a consumer, commit -> marked published after the broker's confirm), in ms."""
    pool = make_pool(settings, name="bench", min_size=2, max_size=4)
    await pool.open()
    connection, received = await _consumer(settings)
    pump = ServiceProcess("outbox-pump", service_env(settings, OUTBOX_LISTEN=str(listen).lower(),
                                                     OUTBOX_POLL_INTERVAL_MS=poll_ms), log_dir=log_dir)
    await asyncio.to_thread(pump.start)
    committed: dict[str, asyncio.Future[float]] = {}
    committed_wall: dict[str, float] = {}
    samples: list[float] = []
    stop = asyncio.Event()

    async def background() -> None:
        # Bulk writers rely on the pump draining (no NOTIFY); 10 events per transaction, one INSERT.
        n = 0
        interval = 10 / background_rate
        next_at = time.perf_counter()
        while not stop.is_set():
            async with pool.connection() as conn, conn.transaction():
                await enqueue_many(conn, [OutboxEvent(exchange=LIFECYCLE, routing_key=BACKGROUND_KEY,
                                                      message=_event(2, f"bg{n + i}")) for i in range(10)])
                n += 10
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    async def probes() -> None:
        n = 0
        while not stop.is_set():
            reason = f"probe{n}"
            n += 1
            committed[reason] = asyncio.get_running_loop().create_future()
            async with pool.connection() as conn:
                async with conn.transaction():
                    await enqueue(conn, exchange=LIFECYCLE, routing_key=PROBE_KEY, message=_event(1, reason),
                                  notify=True)
                committed[reason].set_result(time.perf_counter())
                committed_wall[reason] = time.time()
            await asyncio.sleep(0.02)

    async def collect() -> None:
        while True:
            body = await received.get()
            reason = msgspec.json.decode(body, type=LifecycleEvent).reason or ""
            arrived = time.perf_counter()
            if reason.startswith("probe"):
                # The commit timestamp is taken just after COMMIT returns, which may be after delivery.
                samples.append((arrived - await committed[reason]) * 1000)

    tasks = [asyncio.create_task(background()), asyncio.create_task(probes()), asyncio.create_task(collect())]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.sleep(0.5)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(pump.stop)
    # published_at is the time the pump got the broker's confirm for that event.
    confirmed: list[float] = []
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT payload, extract(epoch FROM published_at)::float8 AS at FROM outbox "
                                 "WHERE status = 'published' AND payload LIKE %(probe)s", {"probe": b"%probe%"})
        for row in await cur.fetchall():
            reason = msgspec.json.decode(row["payload"], type=LifecycleEvent).reason or ""
            if reason in committed_wall:
                confirmed.append((row["at"] - committed_wall[reason]) * 1000)
    await connection.close()
    await pool.close()
    return samples, confirmed


async def run(args: argparse.Namespace) -> None:
    events = 5_000 if args.quick else 30_000
    seconds = 5.0 if args.quick else 20.0
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        async with bench_environment() as settings:
            rate = await throughput(settings, events, log_dir)
            print(f"outbox throughput, one pump process, {events} events: {rate:,.0f} events/s")
        for listen, poll in ((True, 1000), (False, 200)):
            async with bench_environment() as settings:
                delivered, confirmed = await latency(settings, listen=listen, poll_ms=poll, seconds=seconds,
                                                     background_rate=500, log_dir=log_dir)
                mode = "LISTEN/NOTIFY" if listen else f"polling every {poll} ms"
                print(f"commit -> broker-confirmed latency ms ({mode}, 500 events/s background): {summary(confirmed)}")
                print(f"commit -> delivered latency ms ({mode}, 500 events/s background): {summary(delivered)}")
