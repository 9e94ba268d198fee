"""The WebSocket side of the hub: which clients are connected here, the replay on (re)connect, online/offline,
and forwarding of dispatch events to the right sockets.

The hub's queue has one binding, to the events the outbox relay routed to this hub (`libs/mq/hub_routing.py`:
by the presence its online statement writes), not one per connected client: a connect or disconnect costs the
broker nothing, and the hub receives only the events of the clients it holds. Online, offline and replay are
batched across sockets (`Batcher`): what a reconnect storm costs the
database grows with its batches, not with its sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection
from psycopg_pool import AsyncConnectionPool

from libs.contracts.amqp import LifecycleEvent, LifecycleKind
from libs.contracts.wire import (
    HUB_DRAINING_CLOSE,
    PROTOCOL_VERSION,
    PUSH_LEASE,
    Hello,
    TaskAvailable,
    dispatch_decoder,
    draining_close_reason,
    requested_capabilities,
)
from libs.db.arrays import array_literal
from libs.db.pool import Conn
from libs.db.tx import pipelined_transaction
from libs.db.write_health import WriterHealth
from libs.mq.dead_letter import DeadLetterPublisher
from libs.mq.topology import LIFECYCLE, Topology, declare_hub_queue
from libs.outbox.writer import OutboxEvent, enqueue_many
from libs.tasks import execution_paths, push_leases
from libs.tasks.records import QueuedReplay
from libs.telemetry import metrics, tracing
from services.dispatch_hub import queries as q
from services.dispatch_hub.auth import ClientPrincipal
from services.dispatch_hub.batching import Batcher
from services.dispatch_hub.connections import Connection
from services.dispatch_hub.envelope import DispatchEvent, consume_envelope, is_envelope
from services.dispatch_hub.heartbeats import HeartbeatWriter
from services.dispatch_hub.leases import current_interrupt
from services.dispatch_hub.logic import (
    ShedReturns,
    announced_heartbeat_interval,
    client_id_from_routing_key,
    sockets_to_shed,
)

log = logging.getLogger("hub.gateway")
V = TypeVar("V")

REPLAY_LIMIT = 500
GOING_AWAY = 1001
HEARTBEAT_TIMEOUT_CLOSE = 4408
# Application close codes (4000-4999) a desktop client can act on: 4401 authenticate again (the token was
# rotated: get the new one), 4403 do not reconnect (the client was disabled), 4409 this socket was replaced
# by a newer one of the same client (HUB_MAX_SOCKETS_PER_CLIENT).
TOKEN_ROTATED_CLOSE = 4401
CLIENT_DISABLED_CLOSE = 4403
REPLACED_CLOSE = 4409
REVOCATION_CHUNK = 5000
# Sockets per batched online / replay / offline statement, and the pinger's sockets between two yields to the
# event loop (a ping is a frame write: 10,000 at once held the loop for a fraction of a second).
SOCKET_BATCH = 1000
PING_SLICE = 200


# A replica is alive while it sweeps (HUB_SEEN every HUB_REVOCATION_CHECK_S); the rows of one silent this long are
# deleted (its sockets no longer count against their clients' cap), looked for this often.
LIVE_HUB_S = 15.0
DEAD_HUB_S = 60.0
FORGET_DEAD_HUBS_EVERY_S = 30.0


@dataclass(frozen=True, slots=True)
class Attaching:
    """One socket of an attach batch (two sockets of a client are two entries, one online write)."""

    principal: ClientPrincipal
    socket_id: uuid.UUID
    push_lease: bool = False  # the socket was granted push_lease (libs/tasks/push_leases.py)


def task_available_from_row(row: QueuedReplay) -> TaskAvailable:
    return TaskAvailable(kind=row.kind, task_id=row.id, target_client_id=row.target_client_id,  # type: ignore[arg-type]
                         priority=row.priority, lane=row.lane,  # type: ignore[arg-type]
                         scheduler_group_key=row.scheduler_group_key,
                         business_date=row.business_date, interrupt_generation=row.interrupt_generation,
                         updated_at=row.updated_at, monitor_task_id=row.monitor_task_id,
                         collect_request_id=row.collect_request_id)


class Gateway:
    def __init__(self, pool: AsyncConnectionPool[Conn], amqp: AbstractRobustConnection, topology: Topology, *,
                 hub_id: str, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 heartbeat_flush_s: float, max_sockets_per_client: int = 2, revocation_check_s: float = 2.0,
                 on_revoked: Callable[[uuid.UUID], None] | None = None,
                 write_health: WriterHealth | None = None, push_key: bytes | None = None,
                 rebalance_slack: float = 0.0, reconnect_spread_ms: int = 10_000) -> None:
        self._pool = pool
        self.push_key = push_key  # push-lease on (PUSH_LEASE_SECRET): tokens derived here (libs/tasks/push_leases.py)
        # The leader's key fingerprint while it is not this hub's (`push_key_sweep`): push-lease is then off here.
        self.push_key_mismatch: str | None = None
        self._amqp = amqp
        self._topology = topology
        self.hub_id = hub_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._sockets: dict[uuid.UUID, set[Connection]] = {}
        self._by_socket_id: dict[uuid.UUID, Connection] = {}
        self.live_hubs = 1  # replicas sweeping (this one included): its share of the fleet-wide upgrade budgets
        self.on_live_hubs: Callable[[int], None] | None = None
        self.replaced_elsewhere = 0  # sockets closed because another hub's attach put them beyond the cap
        self._last_forget = 0.0
        self._client_locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._dead_letters = DeadLetterPublisher(amqp, topology)  # malformed dispatch batches (envelope.py)
        self.heartbeats = HeartbeatWriter(pool, hub=hub_id, interval_s=heartbeat_flush_s,
                                          is_connected=lambda c: c in self._sockets, write_health=write_health,
                                          refresh_s=heartbeat_interval_s, on_revived=self._replay_revived)
        self.max_sockets_per_client = max_sockets_per_client
        self.revocation_check_s = revocation_check_s
        # Rebalancing (`_rebalance`): at most (1 + slack) x the fair share of the fleet's sockets (0: off); a shed
        # socket's client reconnects after a delay drawn from [0, spread], as from a draining hub.
        self.rebalance_slack = rebalance_slack
        self.reconnect_spread_ms = reconnect_spread_ms
        self.fleet_sockets = 0  # the live replicas' sockets at the last sweep, this one's included
        self.lightest_hub = 0  # the fewest sockets a live replica held at the last sweep (this one's included)
        self.sweeps = 0
        self.rebalanced = 0  # sockets this hub closed to move their clients to the other replicas
        self._changes_at_sweep = 0  # sockets_changed at the last sweep, and this hub's own closes since
        self._shed_since_sweep = 0
        self.shed_returns = ShedReturns()  # a sticky load balancer sends the shed clients back: then it pauses
        self._on_revoked = on_revoked
        self.received = 0  # dispatch events this hub's queue took (targeted delivery: only its clients')
        self.forwarded = 0
        self.for_other_hubs = 0
        self.revoked = 0
        self._sockets_changed = 0  # bumped whenever a socket is registered or removed
        self._sweep_params: tuple[int, list[dict[str, str]]] = (-1, [])
        self._attaching: Batcher[Attaching, tuple[int, list[str]]] = Batcher(
            self._attach_batch, default=(0, []), name="attach", max_batch=SOCKET_BATCH)
        self._forgetting: Batcher[uuid.UUID, None] = Batcher(
            self._forget_batch, default=None, name="sockets-closed", max_batch=SOCKET_BATCH)
        self._replaying: Batcher[ClientPrincipal, list[str]] = Batcher(
            self._replay_batch, default=[], name="replay", max_batch=SOCKET_BATCH)
        self._detaching: Batcher[ClientPrincipal, None] = Batcher(
            self._detach_batch, default=None, name="detach", max_batch=SOCKET_BATCH)
        self.closing = False
        self.draining = False  # SIGTERM: sockets told to reconnect elsewhere (no offline writes for them)
        self._tasks: set[asyncio.Task[Any]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def spawn_cleanup(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        return self._spawn(coro, name="ws-cleanup")

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait for socket clean-ups (unbind, offline) still running, before resources close."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    # ---- broker ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._channel = await self._amqp.channel()
        await self._channel.set_qos(prefetch_count=1000)
        self._queue = await declare_hub_queue(self._channel, self._topology, self.hub_id)
        try:
            await self.fleet_sweep()  # registered among the replicas before its first socket's row
        except Exception:  # the database is away: the sweep loop registers it once it is back
            log.warning("could not register this hub among the replicas; the sweep will retry", exc_info=True)
        await self._queue.consume(self._on_message, no_ack=True)
        self._amqp.reconnect_callbacks.add(self._on_reconnect)

    def ready(self) -> bool:
        return (self._amqp.connected.is_set() and self._channel is not None and not self._channel.is_closed)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._dead_letters.close()
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if is_envelope(message):  # many clients' events in one message (services/dispatch_hub/envelope.py)
            await consume_envelope(message, self._on_event, self._dead_letter)
            return
        self._on_event(DispatchEvent.of_message(message))

    async def _dead_letter(self, message: AbstractIncomingMessage, reason: str) -> None:
        await self._dead_letters.publish(self._topology.hub_dlq, message, reason)

    def _on_event(self, message: DispatchEvent) -> None:
        """One dispatch event to its client's sockets here (dropped when the client is not, or no longer, here)."""
        self.received += 1
        metrics.hub_dispatch_events_received_total.inc()
        client_id = client_id_from_routing_key(message.routing_key)
        if client_id is None:
            log.warning("dispatch event with an unexpected routing key", extra={"routing_key": message.routing_key})
            return
        conns = tuple(self._sockets.get(client_id, ()))
        if not conns:  # a client that left this hub after the event was routed here (its replay covers it)
            self.for_other_hubs += 1
            metrics.hub_dispatch_events_not_here_total.inc()
            return
        arrived = time.monotonic()
        if tracing.enabled():
            self._deliver_traced(message, client_id, conns, arrived)
            return
        key = self.token_key
        text = (key and push_leases.add_token(message.body, key)) or message.body.decode()
        for conn in conns:
            conn.deliver(text, arrived)
            self.forwarded += 1

    @property
    def token_key(self) -> bytes | None:
        """The key this hub derives lease tokens with: none while push-lease is off here, or its key is not the
        leader's (a token it derived would match no lease: the client is better off pulling)."""
        return self.push_key if self.push_key_mismatch is None else None

    def grant(self, requested: Iterable[str]) -> frozenset[str]:
        """The capabilities a socket's upgrade asked for (CAPABILITIES_HEADER values) that this hub grants."""
        return requested_capabilities(tuple(requested)) if self.token_key is not None else frozenset()

    async def push_key_sweep(self) -> None:
        """Compare this hub's push-lease key with the leader's (libs/tasks/push_leases.py `key_agreement`). On a
        mismatch: grant push_lease to no new socket, derive no token, and take the capability back from this hub's
        clients in the database, so the leader stops pushing to them; their work is pulled as for an old client.
        Logged and `hub_push_lease_key_mismatch` when it starts and ends."""
        if self.push_key is None:
            return
        async with self._pool.connection() as db:
            leader = await push_leases.key_agreement(db, self.push_key)
            if leader is not None:
                await push_leases.clear_capability_of_hub(db, self.hub_id)
        if leader is not None and self.push_key_mismatch is None:
            log.error("PUSH_LEASE_SECRET differs from the leader coordinator's: push-lease is off on this hub until "
                      "they agree", extra={"hub_id": self.hub_id, "leader_key": leader,
                                           "hub_key": push_leases.key_fingerprint(self.push_key)})
        elif leader is None and self.push_key_mismatch is not None:
            log.info("PUSH_LEASE_SECRET agrees with the leader coordinator's again: push-lease is on",
                     extra={"hub_id": self.hub_id})
        self.push_key_mismatch = leader
        metrics.hub_push_lease_key_mismatch.set(0 if leader is None else 1)

    def _deliver_traced(self, message: DispatchEvent, client_id: uuid.UUID,
                        conns: tuple[Connection, ...], arrived: float) -> None:
        """Deliver in a span that is a child of the publisher's (AMQP headers); the event goes out with that
        span's `traceparent`, which the client sends back on its calls for the task."""
        with tracing.span("hub.deliver", kind=tracing.SpanKind.CONSUMER,
                          parent=tracing.context_from_headers(message.headers), attributes={
                              "messaging.system": "rabbitmq", "messaging.message.id": message.message_id,
                              "monitoring.message_type": message.message_type, tracing.CLIENT_ID: str(client_id),
                              "monitoring.sockets": len(conns)}) as span:
            text = message.body.decode()
            with contextlib.suppress(msgspec.MsgspecError):  # not ours to judge: forwarded unchanged
                event = dispatch_decoder.decode(message.body)
                span.set_attribute(tracing.TASK_ID, str(event.task_id))
                key = self.token_key
                if isinstance(event, TaskAvailable) and event.lease_epoch is not None and key:
                    event = msgspec.structs.replace(event, lease_token=push_leases.derive_token(
                        key, event.task_id, event.lease_epoch))
                text = msgspec.json.encode(msgspec.structs.replace(
                    event, traceparent=tracing.traceparent_of(span))).decode()
            for conn in conns:
                conn.deliver(text, arrived)
                self.forwarded += 1

    def _on_reconnect(self, *_: Any) -> None:
        # Events published while the broker link was down never reached this queue: replay from the
        # database for every connected client (the robust channel restored queue and bindings).
        log.warning("broker connection restored; replaying to connected clients")
        for client_id, conns in list(self._sockets.items()):
            for conn in tuple(conns):
                self._spawn(self._replay_into(conn), name=f"replay-{client_id}")

    def _replay_revived(self, client_ids: list[uuid.UUID]) -> None:
        """Clients a heartbeat marked online again (with their presence here): what was routed to the hub that
        marked them offline comes from a replay."""
        for client_id in client_ids:
            for conn in tuple(self._sockets.get(client_id, ())):
                self._spawn(self._replay_into(conn), name=f"replay-{client_id}")

    async def _replay_into(self, conn: Connection) -> None:
        try:
            for text in await self._replaying.submit(conn.principal):
                conn.deliver(text)
        except Exception:
            log.exception("replay after broker reconnect failed", extra={"client_id": conn.client_id})

    @property
    def attaching(self) -> Batcher[Attaching, tuple[int, list[str]]]:
        """The batcher of attaching sockets (online + replay); its `calls` and `largest` tell how they shared."""
        return self._attaching

    @property
    def detaching(self) -> Batcher[ClientPrincipal, None]:
        """The batcher of last sockets closing (offline); its `calls` and `largest` tell how they shared."""
        return self._detaching

    # ---- sockets -----------------------------------------------------------------------------
    def is_connected(self, client_id: uuid.UUID) -> bool:
        return client_id in self._sockets

    def connection_count(self) -> int:
        return len(self._by_socket_id)  # every registered socket, whatever its client (kept with `_sockets`)

    @property
    def sockets_changed(self) -> int:
        """Sockets registered or removed since the gateway started (a rate of churn, read twice)."""
        return self._sockets_changed

    def all_connections(self) -> list[Connection]:
        return [c for conns in self._sockets.values() for c in conns]

    def _lock(self, client_id: uuid.UUID) -> asyncio.Lock:
        lock = self._client_locks.get(client_id)
        if lock is None:
            lock = self._client_locks[client_id] = asyncio.Lock()
        return lock

    async def attach(self, conn: Connection) -> list[str]:
        """Register, mark online, and build hello + replay.

        Register before reading the replay: an event published in between is held back by the socket until the
        replay went out, and arrives twice at worst (clients treat task_available as a hint and lease by pull),
        never not at all."""
        principal = conn.principal
        client_id = principal.client_id
        async with self._lock(client_id):
            self._sockets.setdefault(client_id, set()).add(conn)
            self._by_socket_id[conn.socket_id] = conn
            self._sockets_changed += 1
            metrics.desktop_websocket_connections.inc()
            self.shed_returns.attached(client_id, time.monotonic())
            self._close_oldest_beyond_limit(client_id)
            # Under the client's lock, so a concurrent last-socket close cannot mark it offline before this.
            generation, replay = await _finished(self._attaching.submit(
                Attaching(principal, conn.socket_id, PUSH_LEASE in conn.capabilities)))
        available = sum(1 for t in replay if '"task_available"' in t)
        hello = Hello(client_id=client_id, tenant_id=principal.tenant_id, hub_instance=self.hub_id,
                      server_time=datetime.now(UTC),
                      heartbeat_interval_s=announced_heartbeat_interval(self.heartbeat_interval_s),
                      interrupt_generation=generation, replayed_available=available,
                      replayed_controls=len(replay) - available, protocol_version=PROTOCOL_VERSION,
                      capabilities=sorted(conn.capabilities))
        log.info("client connected", extra={"client_id": str(client_id), "tenant_id": principal.tenant_id,
                                            "replayed": len(replay)})
        return [msgspec.json.encode(hello).decode(), *replay]

    async def _attach_batch(self, sockets: list[Attaching]) -> dict[Attaching, tuple[int, list[str]]]:
        """Online (one statement; a client that was offline gets its `client.online` event), the sockets' rows
        and the fleet-wide cap, then the replay, for a batch of attaching sockets: their interrupt generations
        and replays."""
        principals = list(dict.fromkeys(s.principal for s in sockets))
        async with self._pool.connection() as db:
            async with pipelined_transaction(db) as pipe:
                cur = await db.execute(q.CLIENTS_ONLINE, {"ids": array_literal(p.client_id for p in principals),
                                                          "hub": self.hub_id})
                await db.execute(q.SOCKETS_OPENED, {
                    "socket_ids": array_literal(s.socket_id for s in sockets), "hub": self.hub_id,
                    "client_ids": array_literal(s.principal.client_id for s in sockets),
                    "tenant_ids": array_literal(s.principal.tenant_id for s in sockets)})
                beyond = await db.execute(q.SOCKETS_BEYOND_CAP, {
                    "client_ids": array_literal(p.client_id for p in principals),
                    "tenant_ids": array_literal(p.tenant_id for p in principals), "cap": self.max_sockets_per_client})
                await push_leases.record_capability(db, {s.principal.client_id: s.push_lease for s in sockets})
                await pipe.sync()
                rows = await cur.fetchall()
                replaced = await beyond.fetchall()
                await _lifecycle(db, "client.online", [r for r in rows if not r["was_online"]])
            replays = await self._read_replays(db, principals)
        self._close_replaced(r["socket_id"] for r in replaced if r["hub_id"] == self.hub_id)
        generations = {r["id"]: int(r["interrupt_generation"]) for r in rows}
        return {s: (generations.get(s.principal.client_id, 0), replays.get(s.principal, [])) for s in sockets}

    def _close_replaced(self, socket_ids: Iterable[uuid.UUID]) -> int:
        """Close this hub's sockets that a newer socket of their client (on any hub) put beyond the cap."""
        closed = 0
        for socket_id in socket_ids:
            conn = self._by_socket_id.get(socket_id)
            if conn is None or conn.closing:
                continue
            log.info("closing a client's oldest socket: a newer one replaced it",
                     extra={"client_id": conn.client_id, "limit": self.max_sockets_per_client})
            self._close(conn, REPLACED_CLOSE, b"replaced by a newer connection of this client")
            closed += 1
        return closed

    async def _forget_batch(self, socket_ids: list[uuid.UUID]) -> dict[uuid.UUID, None]:
        async with self._pool.connection() as db:
            await db.execute(q.SOCKETS_CLOSED, {"socket_ids": array_literal(socket_ids), "hub": self.hub_id})
        return {}

    async def fleet_sweep(self) -> None:
        """This hub is alive; the replicas that are (its share of the upgrade budgets); its sockets another hub's
        attach replaced (closed here, 4409); now and then the rows of replicas that died without cleaning up."""
        mine = 0 if self.draining else self.connection_count()
        async with self._pool.connection() as db:
            cur = await db.execute(q.HUB_SEEN, {"hub": self.hub_id, "live_s": LIVE_HUB_S, "sockets": mine})
            row = await cur.fetchone()
            if time.monotonic() - self._last_forget > FORGET_DEAD_HUBS_EVERY_S:
                self._last_forget = time.monotonic()
                await db.execute(q.FORGET_DEAD_HUBS, {"dead_s": DEAD_HUB_S})
        assert row is not None
        self.replaced_elsewhere += self._close_replaced(row["replaced"])
        live = max(1, int(row["live"]))
        if live != self.live_hubs:
            log.info("hub replicas alive changed", extra={"from": self.live_hubs, "to": live})
        self.live_hubs = live
        self.fleet_sockets = int(row["fleet_sockets"])
        self.lightest_hub = int(row["lightest"])
        self.sweeps += 1
        if self.on_live_hubs is not None:
            self.on_live_hubs(live)
        self._rebalance(mine)

    def _rebalance(self, mine: int) -> None:
        """Close a few sockets when this hub holds more than its share of the fleet's (`logic.sockets_to_shed`:
        after a rolling restart the replicas restarted first hold most clients, and nothing else moves them), with
        `HUB_DRAINING_CLOSE` and a delay, so their clients reconnect through the load balancer, spread out."""
        changed = self._sockets_changed - self._changes_at_sweep - self._shed_since_sweep
        self._changes_at_sweep, self._shed_since_sweep = self._sockets_changed, 0
        if self.closing or self.rebalance_slack <= 0:
            return
        now = time.monotonic()
        was_paused = self.shed_returns.paused_until > now
        if self.shed_returns.paused(now):
            if not was_paused:
                log.warning("rebalancing paused: the clients this hub moved keep coming back to it (a load balancer "
                            "with session affinity?)", extra={"pause_s": self.shed_returns.pause_s})
            return
        shed = sockets_to_shed(mine, self.fleet_sockets, self.live_hubs, slack=self.rebalance_slack,
                               changed=changed, lightest=self.lightest_hub)
        if not shed:
            return
        rng = random.Random()
        chosen = rng.sample([c for c in self.all_connections() if not c.closing], shed)
        for conn in chosen:
            self._close(conn, HUB_DRAINING_CLOSE, _reconnect_reason(rng, self.reconnect_spread_ms))
        self._shed_since_sweep = len(chosen)  # their own removal is not churn: the calm test leaves it out
        self.shed_returns.shed((c.principal.client_id for c in chosen), now)
        self.rebalanced += len(chosen)
        metrics.hub_rebalance_closes_total.inc(len(chosen))
        log.info("rebalancing: sockets closed so their clients move to the other replicas", extra={
            "closed": len(chosen), "sockets": mine, "fleet_sockets": self.fleet_sockets, "live_hubs": self.live_hubs})

    async def _replay_batch(self, principals: list[ClientPrincipal]) -> dict[ClientPrincipal, list[str]]:
        async with self._pool.connection() as db:
            return await self._read_replays(db, principals)

    async def _read_replays(self, db: Conn, principals: list[ClientPrincipal]) -> dict[ClientPrincipal, list[str]]:
        """Each client's replay: everything queued for it in lane order, then its outstanding interrupts."""
        by_id = {p.client_id: p for p in principals}
        queued, interrupts = await execution_paths.replay(db, [(c, p.tenant_id) for c, p in by_id.items()],
                                                          limit=REPLAY_LIMIT)
        now = datetime.now(UTC)
        events: dict[ClientPrincipal, list[str]] = {}
        key = self.token_key
        for pushed in await push_leases.replay(db, list(by_id), key=key) if key else ():
            events.setdefault(by_id[pushed.target_client_id], []).append(msgspec.json.encode(pushed.event).decode())
        for r in queued:
            events.setdefault(by_id[r.target_client_id], []).append(
                msgspec.json.encode(task_available_from_row(r)).decode())
        for i in interrupts:
            events.setdefault(by_id[i.target_client_id], []).append(
                msgspec.json.encode(current_interrupt(i, now=now)).decode())
        return events

    async def detach(self, conn: Connection) -> None:
        conn.count_close()
        principal = conn.principal
        client_id = principal.client_id
        async with self._lock(client_id):
            conns = self._sockets.get(client_id)
            if conns is None or conn not in conns:
                return
            conns.discard(conn)
            self._by_socket_id.pop(conn.socket_id, None)
            self._sockets_changed += 1
            metrics.desktop_websocket_connections.dec()
            if not self.draining:
                self._spawn(self._forget_socket(conn), name=f"socket-closed-{client_id}")
            if conns:
                return
            del self._sockets[client_id]
            self.heartbeats.forget(client_id)
            if self.draining or conn.closed_with == HUB_DRAINING_CLOSE:
                # Told to reconnect elsewhere within the spread (the hub drains, or moves it to rebalance): no
                # offline write, no `client.offline` (nor a `client.online` when it attaches to the next hub); one
                # that never comes back is marked offline by the reconciler at its heartbeat timeout, as after a
                # crash. A drain's socket rows went in one statement; a rebalanced socket's goes on its own.
                return
            try:
                await _finished(self._detaching.submit(principal))
            except Exception:
                log.exception("could not mark the client offline", extra={"client_id": str(client_id)})
        log.info("client disconnected", extra={"client_id": str(client_id), "tenant_id": principal.tenant_id})

    async def _forget_socket(self, conn: Connection) -> None:
        try:
            await self._forgetting.submit(conn.socket_id)
        except Exception:  # its row is deleted with the hub's, if this hub dies first
            log.exception("could not delete a closed socket's row", extra={"client_id": conn.client_id})

    async def _detach_batch(self, principals: list[ClientPrincipal]) -> dict[ClientPrincipal, None]:
        """Offline (one statement; a client this hub still held gets its `client.offline` event) for a batch of
        clients whose last socket here closed."""
        async with self._pool.connection() as db, pipelined_transaction(db) as pipe:
            cur = await db.execute(q.CLIENTS_OFFLINE, {"ids": array_literal(p.client_id for p in principals),
                                                       "hub": self.hub_id})
            await pipe.sync()
            await _lifecycle(db, "client.offline", await cur.fetchall())
        return {}

    def _close_oldest_beyond_limit(self, client_id: uuid.UUID) -> None:
        """A client holds at most `max_sockets_per_client` sockets here: the oldest beyond that are closed
        (a reconnecting client's old socket that has not noticed it is dead yet, or a copied token)."""
        conns = sorted((c for c in self._sockets[client_id] if not c.closing), key=lambda c: c.opened_at)
        for old in conns[:max(0, len(conns) - self.max_sockets_per_client)]:
            log.info("closing a client's oldest socket: a newer one replaced it",
                     extra={"client_id": str(client_id), "limit": self.max_sockets_per_client})
            self._close(old, REPLACED_CLOSE, b"replaced by a newer connection of this client")

    def _close(self, conn: Connection, code: int, message: bytes) -> None:
        conn.closing = True
        conn.closed_with = code
        self._spawn(conn.ws.close(code=code, message=message), name=f"close-{conn.client_id}")

    # ---- revocation --------------------------------------------------------------------------
    async def revoke_sweep(self) -> int:
        """Close the sockets of clients that were disabled (4403) or whose token was rotated (4401), and of
        clients that no longer exist; the number of sockets closed. The database compares every socket's token
        and answers only the revoked ones: a sweep of 10,000 sockets reads a handful of rows, not 10,000."""
        revoked: dict[tuple[uuid.UUID, str], bool] = {}
        for params in self._revocation_params():
            async with self._pool.connection() as db:
                cur = await db.execute(q.REVOKED_SOCKETS, params)
                revoked.update({(row["client_id"], row["token_hash"]): row["disabled"]
                                for row in await cur.fetchall()})
        closed = 0
        for (client_id, token_hash), disabled in revoked.items():
            for conn in tuple(self._sockets.get(client_id, ())):
                if conn.closing or conn.principal.token_hash != token_hash:
                    continue
                if disabled:
                    self._close(conn, CLIENT_DISABLED_CLOSE, b"client disabled")
                else:
                    self._close(conn, TOKEN_ROTATED_CLOSE, b"token rotated; authenticate again")
                closed += 1
                if self._on_revoked is not None:
                    self._on_revoked(client_id)
                log.warning("closing a revoked client's socket", extra={
                    "client_id": str(client_id), "reason": "disabled" if disabled else "token_rotated"})
        self.revoked += closed
        return closed

    def _revocation_params(self) -> list[dict[str, str]]:
        """The sweep's statement parameters, a chunk of sockets each (array literals of their client ids and token
        hashes), built again only when a socket came or went: collecting and dumping 10,000 UUIDs and hashes
        every 2 s was a fifth of an idle 10,000-socket hub's CPU. Not deduplicated: a client's second socket is
        rare, and its row comes back twice at worst."""
        if self._sweep_params[0] != self._sockets_changed:
            principals = [c.principal for c in self.all_connections()]
            self._sweep_params = (self._sockets_changed, [
                {"ids": array_literal(str(p.client_id) for p in principals[start:start + REVOCATION_CHUNK]),
                 "token_hashes": array_literal(p.token_hash for p in principals[start:start + REVOCATION_CHUNK])}
                for start in range(0, len(principals), REVOCATION_CHUNK)])
        return self._sweep_params[1]

    async def run_revocation_sweep(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.revocation_check_s)
            if stop.is_set():
                continue
            try:
                await self.fleet_sweep()
                await self.push_key_sweep()
                if self._sockets:
                    await self.revoke_sweep()
            except Exception:
                log.exception("revocation sweep failed; will retry at the next interval")

    # ---- liveness ----------------------------------------------------------------------------
    async def run_pinger(self, stop: asyncio.Event) -> None:
        """One task for all sockets: close the ones silent for longer than the timeout, ping the ones silent for an
        interval or more (a client that heartbeats at the announced interval needs no ping to show it is alive;
        one that only answers pings is pinged every other round, well within the timeout)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.heartbeat_interval_s)
            if stop.is_set():
                return
            now = time.monotonic()
            for n, conn in enumerate(self.all_connections(), start=1):
                if n % PING_SLICE == 0:
                    await asyncio.sleep(0)  # let deliveries and handshakes in between
                if conn.closing:
                    continue
                silent = now - conn.last_seen
                if silent > self.heartbeat_timeout_s:
                    log.info("closing a silent socket", extra={"client_id": conn.client_id})
                    self._close(conn, HEARTBEAT_TIMEOUT_CLOSE, b"heartbeat timeout")
                elif silent >= self.heartbeat_interval_s and not conn.ws.closed:
                    with contextlib.suppress(Exception):
                        await conn.ws.ping()

    async def close_all(self, *, reconnect_spread_ms: int = 0, deadline_s: float = 10.0) -> int:
        """SIGTERM: no new sockets; every client is told to reconnect elsewhere after its own delay, drawn from
        [0, `reconnect_spread_ms`] (`HUB_DRAINING_CLOSE`), so a hub's clients arrive at the others spread out
        instead of in one storm; handlers then clean up. Close handshakes still open after `deadline_s` are
        abandoned (the connections are dropped as the process exits). Returns the sockets told."""
        self.closing = self.draining = True
        conns = self.all_connections()
        try:  # this replica's socket rows and its place among the live replicas, in one statement
            async with self._pool.connection() as db:
                await db.execute(q.HUB_DRAINING, {"hub": self.hub_id})
        except Exception:  # left to the other replicas' clean-up of a silent one (DEAD_HUB_S)
            log.exception("could not remove this hub's socket rows while draining")
        rng = random.Random()
        closes = []
        for conn in conns:
            conn.closed_with = HUB_DRAINING_CLOSE
            closes.append(asyncio.ensure_future(conn.ws.close(
                code=HUB_DRAINING_CLOSE, message=_reconnect_reason(rng, reconnect_spread_ms))))
        if closes:
            _, pending = await asyncio.wait(closes, timeout=deadline_s)
            for close in pending:
                close.cancel()
            log.info("draining: every client told to reconnect elsewhere", extra={
                "sockets": len(conns), "unfinished_closes": len(pending), "spread_ms": reconnect_spread_ms})
        return len(conns)


def _reconnect_reason(rng: random.Random, spread_ms: int) -> bytes:
    """A `HUB_DRAINING_CLOSE` reason with this socket's own delay, drawn from [0, `spread_ms`] (a drain, a shed)."""
    return draining_close_reason(rng.randint(0, max(0, spread_ms))).encode()


async def _finished(submitted: Coroutine[Any, Any, V]) -> V:
    """Await a batched write; a caller that is cancelled (its client went away mid-handshake) still waits for
    the batch it is in before it lets go of the client's lock, so a later offline write cannot overtake it."""
    task = asyncio.ensure_future(submitted)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise


async def _lifecycle(db: Conn, event: LifecycleKind, rows: list[dict[str, Any]]) -> None:
    """`client.online` / `client.offline` for each row (id, tenant_id) through the outbox, in one statement."""
    now = datetime.now(UTC)
    await enqueue_many(db, [OutboxEvent(exchange=LIFECYCLE, routing_key=event, tenant_id=int(r["tenant_id"]),
                                        message=LifecycleEvent(event=event, tenant_id=int(r["tenant_id"]),
                                                               occurred_at=now, client_id=r["id"]))
                            for r in rows])
