"""The coordinator's lifecycle queue takes collect-now acceptances: they are its fallback wake-up for the high
pass when the click's NOTIFY was lost with the LISTEN connection (before, no queue bound them: they vanished)."""

from __future__ import annotations

from datetime import UTC, datetime

import aio_pika
import msgspec
from aio_pika.abc import AbstractRobustConnection

from libs.config import Settings
from libs.contracts.amqp import LifecycleEvent
from libs.mq.topology import Topology
from tests.support.coordinator_runner import run_coordinator


async def test_a_collect_now_acceptance_is_routed_to_the_coordinator(settings: Settings, topology: Topology,
                                                                     amqp: AbstractRobustConnection) -> None:
    async with run_coordinator(settings, with_pump=False):
        channel = await amqp.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(topology.lifecycle_exchange, ensure=False)
        event = LifecycleEvent(event="collect_now.accepted", tenant_id=1, occurred_at=datetime.now(UTC))
        # mandatory: an event no queue is bound for is returned, and the publish raises
        await exchange.publish(aio_pika.Message(msgspec.json.encode(event)), routing_key="collect_now.accepted",
                               mandatory=True)
        await channel.close()
