"""The leader's work: wake-ups, the dispatch loop, the schedule scanner and maintenance (aging, metrics, slow-down).

Only the replica holding the `dispatch-coordinator` advisory lock runs `lead()`; standbys wait. Dispatch
wakes on `NOTIFY dispatch_wakeup` (collect-now, in its transaction), on `monitor.lifecycle` events
(completions, releases, clients coming online, accepted collect-now requests), on new tasks from the
scanner, at the start of every budget window, and on a periodic tick as a safety net.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.clock import SYSTEM_CLOCK, Clock
from libs.contracts.amqp import lifecycle_decoder
from libs.db.listen import listen_forever
from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings, SettingsCache
from libs.domain.slowdown import WriteStats
from libs.mq.dead_letter import DeadLetterPublisher, dead_letter_or_give_back
from libs.mq.topology import Topology, declare_lifecycle
from libs.outbox.relay import OutboxRelay
from libs.tasks import consistency_reads
from libs.tasks.push_leases import PushLeaseIssuer, key_fingerprint
from libs.tasks.transitions import DISPATCH_WAKE_CHANNEL
from libs.telemetry import metrics
from services.dispatch_coordinator.dispatcher import Dispatcher, PassOutcome, is_transient
from services.dispatch_coordinator.maintenance import (
    SlowdownState,
    aging_pace,
    aging_round_limit,
    measure_signals,
    observe_backlog,
    publish_state,
    run_aging,
    update_slowdown,
)
from services.dispatch_coordinator.scanner import scan_once

log = logging.getLogger("dispatch.coordinator")

# Lifecycle events after which a dispatch pass may find room (cross-service contract 3).
WAKE_EVENTS = frozenset({"task.completed", "task.failed", "task.aborted", "task.released", "client.online",
                         "collect_now.accepted"})
# Wake-ups that only their own tenant's pending work can use: a freed slot (a completion), a client that came
# online (a reconnect storm of a fleet with nothing pending wakes no pass at all).
TENANT_SCOPED_WAKES = frozenset({"task.completed", "client.online"})
SETTINGS_MAX_AGE_S = 1.0
MAINTENANCE_INTERVAL_S = 2.0
SCAN_INTERVAL_S = 1.0


class _Deliveries:
    """A consumer's deliveries, handed over in batches of whatever arrived since the last one."""

    def __init__(self) -> None:
        self._buffered: list[AbstractIncomingMessage] = []
        self._arrived = asyncio.Event()

    async def take(self, message: AbstractIncomingMessage) -> None:
        self._buffered.append(message)
        self._arrived.set()

    async def next_batch(self, *, timeout: float) -> list[AbstractIncomingMessage]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout)
        self._arrived.clear()
        batch, self._buffered = self._buffered, []
        return batch


@dataclass(frozen=True, slots=True)
class ExecutionPaths:
    """Work in flight per execution path, and the tasks with live work on the path they are not owned by."""

    in_flight: consistency_reads.PathsInFlight
    mismatches: list[consistency_reads.PathProblem]


async def check_execution_paths(conn: Conn) -> ExecutionPaths:
    """Work in flight per execution path, and the tasks with live work on the path they are not owned by."""
    return ExecutionPaths(await consistency_reads.in_flight_by_path(conn),
                          await consistency_reads.path_mismatches(conn))


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    database_url: str
    topology: Topology
    instance_id: str
    listen: bool = True
    # How long this process's claims on its own high events last (see Dispatcher: the relay).
    relay_lease_seconds: float = 5.0
    # Push-lease (libs/tasks/push_leases.py): executions of push clients are leased at dispatch; None: all pull.
    push_leases: PushLeaseIssuer | None = None


# The lifecycle events the coordinator consumes: completions and clients coming online wake dispatch; a
# collect-now's acceptance is the fallback wake-up of the high pass when its NOTIFY was lost with the LISTEN
# connection. Not `client.offline`: it wakes nothing here, and half of a reconnect storm's events are offlines.
LIFECYCLE_KEYS = ("task.#", "client.online", "collect_now.#")
# Bound by an earlier version of the queue: unbound at start (a binding outlives the consumer that made it).
RETIRED_LIFECYCLE_KEYS = ("client.#",)
# Lifecycle events taken from the broker before the consumer handles them: one batch, one wake-up, one ack.
LIFECYCLE_PREFETCH = 1000


class Dispatching(Protocol):
    """What the coordinator drives and reads of its dispatcher (services/dispatch_coordinator/dispatcher.py)."""

    # Set by the coordinator: is high work waiting for a high-only pass?
    high_waiting: Callable[[], bool] | None
    # Set by the maintenance loop.
    slowdown: bool
    cluster_high_backlog: int
    tenant_normal_backlog: dict[int, int]

    @property
    def write_stats(self) -> WriteStats: ...

    @property
    def passes(self) -> int: ...

    @property
    def pairs_read_at(self) -> float: ...

    def has_pending(self, tenant_id: int) -> bool: ...

    def add_pairs(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    def run_high_pass(self, settings: DispatchSettings) -> Awaitable[PassOutcome]: ...

    def run_pass(self, settings: DispatchSettings) -> Awaitable[PassOutcome]: ...

    async def drain_relays(self, timeout: float) -> None: ...


class SettingsSource(Protocol):
    """Where the coordinator gets the current `dispatch_settings` (libs/dispatch_settings.py: SettingsCache)."""

    async def get(self) -> DispatchSettings: ...


class Coordinator:
    def __init__(self, pool: AsyncConnectionPool[Conn], config: CoordinatorConfig,
                 amqp: AbstractRobustConnection | None = None, relay: OutboxRelay | None = None, *,
                 dispatcher: Dispatching | None = None, settings: SettingsSource | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        """`dispatcher` runs the passes (default: a Dispatcher on `pool`, publishing its own high events through
        `relay` when one is given); `settings` serves the hot-reloaded dispatch settings (default: a SettingsCache
        on `pool`); `clock` times the loops' waits, the spacing of full passes and the aging interval."""
        self._pool = pool
        self.pool = pool
        self._config = config
        self._amqp = amqp
        self._clock = clock
        # Confirmed before the original is acked (libs/mq/dead_letter.py), on a channel of its own.
        self._dead_letters = DeadLetterPublisher(amqp, config.topology) if amqp is not None else None
        self.dispatcher: Dispatching = dispatcher if dispatcher is not None else Dispatcher(
            pool, relay=relay, relay_lease_seconds=config.relay_lease_seconds, clock=clock,
            push_leases=config.push_leases)
        # A collect-now asked for dispatch: the next pass starts with a high-only pass.
        self._high_wake = asyncio.Event()
        self.dispatcher.high_waiting = self._high_wake.is_set
        self.slowdown = SlowdownState()
        self._wake = asyncio.Event()
        self._full_requested = True
        self._settings: SettingsSource = (settings if settings is not None
                                          else SettingsCache(pool, max_age_s=SETTINGS_MAX_AGE_S))
        self._last_aging = clock.monotonic()
        self._high_woken_at = 0.0  # monotonic: the last collect-now wake-up
        # Wall clock of the first wake-up the next high pass serves, and whether a full pass was running then: logged
        # when the loop takes it up ("high pass woken"), a click's wait for the loop (docs/benchmarks.md, Hub at scale).
        self._high_first_woken = (0.0, False)
        self._in_full_pass = False
        self.listening = asyncio.Event()
        self.consuming = asyncio.Event()
        self.dispatched_total = 0
        # Aging goes at the dispatch pace (docs/architecture.md §9.4): the tasks the full passes took from the lanes
        # below high since the last round feed the pace that sizes the next.
        self.aging_pace = aging_pace()
        self._dispatched_since_aging = 0
        self.lifecycle_batches = 0  # batches of lifecycle events handled (each: at most one wake-up, one ack)

    def wake(self) -> None:
        """Something may be dispatchable (a completion, new tasks): run a full pass now."""
        self._full_requested = True
        self._wake.set()

    def wake_high(self) -> None:
        """Collect-now work is ready: run a high-only pass now (and a full pass if it leaves work behind)."""
        if not self._high_wake.is_set():
            self._high_first_woken = (time.time(), self._in_full_pass)
        self._high_wake.set()
        self._wake.set()
        self._high_woken_at = self._clock.monotonic()

    async def settings(self) -> DispatchSettings:
        """Hot-reloaded `dispatch_settings` (by default re-read in the background at most every
        `SETTINGS_MAX_AGE_S`)."""
        return await self._settings.get()

    # ---- leading ----------------------------------------------------------------------------------
    async def lead(self, stop: asyncio.Event) -> None:
        """Run every leader loop until `stop`; any loop dying ends the leadership (the lock is released)."""
        log.info("coordinator leading", extra={"instance_id": self._config.instance_id})
        await self._check_execution_paths()
        loops: list[tuple[str, Callable[[asyncio.Event], Coroutine[Any, Any, None]]]] = [
            ("dispatch", self.run_dispatch_loop), ("scanner", self._scan_loop), ("maintenance", self._maintenance_loop),
        ]
        if self._config.listen:
            loops.append(("listen", self._listen_loop))
        if self._amqp is not None:
            loops.append(("lifecycle", self._lifecycle_loop))
        tasks = [asyncio.create_task(fn(stop), name=f"coordinator-{name}") for name, fn in loops]
        stop_waiter = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stop_waiter], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop_waiter and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            self.wake()
            stop_waiter.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, stop_waiter, return_exceptions=True)
            await self.dispatcher.drain_relays(timeout=self._config.relay_lease_seconds / 2)
            self.listening.clear()
            self.consuming.clear()

    async def _wait(self, stop: asyncio.Event, event: asyncio.Event | None, timeout: float) -> None:
        await self._clock.wait((stop,) if event is None else (stop, event), timeout)

    async def run_dispatch_loop(self, stop: asyncio.Event) -> None:
        """The dispatch loop (one of `lead`'s loops), until `stop`: a high-only pass when `wake_high` asked for
        one, a full pass when `wake` did, on the tick or at a budget window's start, full passes spaced by
        `dispatch_min_interval_ms` unless one asks for another at once."""
        clock = self._clock
        full_due_at = 0.0  # monotonic: the next full pass without a wake-up (tick, budget window rollover)
        last_pass_at = -1e9  # monotonic start of the last full pass, or end of the last high pass
        redo = False  # the last full pass asked for another at once (a conflict, a full batch, a yield)
        while not stop.is_set():
            self._wake.clear()
            settings = await self._guarded_settings(stop)
            if settings is None:
                continue
            started = time.perf_counter()
            full = self._full_requested or clock.monotonic() >= full_due_at
            try:
                high_left_work = False
                if self._high_wake.is_set():
                    self._high_wake.clear()
                    woken_at, during_full = self._high_first_woken
                    log.info("high pass woken", extra={"woken_at": woken_at, "during_full_pass": during_full,
                                                       "picked_at": time.time()})
                    high = await self.dispatcher.run_high_pass(settings)
                    self.dispatched_total += high.dispatched
                    # A full pass re-decides what the high pass left (work held back for the normal
                    # guarantee, a busy client, a conflict) at once. A click whose high work all went needs
                    # none right now: the next wake-up or tick runs it, instead of competing with the
                    # click's publish for the same cores.
                    high_left_work = high.conflicted or high.dispatched < high.considered
                    if high.dispatched:
                        # Its publish, the broker and the hub are on their way to the desktop: a full pass due
                        # now waits the spacing too, instead of competing with them for the same cores.
                        last_pass_at = clock.monotonic()
                if not full and not high_left_work:
                    await self._wait(stop, self._wake, full_due_at - clock.monotonic())
                    continue
                spacing = last_pass_at + settings.dispatch_min_interval_ms / 1000 - clock.monotonic()
                if not high_left_work and not redo and spacing > 0:
                    # Too soon after the last pass: gather further wake-ups meanwhile (a click ends it).
                    await self._wait(stop, self._high_wake, spacing)
                    continue
                self._full_requested = redo = False
                last_pass_at = clock.monotonic()
                self._in_full_pass = True
                try:
                    outcome = await self.dispatcher.run_pass(settings)
                finally:
                    self._in_full_pass = False
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("dispatch pass failed; database unavailable?", extra={"error": str(exc)[:300]})
                await self._wait(stop, None, 1.0)
                continue
            metrics.dispatch_pass_duration_ms.observe((time.perf_counter() - started) * 1000)
            self.dispatched_total += outcome.dispatched
            self._dispatched_since_aging += outcome.dispatched - outcome.high_dispatched
            if outcome.conflicted or outcome.full_batch or outcome.preempted:
                full_due_at, redo = 0.0, True
                continue
            timeout = min(max(0.05, settings.dispatch_tick_ms / 1000), outcome.seconds_to_next_window + 0.005)
            full_due_at = clock.monotonic() + timeout
            await self._wait(stop, self._wake, timeout)

    async def _guarded_settings(self, stop: asyncio.Event) -> DispatchSettings | None:
        try:
            return await self.settings()
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("settings reload failed; database unavailable?", extra={"error": str(exc)[:300]})
            await self._wait(stop, None, 1.0)
            return None

    async def _scan_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            settings = await self._guarded_settings(stop)
            if settings is None:
                continue
            batch = max(1, settings.scan_batch_size)
            try:
                result = await scan_once(self._pool, batch_size=batch, rollout_percentage=settings.rollout_percentage)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("schedule scan failed; database unavailable?", extra={"error": str(exc)[:300]})
                await self._wait(stop, None, 1.0)
                continue
            if result.created:
                self.dispatcher.add_pairs(sorted(result.pairs))
                self.wake()
                log.info("scheduled tasks created", extra={"plans": result.plans, "tasks_created": result.created})
            if result.plans >= batch:
                continue
            await self._wait(stop, None, SCAN_INTERVAL_S)

    async def _maintenance_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.maintain_once()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("maintenance failed; database unavailable?", extra={"error": str(exc)[:300]})
            await self._wait(stop, None, MAINTENANCE_INTERVAL_S)

    async def maintain_once(self) -> None:
        settings = await self.settings()
        async with self._pool.connection() as conn:
            backlog = await observe_backlog(conn)
            signals = await measure_signals(conn, self.dispatcher.write_stats, now=self._clock.monotonic())
        self.dispatcher.cluster_high_backlog = backlog.high
        self.dispatcher.tenant_normal_backlog = backlog.tenant_normal
        was_paused = self.dispatcher.slowdown
        self.dispatcher.slowdown = update_slowdown(self.slowdown, signals, settings)
        if was_paused and not self.dispatcher.slowdown:
            self.wake()
        if self._clock.monotonic() - self._last_aging >= max(1, settings.aging_interval_seconds):
            self._last_aging = self._clock.monotonic()
            aged = await run_aging(self._pool, settings, limit=self.aging_limit(settings))
            log.debug("aging round", extra={"limit": aged.limit, "boosted": aged.boosted,
                                            "statements": aged.statements})
            if aged.boosted:
                self.wake()
        async with self._pool.connection() as conn:
            await publish_state(conn, "slowdown", {
                "active": self.slowdown.active, "reasons": self.slowdown.reasons, "since": self.slowdown.since,
                "signals": dataclasses.asdict(self.slowdown.signals)})
            push = self._config.push_leases
            await publish_state(conn, "leader", {"instance_id": self._config.instance_id,
                                                 "host": socket.gethostname(), "passes": self.dispatcher.passes,
                                                 "dispatched_total": self.dispatched_total,
                                                 # what the hubs check their PUSH_LEASE_SECRET against (None: off)
                                                 "push_lease_key": push and key_fingerprint(push.key)})

    def aging_limit(self, settings: DispatchSettings) -> int:
        """The next aging round's limit at the dispatch pace (docs/architecture.md §9.4): from what the full passes
        took from the lanes below high since the last round (counted anew from here), within one batch and
        `aging_round_limit`."""
        dispatched, self._dispatched_since_aging = self._dispatched_since_aging, 0
        return self.aging_pace.limit(dispatched, aging_round_limit(settings))

    async def _check_execution_paths(self) -> None:
        """Start-up check of the two execution paths (docs/legacy-path.md): the work in flight on each, and any task
        with live work on the path it is not owned by, logged for a human (the reconciler's consistency job counts and
        alerts the same every `reconcile_interval_seconds`). A failed check does not stop the coordinator from
        leading."""
        try:
            async with self._pool.connection() as conn:
                found = await check_execution_paths(conn)
        except Exception as exc:
            log.warning("execution-path start-up check failed", extra={"error": str(exc)[:300]})
            return
        log.info("execution paths at start-up", extra={
            "in_flight_desktop_tasks": found.in_flight.desktop_tasks,
            "in_flight_legacy": found.in_flight.legacy, "mismatches": len(found.mismatches)})
        for row in found.mismatches[:20]:
            log.error(f"ALERT: {row.problem}; needs a human", extra={
                "monitor_task_id": row.id, "tenant_id": row.tenant_id, "status": row.status,
                "execution_owner": row.execution_owner})

    async def _listen_loop(self, stop: asyncio.Event) -> None:
        """LISTEN dispatch_wakeup on a dedicated connection (reconnects; a high pass after every reconnect)."""
        await listen_forever(self._config.database_url, DISPATCH_WAKE_CHANNEL, lambda _: self.wake_high(),
                             stop=stop, listening=self.listening, name="dispatch-coordinator-listen",
                             meanwhile="relying on ticks")

    async def _lifecycle_loop(self, stop: asyncio.Event) -> None:
        """Consume `monitor.lifecycle` (shared coordinator queue) while leading; wake dispatch on completions."""
        assert self._amqp is not None
        topology = self._config.topology
        dlq = topology.lifecycle_dlq("coordinator")
        while not stop.is_set():
            channel = None
            try:
                channel = await self._amqp.channel()
                await channel.set_qos(prefetch_count=LIFECYCLE_PREFETCH)
                queue = await declare_lifecycle(channel, topology, "coordinator", routing_keys=LIFECYCLE_KEYS)
                for key in RETIRED_LIFECYCLE_KEYS:
                    await queue.unbind(topology.lifecycle_exchange, routing_key=key)
                buffer = _Deliveries()
                tag = await queue.consume(buffer.take)
                self.consuming.set()
                while not channel.is_closed:
                    # Whatever arrived while the previous batch was handled is the next batch (a storm's
                    # thousands of `client.online` become a handful of wake-ups and acks).
                    batch = await buffer.next_batch(timeout=5.0)
                    if batch:
                        await self.handle_lifecycle_batch(dlq, batch)
                with contextlib.suppress(Exception):
                    await queue.cancel(tag)
                raise ConnectionError("lifecycle channel closed")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.consuming.clear()
                log.warning("lifecycle consumer failed; retrying", extra={"error": str(exc)[:300]})
                await self._wait(stop, None, 1.0)
            finally:
                # Closed, not left open: a robust channel left behind is restored with its consumer on every
                # reconnect (a consumer that stopped leading but keeps taking the leader's events, unacked).
                if channel is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(channel.close(), 5)

    async def handle_lifecycle(self, dlq: str, message: AbstractIncomingMessage) -> None:
        """One `monitor.lifecycle` event (a batch of one)."""
        await self.handle_lifecycle_batch(dlq, [message])

    async def handle_lifecycle_batch(self, dlq: str, messages: Sequence[AbstractIncomingMessage]) -> None:
        """A batch of `monitor.lifecycle` events (in delivery order): at most one wake of each pass for all of
        them, then one ack for the batch (an undecodable one goes to `dlq` first, on its own)."""
        wake = wake_high = False
        last_good: AbstractIncomingMessage | None = None
        self.lifecycle_batches += 1
        for message in messages:
            try:
                event = lifecycle_decoder.decode(message.body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                assert self._dead_letters is not None
                await dead_letter_or_give_back(self._dead_letters, dlq, message, f"undecodable lifecycle event: {exc}")
                continue
            last_good = message
            if event.event == "collect_now.accepted":
                # The request's transaction also sent a NOTIFY; while LISTEN is up that one already woke the
                # high pass (a second pass would only compete with the first). This is the fallback for a
                # NOTIFY lost with the LISTEN connection.
                wake_high = wake_high or not self.listening.is_set()
            elif event.event in WAKE_EVENTS and not (event.event in TENANT_SCOPED_WAKES
                                                     and self._nothing_ready_for(event.tenant_id)):
                wake = True
        if wake_high:
            self.wake_high()
        elif wake:
            self.wake()
        if last_good is not None:
            # Every earlier delivery of the batch is settled (acked here, or dead-lettered/given back above).
            await last_good.ack(multiple=len(messages) > 1)

    def _nothing_ready_for(self, tenant_id: int) -> bool:
        """A completion frees capacity (a client slot, a platform account slot), and a client coming online brings
        capacity, that only its own tenant's work can use. The dispatcher's pending pairs list every (tenant,
        platform) with a pending task, of any lane: re-read in slices beside the passes once a second old (their
        `read_at` is the start of the last sweep that read every pair), and added to at once by the scanner. When
        they have none for the tenant, the event wakes no pass. They are not trusted before their first read, nor
        when a collect-now came after that sweep started (its promoted tasks may be waiting for exactly this slot);
        other pending work comes back with its own wake-up (a yield, a release, a retry)."""
        d = self.dispatcher
        return d.pairs_read_at > self._high_woken_at and not d.has_pending(tenant_id)
