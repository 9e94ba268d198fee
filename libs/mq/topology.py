"""RabbitMQ topology of docs/architecture.md §11, declared idempotently at start-up.

Every name goes through `Topology` so tests can isolate themselves with a unique prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from libs.ingest.routing import Routing, queue_suffix
from libs.mq.hub_routing import hub_binding

DISPATCH = "desktop.task.dispatch"
RESULT = "monitor.result"
PROJECTION = "monitor.projection"
LIFECYCLE = "monitor.lifecycle"
DLX = "monitor.dlx"
LOGICAL_EXCHANGES = (DISPATCH, RESULT, PROJECTION, LIFECYCLE)

INGEST_DELIVERY_LIMIT = 5
TALLY_MAX_LENGTH = 100_000
PROJECTION_DELIVERY_LIMIT = 5
# The dispatch routing keys publishers write (`monitor.<lane>.<client>`, `publish.<client>`). The outbox relay
# publishes them towards the client's hub (`hub.<hub>.<key>`, libs/mq/hub_routing.py), and a hub's queue has one
# binding, `hub.<itself>.#`: a hub receives only the events of the clients it holds. Not one binding per connected
# client: a binding is a broker round trip and a Mnesia write, ~800 a second measured on RabbitMQ 3.10, so a hub
# restart reconnecting 10,000 clients spent 25 s binding (docs/architecture.md, "Targeted delivery").
CLIENT_DISPATCH_KEYS = ("monitor.*.*", "publish.*")


@dataclass(frozen=True, slots=True)
class Topology:
    prefix: str = ""
    ingest_shards: int = 16

    def name(self, logical: str) -> str:
        return f"{self.prefix}{logical}"

    # exchanges
    @property
    def dispatch_exchange(self) -> str:
        return self.name(DISPATCH)

    @property
    def result_exchange(self) -> str:
        return self.name(RESULT)

    @property
    def projection_exchange(self) -> str:
        return self.name(PROJECTION)

    @property
    def lifecycle_exchange(self) -> str:
        return self.name(LIFECYCLE)

    @property
    def dlx_exchange(self) -> str:
        return self.name(DLX)

    # queues
    def ingest_queue(self, shard: int, epoch: int = 0) -> str:
        """The queue of `shard` in routing epoch `epoch` (libs/ingest/routing.py; epoch 0: the original names)."""
        return self.name(queue_suffix(epoch, shard))

    @property
    def ingest_dlq(self) -> str:
        return self.name("monitor.result.ingest.dlq")

    @property
    def ingest_dlq_copy_key(self) -> str:
        """The DLX routing key of the copies ingest dead-letters itself: bound to the DLQ only, so a copy the DLQ
        cannot take is unroutable (refused), never "confirmed" by the tally alone."""
        return f"copy.{self.ingest_dlq}"

    @property
    def ingest_dead_letter_tally(self) -> str:
        """Beside the ingest DLQ on the broker's own dead-letter key: what the broker dead-letters from the shard
        queues (the delivery limit) lands here too, to be counted (`ingest_dead_letter_count`) and dropped."""
        return self.name("monitor.result.ingest.dlq.tally")

    @property
    def projection_queue(self) -> str:
        return self.name("monitor.projection.rebuild")

    @property
    def projection_dlq(self) -> str:
        return self.name("monitor.projection.rebuild.dlq")

    def lifecycle_queue(self, consumer: str) -> str:
        return self.name(f"monitor.lifecycle.{consumer}")

    def lifecycle_dlq(self, consumer: str) -> str:
        return self.name(f"monitor.lifecycle.{consumer}.dlq")

    def hub_queue(self, instance_id: str) -> str:
        return self.name(f"desktop.task.dispatch.hub.{instance_id}")

    @property
    def hub_dlq(self) -> str:
        return self.name("desktop.task.dispatch.dlq")

    def physical_exchange(self, logical: str) -> str:
        """Outbox rows store logical exchange names; the pump maps them through the prefix."""
        return self.name(logical)

    def all_queue_names(self) -> list[str]:
        names = [self.ingest_queue(k) for k in range(self.ingest_shards)]
        names += [self.ingest_dlq, self.ingest_dead_letter_tally, self.projection_queue, self.projection_dlq,
                  self.hub_dlq]
        for consumer in ("coordinator", "reconciler"):
            names += [self.lifecycle_queue(consumer), self.lifecycle_dlq(consumer)]
        return names


def _dead_letter_args(topology: Topology, dlq: str) -> dict[str, Any]:
    return {"x-dead-letter-exchange": topology.dlx_exchange, "x-dead-letter-routing-key": dlq}


async def declare_exchanges(channel: AbstractChannel, topology: Topology) -> dict[str, AbstractExchange]:
    exchanges: dict[str, AbstractExchange] = {}
    for logical in LOGICAL_EXCHANGES:
        exchanges[logical] = await channel.declare_exchange(
            topology.name(logical), aio_pika.ExchangeType.TOPIC, durable=True
        )
    exchanges[DLX] = await channel.declare_exchange(topology.dlx_exchange, aio_pika.ExchangeType.DIRECT,
                                                    durable=True)
    return exchanges


async def _declare_dlq(channel: AbstractChannel, topology: Topology, name: str) -> AbstractQueue:
    queue = await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
    await queue.bind(topology.dlx_exchange, routing_key=name)
    return queue


async def declare_ingest(channel: AbstractChannel, topology: Topology,
                         routings: Sequence[Routing] | None = None) -> list[AbstractQueue]:
    """Shard queues: quorum, single active consumer, delivery limit, dead letter to the ingest DLQ (and its tally).

    `routings`: the epochs whose queues to declare and bind (default epoch 0 with `topology.ingest_shards`); a
    process that knows the routing table passes the active epoch only, so it never re-binds a retired one."""
    await declare_exchanges(channel, topology)
    dlq = await _declare_dlq(channel, topology, topology.ingest_dlq)
    await dlq.bind(topology.dlx_exchange, routing_key=topology.ingest_dlq_copy_key)
    tally = await channel.declare_queue(topology.ingest_dead_letter_tally, durable=True, arguments={
        # Bounded: with no ingest replica counting, the oldest entries go first (the DLQ itself keeps every message).
        "x-queue-type": "quorum", "x-max-length": TALLY_MAX_LENGTH, "x-overflow": "drop-head"})
    await tally.bind(topology.dlx_exchange, routing_key=topology.ingest_dlq)
    queues = []
    for routing in routings if routings is not None else [Routing(0, topology.ingest_shards)]:
        queues += await declare_ingest_epoch(channel, topology, routing)
    return queues


async def declare_ingest_epoch(channel: AbstractChannel, topology: Topology, routing: Routing,
                               *, bind: bool = True) -> list[AbstractQueue]:
    queues = []
    for shard in range(routing.shards):
        queue = await channel.declare_queue(
            topology.ingest_queue(shard, routing.epoch),
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-single-active-consumer": True,
                "x-delivery-limit": INGEST_DELIVERY_LIMIT,
                **_dead_letter_args(topology, topology.ingest_dlq),
            },
        )
        if bind:
            await queue.bind(topology.result_exchange, routing_key=routing.routing_key(shard))
        queues.append(queue)
    return queues


async def declare_projection(channel: AbstractChannel, topology: Topology) -> AbstractQueue:
    await declare_exchanges(channel, topology)
    await _declare_dlq(channel, topology, topology.projection_dlq)
    queue = await channel.declare_queue(
        topology.projection_queue,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": PROJECTION_DELIVERY_LIMIT,
            **_dead_letter_args(topology, topology.projection_dlq),
        },
    )
    await queue.bind(topology.projection_exchange, routing_key="rebuild")
    return queue


async def declare_lifecycle(channel: AbstractChannel, topology: Topology, consumer: str,
                            routing_keys: tuple[str, ...] = ("task.#", "client.#")) -> AbstractQueue:
    """One shared quorum queue per consuming role (coordinator, reconciler)."""
    await declare_exchanges(channel, topology)
    dlq = topology.lifecycle_dlq(consumer)
    await _declare_dlq(channel, topology, dlq)
    queue = await channel.declare_queue(
        topology.lifecycle_queue(consumer),
        durable=True,
        arguments={"x-queue-type": "quorum", "x-delivery-limit": 5, **_dead_letter_args(topology, dlq)},
    )
    for key in routing_keys:
        await queue.bind(topology.lifecycle_exchange, routing_key=key)
    return queue


async def declare_hub_queue(channel: AbstractChannel, topology: Topology, instance_id: str) -> AbstractQueue:
    """A hub instance's own queue: exclusive, auto-delete; bound to the events routed to this hub (one binding)."""
    await declare_exchanges(channel, topology)
    await _declare_dlq(channel, topology, topology.hub_dlq)
    queue = await channel.declare_queue(
        topology.hub_queue(instance_id),
        exclusive=True,
        auto_delete=True,
        arguments=_dead_letter_args(topology, topology.hub_dlq),
    )
    await queue.bind(topology.dispatch_exchange, routing_key=hub_binding(instance_id))
    return queue


async def declare_all(channel: AbstractChannel, topology: Topology) -> None:
    await declare_exchanges(channel, topology)
    await declare_ingest(channel, topology)
    await declare_projection(channel, topology)
    for consumer in ("coordinator", "reconciler"):
        await declare_lifecycle(channel, topology, consumer)
    await _declare_dlq(channel, topology, topology.hub_dlq)


async def delete_all(channel: AbstractChannel, topology: Topology) -> None:
    """Tear down a prefixed topology (tests)."""
    for name in topology.all_queue_names():
        await channel.queue_delete(name)
    for logical in (*LOGICAL_EXCHANGES, DLX):
        await channel.exchange_delete(topology.name(logical))
