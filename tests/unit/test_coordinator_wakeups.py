"""Which lifecycle events wake which dispatch pass (no I/O: the coordinator's event handler alone)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from libs.contracts.amqp import LifecycleEvent
from libs.mq.topology import Topology
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig


class _Message:
    def __init__(self, event: str) -> None:
        self.body = msgspec.json.encode(LifecycleEvent(event=event, tenant_id=1,  # type: ignore[arg-type]
                                                       occurred_at=datetime.now(UTC)))
        self.acked = False

    async def ack(self) -> None:
        self.acked = True


def _coordinator() -> Coordinator:
    config = CoordinatorConfig(database_url="postgresql://unused", topology=Topology("t.", 4), instance_id="c")
    return Coordinator(None, config)  # type: ignore[arg-type]  # the handler touches no database


@pytest.mark.parametrize("listening", [True, False])
async def test_collect_now_accepted_wakes_the_high_pass_only_when_its_notify_could_have_been_lost(
        listening: bool) -> None:
    coordinator = _coordinator()
    if listening:
        coordinator.listening.set()
    message = _Message("collect_now.accepted")
    await coordinator._on_lifecycle(None, "dlq", message)  # type: ignore[arg-type]
    assert message.acked
    assert coordinator._high_wake.is_set() is (not listening)


async def test_a_completion_wakes_a_full_pass_but_not_the_high_pass() -> None:
    coordinator = _coordinator()
    message = _Message("task.completed")
    await coordinator._on_lifecycle(None, "dlq", message)  # type: ignore[arg-type]
    assert coordinator._wake.is_set() and not coordinator._high_wake.is_set()
