"""Tenant-fair projection rebuild claims against real Postgres (and RabbitMQ for the event path): a tenant's burst of
rebuild keys does not hold back another tenant's few. Measured by the claim round in which each key was taken (event
path rounds, sweep and merge-mode batches) and by its place in the order of rebuilds, not by wall time: tenants take
turns within every claim, each tenant's keys oldest first, whatever order the events arrive in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from datetime import UTC, date, datetime

import aio_pika
import msgspec
import pytest
from aio_pika.abc import AbstractRobustConnection
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import ProjectionRebuild
from libs.db.pool import Conn
from libs.mq.topology import Topology
from libs.telemetry import metrics as m
from services.projection_worker.consumer import ProjectionWorker
from services.projection_worker.rebuild import Claim, ProjectionConfig, Rebuilder, Trigger
from tests.support.ingest_factory import fetch
from tests.support.projection import running_projection
from tests.support.wait import eventually

DAY = date(2026, 3, 15)
A, B, C = 9_001, 9_002, 9_003  # tenants (the queue table holds bare ids: keys without runs rebuild to nothing)


class RecordingRebuilder(Rebuilder):
    """The real rebuilder; remembers what each claim round took, in the order the claim returned it."""

    def __init__(self, pool: AsyncConnectionPool[Conn], instance_id: str) -> None:
        super().__init__(pool, ProjectionConfig(instance_id=instance_id))
        self.rounds: list[list[Claim]] = []
        self.rebuilt: list[tuple[tuple[int, int, date], Trigger]] = []  # in rebuild order

    async def claim_oldest(self, limit: int, *, skip: Collection[tuple[int, int, date]] = ()) -> list[Claim]:
        claims = await super().claim_oldest(limit, skip=skip)
        if claims:  # a round that found nothing to claim is not a round
            self.rounds.append(claims)
        return claims

    async def rebuild(self, claim: Claim, trigger: Trigger) -> bool:
        self.rebuilt.append((claim.key_tuple, trigger))
        return await super().rebuild(claim, trigger)

    def round_of(self, tenant_id: int) -> list[int]:
        """For each key of `tenant_id` claimed so far, the (1-based) claim round that took it."""
        return [n for n, claims in enumerate(self.rounds, 1) for c in claims if c.tenant_id == tenant_id]

    def shares(self) -> list[dict[int, int]]:
        return [dict(Counter(c.tenant_id for c in claims)) for claims in self.rounds]


async def enqueue_burst(pool: AsyncConnectionPool[Conn], tenant_id: int, keys: int, *, after_s: float) -> None:
    """`keys` rebuild requests of one tenant, one brand each, requested one millisecond apart from `after_s`
    seconds past a fixed origin (so every tenant's burst comes strictly after the previous one's)."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO projection_rebuild_queue (tenant_id, brand_id, business_date, requested_at, "
            "last_requested_at) SELECT %(t)s, g, %(d)s, t0, t0 FROM generate_series(1, %(n)s) g, "
            "LATERAL (SELECT timestamptz '2026-03-15 08:00+00' + make_interval(secs => %(s)s + g / 1000.0)) o(t0)",
            {"t": tenant_id, "d": DAY, "n": keys, "s": after_s})


async def queued(pool: AsyncConnectionPool[Conn], tenant_id: int) -> int:
    rows = await fetch(pool, "SELECT count(*) AS n FROM projection_rebuild_queue WHERE tenant_id = %s", tenant_id)
    return int(rows[0]["n"])  # type: ignore[call-overload]


def worker(amqp: AbstractRobustConnection, topology: Topology, rebuilder: Rebuilder, **kwargs: int) -> ProjectionWorker:
    return ProjectionWorker(amqp, topology, rebuilder, **kwargs)  # type: ignore[arg-type]  # kwargs: all ints


async def test_a_burst_of_one_tenant_does_not_hold_back_another_tenants_sweep(pool, amqp, topology) -> None:
    await enqueue_burst(pool, A, 2000, after_s=0)
    await enqueue_burst(pool, B, 10, after_s=10)  # B asks after every one of A's 2,000 requests
    rebuilder = RecordingRebuilder(pool, "projection-fair")
    sweeper = worker(amqp, topology, rebuilder, sweep_batch=50)

    assert await sweeper.sweep_once() == 50
    # B's fair share of a 50-key sweep between two tenants is 25, more than its 10 keys: all of them in round 1
    # (oldest-first would have taken them in round 41, after A's 2,000) and rebuilt, not only claimed.
    assert rebuilder.round_of(B) == [1] * 10
    assert await queued(pool, B) == 0
    # A keeps the rest of the batch (a full batch), its own oldest keys first, A and B taking turns.
    first = rebuilder.rounds[0]
    assert [c.brand_id for c in first if c.tenant_id == A] == list(range(1, 41))
    assert [c.tenant_id for c in first[:20]] == [A, B] * 10  # A's oldest key waited longest: A goes first
    # With B served, A's burst has every batch to itself.
    assert await sweeper.sweep_once() == 50 and await sweeper.sweep_once() == 50
    assert rebuilder.shares() == [{A: 40, B: 10}, {A: 50}, {A: 50}]
    assert [c.brand_id for c in rebuilder.rounds[1]] == list(range(41, 91))
    assert await queued(pool, A) == 2000 - 140


async def test_merge_batches_share_between_tenants_with_pending_keys(pool, amqp, topology) -> None:
    await enqueue_burst(pool, A, 2000, after_s=0)
    await enqueue_burst(pool, C, 300, after_s=10)
    await enqueue_burst(pool, B, 10, after_s=20)
    rebuilder = RecordingRebuilder(pool, "projection-merge-fair")
    merger = worker(amqp, topology, rebuilder, merge_batch=200)

    for _ in range(4):
        assert await merger.merge_once() == 200  # every batch full, rebuilt in one transaction
    # Every batch: the tenants with keys left share it in turns (a third each, until B runs out of keys; then
    # halves, until C does); what a tenant cannot use goes to the others.
    assert rebuilder.shares() == [{A: 95, C: 95, B: 10}, {A: 100, C: 100}, {A: 100, C: 100}, {A: 195, C: 5}]
    assert rebuilder.round_of(B) == [1] * 10
    assert await queued(pool, B) == 0 and await queued(pool, C) == 0
    assert await queued(pool, A) == 2000 - 490
    # Per tenant the keys still go oldest first, batch after batch.
    assert [c.brand_id for n in range(4) for c in rebuilder.rounds[n] if c.tenant_id == C] == list(range(1, 301))


async def test_a_fair_claim_keeps_the_lease_rules_and_steps_over_locked_and_claimed_keys(pool) -> None:
    await enqueue_burst(pool, A, 100, after_s=0)
    await enqueue_burst(pool, B, 10, after_s=10)
    other = Rebuilder(pool, ProjectionConfig(instance_id="projection-other", lease_s=60))
    async with pool.connection() as conn:
        # B's two oldest keys: one claimed by another worker (a live lease), one abandoned (an expired lease);
        # A's oldest key is out of attempts (an operator's to look at).
        await conn.execute("UPDATE projection_rebuild_queue SET claimed_by = 'projection-other', "
                           "claim_expires_at = now() + interval '1 minute' WHERE tenant_id = %s AND brand_id = 1", (B,))
        await conn.execute("UPDATE projection_rebuild_queue SET claimed_by = 'projection-dead', attempts = 3, "
                           "claim_expires_at = now() - interval '1 second' WHERE tenant_id = %s AND brand_id = 2", (B,))
        await conn.execute("UPDATE projection_rebuild_queue SET attempts = 10 WHERE tenant_id = %s AND brand_id = 1",
                           (A,))
    rebuilder = RecordingRebuilder(pool, "projection-fair")
    async with pool.connection() as locker, locker.transaction():
        # B's keys 3..5 are locked right now (another worker's claim statement, or a writer re-requesting them).
        await locker.execute("SELECT 1 FROM projection_rebuild_queue WHERE tenant_id = %s AND brand_id BETWEEN 3 AND 5 "
                             "FOR UPDATE", (B,))
        claims = await rebuilder.claim_oldest(12)
    # Skipped: B's live claim, A's exhausted key (neither is claimable), and B's locked keys 3..5 (their turns are
    # stepped over, the next keys in turn order taken instead: still a full batch). Claimable again: B's abandoned key.
    assert [(c.tenant_id, c.brand_id) for c in claims] == [
        (A, 2), (B, 2), (A, 3), (A, 4), (A, 5), (A, 6), (B, 6), (A, 7), (B, 7), (A, 8), (B, 8), (A, 9)]
    rows = await fetch(pool, "SELECT tenant_id, brand_id, claimed_by, attempts, "
                             "extract(epoch FROM claim_expires_at - now()) AS lease_left_s "
                             "FROM projection_rebuild_queue WHERE claimed_by = 'projection-fair'")
    assert len(rows) == 12
    for row in rows:  # the claim lease, one attempt counted, exactly as before
        assert 25 < float(row["lease_left_s"]) <= 30  # type: ignore[arg-type]
        assert row["attempts"] == (4 if (row["tenant_id"], row["brand_id"]) == (B, 2) else 1)
    assert await other.claim_key(A, 2, DAY) is None  # held by this claim now
    # Another worker's claim while these are held: the next keys, none of these; B's keys 3..5 are free again.
    again = await Rebuilder(pool, ProjectionConfig(instance_id="projection-fair-2")).claim_oldest(12)
    assert [(c.tenant_id, c.brand_id) for c in again] == [
        (A, 10), (B, 3), (A, 11), (B, 4), (A, 12), (B, 5), (A, 13), (B, 9), (A, 14), (B, 10), (A, 15), (A, 16)]
    assert await rebuilder.rebuild(claims[1], "sweep") is True
    assert await fetch(pool, "SELECT 1 FROM projection_rebuild_queue WHERE tenant_id = %s AND brand_id = 2", B) == []


async def publish_events(amqp: AbstractRobustConnection, topology: Topology, tenant_id: int, keys: int) -> None:
    """One ProjectionRebuild event per key of `enqueue_burst(tenant_id, keys)`, in key order."""
    async with amqp.channel() as channel:
        exchange = await channel.get_exchange(topology.projection_exchange, ensure=False)
        for brand_id in range(1, keys + 1):
            body = msgspec.json.encode(ProjectionRebuild(tenant_id=tenant_id, brand_id=brand_id, business_date=DAY,
                                                         requested_at=datetime.now(UTC)))
            await exchange.publish(aio_pika.Message(body, content_type="application/json",
                                                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                                   routing_key="rebuild")


@pytest.mark.parametrize("burst", [50, 500])
async def test_a_burst_of_one_tenants_events_does_not_hold_back_another_tenants_key(
        pool: AsyncConnectionPool[Conn], settings: Settings, topology: Topology, amqp: AbstractRobustConnection,
        burst: int) -> None:
    """Tenant A's `burst` keys and their events, then tenant B's one: the broker hands the worker A's events first,
    and B's last, yet B's key is rebuilt in the event path's first claim round, within its first few rebuilds,
    however large A's burst."""
    rebuilder = RecordingRebuilder(pool, "projection-events-fair")
    m.projection_queue_depth.set(-1)
    async with running_projection(pool, settings, topology, sweep_interval_s=60, rebuilder=rebuilder) as worker:
        # Its first sweep, over an empty queue, is over: from now on only the events rebuild.
        await eventually(lambda: REGISTRY.get_sample_value("projection_queue_depth") == 0,
                         message="the first sweep done")
        await enqueue_burst(pool, A, burst, after_s=0)  # what ingest writes with each result ...
        await enqueue_burst(pool, B, 1, after_s=10)
        await publish_events(amqp, topology, A, burst)  # ... and the events it publishes after the commit
        await publish_events(amqp, topology, B, 1)

        async def all_served() -> bool:
            return (await queued(pool, A) == 0 and await queued(pool, B) == 0 and await waiting_in_broker() == 0
                    and worker.inbox.empty() and worker.held_events == 0)

        async def waiting_in_broker() -> int:
            async with amqp.channel() as channel:
                queue = await channel.declare_queue(topology.projection_queue, passive=True)
                return int(queue.declaration_result.message_count or 0)

        await eventually(all_served, timeout=60, message="every key rebuilt and every event settled")
    assert {trigger for _, trigger in rebuilder.rebuilt} == {"event"}
    assert len(rebuilder.rebuilt) == burst + 1
    assert rebuilder.round_of(B) == [1]
    # A's oldest key and B's share the first turn of the first round, which the loop rebuilds in claim order ...
    assert [c.key_tuple for c in rebuilder.rounds[0][:2]] == [(A, 1, DAY), (B, 1, DAY)]
    # ... while the worker's other claim loops rebuild keys of their own rounds meanwhile, as many as the scheduler
    # lets them (a loaded box has let one rebuild four before B's). FIFO by event would have rebuilt B's key last
    # (position `burst`); half of that is a bound no interleaving of the loops reaches without the fair claim.
    position = [key for key, _ in rebuilder.rebuilt].index((B, 1, DAY))
    assert position < burst // 2, position
