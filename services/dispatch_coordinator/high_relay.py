"""The coordinator publishing its own high `task_available` events right after the pass that wrote them committed
(the click's latency), leaving anything it cannot publish to the outbox pumps (libs/outbox/relay.py)."""

from __future__ import annotations

import asyncio
import logging

from libs.outbox.relay import OutboxRelay, OwnClaim

log = logging.getLogger("dispatch.pass")

# How long a pass waits for the relay of its high events before its bookkeeping.
RELAY_HEAD_START_S = 0.05


class HighRelay:
    """High TaskAvailable events are claimed in the writing transaction and published by this process right after the
    commit; without a relay (or with its broker away) the pumps publish them, woken by the commit's NOTIFY."""

    def __init__(self, relay: OutboxRelay | None, *, lease_seconds: float) -> None:
        self.relay = relay
        self.lease_seconds = lease_seconds
        self._relaying: set[asyncio.Task[int]] = set()

    def ready(self) -> OutboxRelay | None:
        """The relay, when it can publish now (else the pumps do)."""
        return self.relay if self.relay is not None and self.relay.ready() else None

    async def publish_committed(self, own: OwnClaim | None) -> None:
        """After the commit: publish the events the pass claimed for itself. The pass gives the relay a head start of
        up to RELAY_HEAD_START_S before its own bookkeeping (which would otherwise run first and hold the message in
        this process); past it, the relay finishes in the background (a slow broker must not stall dispatch). A
        failed publish goes back to the pumps (retryable, with backoff)."""
        if own is None or self.relay is None:
            return
        task = asyncio.create_task(self._publish(self.relay, own), name="dispatch-relay")
        self._relaying.add(task)
        task.add_done_callback(self._relaying.discard)
        await asyncio.wait([task], timeout=RELAY_HEAD_START_S)

    async def _publish(self, relay: OutboxRelay, own: OwnClaim) -> int:
        try:
            batch = await own.events()
            return await relay.process(batch) if batch else 0
        except Exception as exc:  # the claim's lease expires and a pump publishes the rows
            log.warning("relaying dispatch events failed; the pumps take them over when the claim expires",
                        extra={"error": str(exc)[:300]})
            return 0

    @property
    def in_flight(self) -> set[asyncio.Task[int]]:
        return set(self._relaying)
