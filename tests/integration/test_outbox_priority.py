"""Outbox priority: prioritised events are claimed before older normal ones, per-key order unchanged."""

from __future__ import annotations

from datetime import UTC, datetime

from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import LifecycleEvent
from libs.db.pool import Conn
from libs.mq.topology import LIFECYCLE
from libs.outbox import OutboxEvent, enqueue, enqueue_many
from libs.outbox.pump import ClaimedEvent, OutboxPump, PumpConfig


class _NoBroker:
    """Claims only: nothing is published in these tests."""

    def ready(self) -> bool:
        return True

    async def wait_ready(self, timeout: float) -> bool:
        return True

    async def publish(self, event: ClaimedEvent) -> None:
        raise AssertionError("not used")


def _event(n: int) -> LifecycleEvent:
    return LifecycleEvent(event="client.online", tenant_id=1, occurred_at=datetime.now(UTC), reason=f"seq:{n}")


async def _add(pool: AsyncConnectionPool[Conn], n: int, *, key: str | None = None, priority: int = 0) -> None:
    async with pool.connection() as conn, conn.transaction():
        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=_event(n), ordering_key=key,
                      priority=priority)


async def _finish(pool: AsyncConnectionPool[Conn], batch: list[ClaimedEvent]) -> None:
    async with pool.connection() as conn:
        await conn.execute("UPDATE outbox SET status = 'published', published_at = now(), claim_expires_at = NULL "
                           "WHERE id = ANY(%s)", ([e.id for e in batch],))


def _seqs(batch: list[ClaimedEvent]) -> list[str]:
    return [e.payload.decode().split('"seq:')[1].split('"')[0] for e in sorted(batch, key=lambda e: e.id)]


def _pump(pool: AsyncConnectionPool[Conn]) -> OutboxPump:
    return OutboxPump(pool, _NoBroker(), PumpConfig(claimed_by="prio-test", listen=False))


async def test_high_priority_event_is_claimed_before_older_normal_ones(pool) -> None:
    for n in range(5):
        await _add(pool, n, key=f"client:n{n}")
    await _add(pool, 5)
    await _add(pool, 99, key="client:h", priority=1)
    pump = _pump(pool)
    first = await pump.claim(1)
    assert _seqs(first) == ["99"]
    # The express claim takes prioritised rows only.
    assert await pump.claim(10, min_priority=1) == []
    assert _seqs(await pump.claim(10)) == ["0", "1", "2", "3", "4", "5"]


async def test_enqueue_many_priority_per_event_and_per_batch(pool) -> None:
    async with pool.connection() as conn, conn.transaction():
        await enqueue_many(conn, [
            OutboxEvent(exchange=LIFECYCLE, routing_key="client.online", message=_event(1)),
            OutboxEvent(exchange=LIFECYCLE, routing_key="client.online", message=_event(2), priority=1),
        ])
        await enqueue_many(conn, [OutboxEvent(exchange=LIFECYCLE, routing_key="client.online", message=_event(3))],
                           priority=2)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT priority FROM outbox ORDER BY id")
        assert [r["priority"] for r in await cur.fetchall()] == [0, 1, 2]
    assert _seqs(await _pump(pool).claim(1)) == ["3"]


async def test_priority_never_reorders_one_ordering_key(pool) -> None:
    # Key K: normal, prioritised, normal (commit order). Another key's normal events are older still.
    await _add(pool, 0, key="client:other")
    await _add(pool, 1, key="client:k")
    await _add(pool, 2, key="client:k", priority=1)
    await _add(pool, 3, key="client:k")
    await _add(pool, 4, key="client:k", priority=1)
    pump = _pump(pool)
    # The prioritised row waits for its key's earlier row; the later normal row waits for the prioritised one.
    assert await pump.claim(10, min_priority=1) == []
    batch = await pump.claim(10)
    assert _seqs(batch) == ["0", "1"]
    assert await pump.claim(10) == []  # "1" is running: nothing of key K may overtake it
    await _finish(pool, batch)
    batch = await pump.claim(10)
    assert _seqs(batch) == ["2"]
    await _finish(pool, batch)
    batch = await pump.claim(10)
    assert _seqs(batch) == ["3"]
    await _finish(pool, batch)
    assert _seqs(await pump.claim(10, min_priority=1)) == ["4"]


async def test_notify_payload_says_whether_prioritised_rows_were_written(pool, database_url) -> None:
    """The pump wakes its priority loop only for a NOTIFY whose payload is PRIORITY_WAKE."""
    from libs.db.pool import connect
    from libs.outbox import NOTIFY_CHANNEL
    from libs.outbox.writer import PRIORITY_WAKE, REGULAR_WAKE

    listener = await connect(database_url, name="notify-test")
    try:
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        async with pool.connection() as conn:
            async with conn.transaction():
                await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=_event(1), notify=True)
            async with conn.transaction():
                await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", message=_event(2), notify=True,
                              priority=1)
            async with conn.transaction():
                await enqueue_many(conn, [OutboxEvent(exchange=LIFECYCLE, routing_key="client.online",
                                                      message=_event(3)),
                                          OutboxEvent(exchange=LIFECYCLE, routing_key="client.online",
                                                      message=_event(4), priority=1)], notify=True)
        payloads = []
        async for notify in listener.notifies(timeout=5, stop_after=3):
            payloads.append(notify.payload)
        assert payloads == [REGULAR_WAKE, PRIORITY_WAKE, PRIORITY_WAKE]
    finally:
        await listener.close()


def test_a_notify_wakes_an_idle_regular_loop_and_the_priority_loop_only_when_asked() -> None:
    pump = OutboxPump(None, _NoBroker(), PumpConfig(claimed_by="wake-test", concurrency=2))  # type: ignore[arg-type]
    wakes = pump.wakes  # regular loops 0, 1, then the priority loop
    pump.wake(prioritised=False)
    assert [w.is_set() for w in wakes] == [True, False, False]
    for w in wakes:
        w.clear()
    pump.busy[0] = True  # loop 0 is publishing a batch: the next idle loop takes the new event
    pump.wake(prioritised=True)
    assert [w.is_set() for w in wakes] == [False, True, True]


async def test_concurrent_claimers_never_split_one_key_even_without_the_lock_for_prioritised_claims(
        pool: AsyncConnectionPool[Conn]) -> None:
    """Prioritised-only claims (the express loop) take no claim lock. Racing them against regular claims
    (which do) and against each other, no two concurrent batches ever hold rows of the same key, and each
    key's rows are finished in id order."""
    import asyncio
    import collections

    pattern = [0, 1, 0, 1, 1, 0, 0, 1]
    for n in range(len(pattern)):
        for key in range(12):
            await _add(pool, n * 100 + key, key=f"k{key}", priority=pattern[n])
    pumps = [_pump(pool) for _ in range(4)]
    finished: dict[str, list[int]] = collections.defaultdict(list)
    rounds = 0
    while True:
        rounds += 1
        assert rounds < 200, "the outbox never drained"
        batches = await asyncio.gather(pumps[0].claim(), pumps[1].claim(limit=3),
                                       pumps[2].claim(5, min_priority=1), pumps[3].claim(5, min_priority=1))
        if not any(batches):
            break
        owner: dict[str, int] = {}
        for index, batch in enumerate(batches):
            for event in batch:
                assert owner.setdefault(str(event.ordering_key), index) == index, (
                    f"key {event.ordering_key} claimed by two concurrent batches")
        for batch in batches:
            for event in sorted(batch, key=lambda e: e.id):
                finished[str(event.ordering_key)].append(event.id)
            await _finish(pool, batch)
    assert sum(len(ids) for ids in finished.values()) == len(pattern) * 12
    for key, ids in finished.items():
        assert ids == sorted(ids), f"key {key} finished out of order"
