"""The outbox pump: claim committed rows and relay them (libs/outbox/relay.py: publish with confirms, mark
published after the confirm); reclaim expired claims, keep the depth gauges, delete old published rows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import psycopg
from psycopg_pool import AsyncConnectionPool

from libs.db.listen import listen_forever
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.outbox import queries as q
from libs.outbox.relay import (
    AmqpPublisher,
    ClaimedEvent,
    OutboxRelay,
    Publisher,
    PublishError,
    log_claimed,
    validate_payload,
)
from libs.outbox.state import TRANSITION_EVENT, source_of_row, transition_fields
from libs.outbox.writer import NOTIFY_CHANNEL, PRIORITY_WAKE
from libs.telemetry import metrics

__all__ = ["AmqpPublisher", "ClaimedEvent", "OutboxPump", "OutboxRelay", "PublishError", "Publisher", "PumpConfig",
           "validate_payload"]

log = logging.getLogger("outbox.pump")


@dataclass(slots=True)
class PumpConfig:
    claimed_by: str
    batch_size: int = 200
    poll_interval_s: float = 1.0
    listen: bool = True
    lease_seconds: float = 30.0
    backoff_base_ms: int = 500
    backoff_max_ms: int = 300_000
    retention_hours: int = 24
    concurrency: int = 2
    # One more claim loop for prioritised rows only (priority > 0: high dispatch, collect-now control), so
    # they never wait for the other loops to finish publishing a batch of normal events.
    express: bool = True
    express_batch_size: int = 50


class OutboxPump(OutboxRelay):
    """Claims committed rows (LISTEN wake-ups, polling as the safety net) and relays them; reclaims expired
    claims, records the depth gauges and deletes old published rows."""

    def __init__(self, pool: AsyncConnectionPool[Conn], publisher: Publisher, config: PumpConfig,
                 *, listen_url: str | None = None) -> None:
        super().__init__(pool, publisher, claimed_by=config.claimed_by, backoff_base_ms=config.backoff_base_ms,
                         backoff_max_ms=config.backoff_max_ms)
        self._config = config
        self._listen_url = listen_url
        self._regular = max(1, config.concurrency)
        # One wake-up event per claim loop: the regular loops', then the priority loop's when `config.express`
        # (see wake(): a NOTIFY wakes one idle regular loop). Read-only.
        self.wakes: tuple[asyncio.Event, ...] = tuple(
            asyncio.Event() for _ in range(self._regular + (1 if config.express else 0)))
        # Which regular loops are between a claim and the end of its batch's publishing (run_once keeps it).
        self.busy = [False] * self._regular
        self._stopping = False
        self.listening = asyncio.Event()

    def wake(self, *, prioritised: bool = True) -> None:
        """New work: wake one regular loop (the first that is not publishing a batch, so the new event does
        not wait for a busy loop to finish), and the priority loop when prioritised rows may be waiting.
        Further regular loops are woken in turn by a loop that claimed a full batch (a backlog), so a lone
        event does not make every loop queue up on the claim lock."""
        idle = next((i for i, busy in enumerate(self.busy) if not busy), 0)
        self.wakes[idle].set()
        if self._config.express and prioritised:
            self.wakes[-1].set()

    def _wake_all(self) -> None:
        for event in self.wakes:
            event.set()

    # ---- claim / publish / mark --------------------------------------------------------------
    async def claim(self, limit: int | None = None, *, min_priority: int = 0) -> list[ClaimedEvent]:
        """Claim up to `limit` rows in priority DESC, id order (`min_priority` > 0: prioritised rows only)."""
        async with self._pool.connection() as conn:
            # One round trip: BEGIN, the claim lock, the claim and COMMIT go out in one pipeline (the rows
            # are read after the commit). The commit does not wait for the WAL flush (ASYNC_COMMIT).
            async with pipelined_transaction(conn):
                await conn.execute(q.ASYNC_COMMIT)
                if min_priority <= 0:  # prioritised-only claims need no claim lock (queries.CLAIM)
                    await conn.execute(q.LOCK_CLAIMS, {"lock": q.OUTBOX_CLAIM_LOCK})
                cur = await conn.execute(q.CLAIM, {
                    "limit": limit or self._config.batch_size,
                    "min_priority": min_priority,
                    "claimed_by": self._config.claimed_by,
                    "lease_seconds": self._config.lease_seconds,
                })
            rows = await cur.fetchall()
        events = [ClaimedEvent(**row) for row in rows]
        log_claimed(events, self._config.claimed_by)
        return events

    async def reclaim_expired(self) -> int:
        """Claims whose lease ran out (a pump died or stalled) go back to retryable, or to
        dead_letter once out of attempts. Runs under the claim lock, off the publish path."""
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(q.LOCK_CLAIMS, {"lock": q.OUTBOX_CLAIM_LOCK})
            cur = await conn.execute(q.RECLAIM_EXPIRED)
            rows = await cur.fetchall()
        for row in rows:
            log.warning(TRANSITION_EVENT, extra=transition_fields(
                "lease_expired", "running", row["status"], owner=self._config.claimed_by, source=source_of_row(row),
                previous_owner=row["previous_owner"], next_retry_at=(
                    row["next_retry_at"].isoformat() if row["status"] == "retryable" else None),
                error_class="transient",
                error_type="ClaimLeaseExpired", error="claim lease expired while running (pump died or stalled)"))
            if row["status"] == "dead_letter":
                metrics.outbox_dead_letter_count.inc()
        if rows:
            self.wake()
        return len(rows)

    async def run_once(self, *, express: bool = False, loop: int | None = None) -> int:
        """Claim and publish one batch; returns how many rows were claimed.

        `express`: prioritised rows only, in a small batch (the express loop). `loop`: the regular claim
        loop running this (marked busy meanwhile).
        """
        if loop is not None:
            self.busy[loop] = True
        try:
            batch = await (self.claim(self._config.express_batch_size, min_priority=1) if express
                           else self.claim())
            if batch:
                await self.process(batch)
        finally:
            if loop is not None:
                self.busy[loop] = False
        return len(batch)

    # ---- loops --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._stop_watch(stop), name="outbox-stop-watch"),
                 asyncio.create_task(self._maintain(stop), name="outbox-maintenance")]
        if self._config.listen and self._listen_url:
            tasks.append(asyncio.create_task(self._listen(stop), name="outbox-listen"))
        try:
            regular = self._regular  # the express loop, if any, is the last one
            await asyncio.gather(*(
                self._claim_loop(stop, wake, express=index >= regular, loop=index if index < regular else None,
                                 next_wake=self.wakes[index + 1] if index + 1 < regular else None)
                for index, wake in enumerate(self.wakes)))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _claim_loop(self, stop: asyncio.Event, wake: asyncio.Event, *, express: bool = False,
                          loop: int | None = None, next_wake: asyncio.Event | None = None) -> None:
        # Several loops overlap one batch's claim with another's publishing; the claim lock and the
        # ordering rule of the CLAIM query keep per-key order across loops as across pumps.
        while not stop.is_set():
            if not self._publisher.ready():
                # Broker away: claim nothing (attempts are not burnt by an outage).
                await self._publisher.wait_ready(timeout=1.0)
                continue
            wake.clear()
            try:
                claimed = await self.run_once(express=express, loop=loop)
            except (psycopg.OperationalError, psycopg_pool_errors()) as exc:
                log.warning("outbox claim failed; database unavailable?", extra={"error": str(exc)})
                claimed = 0
            if claimed >= (self._config.express_batch_size if express else self._config.batch_size):
                if next_wake is not None:
                    next_wake.set()  # a backlog: bring the next loop in
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self._config.poll_interval_s)

    async def _stop_watch(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake_all()

    async def _listen(self, stop: asyncio.Event) -> None:
        assert self._listen_url is not None

        def on_notify(payload: str | None) -> None:
            # None: (re)connected, anything committed meanwhile is waiting.
            self.wake(prioritised=payload is None or payload == PRIORITY_WAKE)

        await listen_forever(self._listen_url, NOTIFY_CHANNEL, on_notify, stop=stop, listening=self.listening,
                             name="outbox-pump-listen", meanwhile="polling")

    async def _maintain(self, stop: asyncio.Event) -> None:
        last_cleanup = last_depth = 0.0
        while not stop.is_set():
            try:
                await self.reclaim_expired()
                if time.monotonic() - last_depth >= 5:
                    await self._record_depth()
                    last_depth = time.monotonic()
                if time.monotonic() - last_cleanup > 60:
                    async with self._pool.connection() as conn:
                        await conn.execute(q.DELETE_PUBLISHED_BEFORE, {
                            "hours": self._config.retention_hours, "limit": 5000})
                    last_cleanup = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox maintenance failed", extra={"error": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _record_depth(self) -> None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(q.DEPTH_BY_STATUS)
            rows = {r["status"]: r for r in await cur.fetchall()}
        oldest = 0
        for status in ("queued", "running", "retryable", "dead_letter"):
            row = rows.get(status)
            metrics.outbox_depth.labels(status=status).set(row["n"] if row else 0)
            if row and status != "dead_letter":
                oldest = max(oldest, int(row["oldest_ms"]))
        metrics.outbox_oldest_pending_age_ms.set(oldest)


def psycopg_pool_errors() -> type[Exception]:
    from psycopg_pool import PoolTimeout

    return PoolTimeout
