"""Result routing epochs: how many ingest shards results are routed to, and the barrier that lets that number
change while results flow (docs/reliability.md, "Resharding ingest online").

A routing epoch is (epoch, shard count); the hub routes a result to `e{epoch}.shard.{k}` (`shard.{k}` for epoch 0,
the names before resharding existed), k = stable_hash(tenant, brand, business date) % shards. `monitorctl ingest
reshard N --apply` declares the new epoch's queues, makes it the active epoch in Postgres, and unbinds the old
epoch's queues, which are then drained. A new-epoch shard j takes over keys only from the old shards i with
i ≡ j (mod gcd(old, new)) (`source_shards`), and its consumers do not start before each of those is drained: no key
is ever applied by two shards at once, and per-key order carries over the switch. A publisher with a stale epoch
finds its routing key unbound (mandatory publish: returned), reads the epoch again and re-routes.

Pure functions here, the statements beside them; the store is `RoutingStore`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, datetime
from typing import Literal

import msgspec

from libs.contracts.amqp import MonitorResult
from libs.db.pool import Conn
from libs.domain.shard import shard_for

EpochState = Literal["active", "draining", "retired"]
# After the old epoch's bindings are removed, how long before the drain markers go in behind the last results: a
# publish routed just before the unbind may still be on its way into the queue (RabbitMQ enqueues after routing).
DRAIN_GRACE_S = 2.0
# The AMQP `type` of the marker `monitorctl ingest reshard` puts at the tail of each unbound old queue. The queue is
# FIFO and nothing is routed to it any more, so the consumer that reaches the marker, having applied and acked
# everything before it, has drained the shard. (Not the broker's message counts: a quorum queue's declare-ok
# counts lag by seconds, measured here at up to 15 s on a loaded broker, and went 0 while messages were there.)
DRAIN_MARKER_TYPE = "ingest_drain_marker"


@dataclass(frozen=True, slots=True)
class Routing:
    epoch: int
    shards: int

    def shard_of(self, tenant_id: int, brand_id: int, business_date: date) -> int:
        return shard_for(tenant_id, brand_id, business_date, self.shards)

    def routing_key(self, shard: int) -> str:
        return routing_key(self.epoch, shard)


def routing_key(epoch: int, shard: int) -> str:
    return f"shard.{shard}" if epoch == 0 else f"e{epoch}.shard.{shard}"


def queue_suffix(epoch: int, shard: int) -> str:
    return f"monitor.result.ingest.shard.{shard}" if epoch == 0 else f"monitor.result.ingest.e{epoch}.shard.{shard}"


def routed(message: MonitorResult, routing: Routing) -> MonitorResult:
    """`message` with the shard and epoch `routing` gives its key."""
    shard = routing.shard_of(message.tenant_id, message.brand_id, message.business_date)
    return msgspec.structs.replace(message, shard=shard, routing_epoch=routing.epoch)


def source_shards(new_shard: int, old_shards: int, new_shards: int) -> set[int]:
    """The old-epoch shards whose keys can route to `new_shard` of the new epoch: i with i ≡ new_shard (mod g),
    g = gcd(old_shards, new_shards) (h ≡ j mod N and h ≡ i mod M have a common solution h iff i ≡ j mod gcd)."""
    g = math.gcd(old_shards, new_shards)
    return {i for i in range(old_shards) if i % g == new_shard % g}


def may_consume(new_shard: int, old: Routing | None, new_shards: int, drained: set[int]) -> bool:
    """May the consumers of `new_shard` (active epoch) start? Yes without a draining epoch, else once every old
    shard it takes keys from is drained."""
    return old is None or source_shards(new_shard, old.shards, new_shards) <= drained


@dataclass(frozen=True, slots=True)
class EpochRow:
    epoch: int
    shards: int
    state: EpochState
    unbound_at: datetime | None


@dataclass(frozen=True, slots=True)
class RoutingState:
    """What the routing table says now: the active epoch, the one still draining (if a reshard is under way) and
    which of its shards are drained."""
    active: Routing
    draining: Routing | None = None
    unbound_at: datetime | None = None
    drained: frozenset[int] = frozenset()

    @property
    def draining_unbound(self) -> bool:
        return self.draining is not None and self.unbound_at is not None


def plan_reshard(state: RoutingState, new_shards: int) -> dict[str, object]:
    """What `monitorctl ingest reshard N` would do (the dry run): epochs, and for each new shard the old shards it
    waits for."""
    if new_shards <= 0:
        raise ValueError("the shard count must be positive")
    return {"from": {"epoch": state.active.epoch, "shards": state.active.shards},
            "to": {"epoch": state.active.epoch + 1, "shards": new_shards},
            "waits_for": {str(j): sorted(source_shards(j, state.active.shards, new_shards))
                          for j in range(new_shards)}}


CREATE_LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtext('ingest_routing'))"

EPOCHS_SQL = """
SELECT epoch, shards, state, unbound_at FROM ingest_routing_epochs WHERE state <> 'retired' ORDER BY epoch
"""

DRAINED_SQL = "SELECT shard FROM ingest_routing_drains WHERE epoch = %(epoch)s"

# Epoch 0 is what the deployment ran before its first reshard: INGEST_SHARDS shards, the original queue names.
SEED_EPOCH_SQL = """
INSERT INTO ingest_routing_epochs (epoch, shards, state) VALUES (0, %(shards)s, 'active') ON CONFLICT DO NOTHING
"""

START_EPOCH_SQL = """
WITH old AS (
    UPDATE ingest_routing_epochs SET state = 'draining', drain_started_at = now()
    WHERE state = 'active' AND epoch = %(old_epoch)s RETURNING epoch)
INSERT INTO ingest_routing_epochs (epoch, shards, state)
SELECT %(old_epoch)s + 1, %(shards)s, 'active' FROM old
RETURNING epoch
"""

MARK_UNBOUND_SQL = """
UPDATE ingest_routing_epochs SET unbound_at = coalesce(unbound_at, now())
WHERE epoch = %(epoch)s AND state = 'draining'
"""

MARK_DRAINED_SQL = """
INSERT INTO ingest_routing_drains (epoch, shard, drained_by)
SELECT %(epoch)s, %(shard)s, %(by)s FROM ingest_routing_epochs
WHERE epoch = %(epoch)s AND state = 'draining' AND unbound_at IS NOT NULL
ON CONFLICT DO NOTHING
RETURNING drained_at
"""

IS_DRAINED_SQL = "SELECT 1 FROM ingest_routing_drains WHERE epoch = %(epoch)s AND shard = %(shard)s"

RETIRE_SQL = """
UPDATE ingest_routing_epochs e SET state = 'retired', retired_at = now()
WHERE e.epoch = %(epoch)s AND e.state = 'draining'
  AND (SELECT count(*) FROM ingest_routing_drains d WHERE d.epoch = e.epoch) = e.shards
RETURNING epoch
"""


class RoutingStore:
    """The routing epochs in Postgres; `default_shards` (INGEST_SHARDS) is epoch 0 until a reshard writes it."""

    def __init__(self, default_shards: int) -> None:
        self.default_shards = default_shards

    async def state(self, conn: Conn) -> RoutingState:
        cur = await conn.execute(EPOCHS_SQL)
        rows = [EpochRow(int(r["epoch"]), int(r["shards"]), r["state"], r["unbound_at"])
                for r in await cur.fetchall()]
        active = next((Routing(r.epoch, r.shards) for r in rows if r.state == "active"), None)
        if active is None:
            return RoutingState(Routing(0, self.default_shards))
        old = next((r for r in rows if r.state == "draining"), None)
        if old is None:
            return RoutingState(active)
        cur = await conn.execute(DRAINED_SQL, {"epoch": old.epoch})
        drained = frozenset(int(r["shard"]) for r in await cur.fetchall())
        return RoutingState(active, Routing(old.epoch, old.shards), old.unbound_at, drained)

    async def start_epoch(self, conn: Conn, old: Routing, shards: int) -> int | None:
        """Make (old.epoch + 1, shards) the active epoch and `old` draining, if `old` is still the active one and no
        other reshard is draining; the new epoch, or None when the table moved on."""
        async with conn.transaction():
            await conn.execute(CREATE_LOCK_SQL)
            if (await self.state(conn)).draining is not None:
                return None
            await conn.execute(SEED_EPOCH_SQL, {"shards": self.default_shards})
            cur = await conn.execute(START_EPOCH_SQL, {"old_epoch": old.epoch, "shards": shards})
            row = await cur.fetchone()
        return int(row["epoch"]) if row else None

    async def mark_unbound(self, conn: Conn, epoch: int) -> None:
        await conn.execute(MARK_UNBOUND_SQL, {"epoch": epoch})

    async def mark_drained(self, conn: Conn, epoch: int, shard: int, by: str) -> bool:
        """Record (epoch, shard) drained; True when it is (now or before), False when that epoch is not draining
        (a marker that does not belong where it was found)."""
        await conn.execute(MARK_DRAINED_SQL, {"epoch": epoch, "shard": shard, "by": by})
        cur = await conn.execute(IS_DRAINED_SQL, {"epoch": epoch, "shard": shard})
        return await cur.fetchone() is not None

    async def retire(self, conn: Conn, epoch: int) -> bool:
        cur = await conn.execute(RETIRE_SQL, {"epoch": epoch})
        return await cur.fetchone() is not None
