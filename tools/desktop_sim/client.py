"""One simulated desktop client.

All state changes happen in ONE serial scheduler loop (`_scheduler`), fed by an asyncio queue of
commands: WebSocket events, phase checkpoints of running tasks, finished tasks, pump requests.
A task_control event only marks state there; the cancel call is made by that loop at the task's
next check (§14.4). Task runners only sleep through phases and post results.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec

from libs.contracts.wire import CAPABILITIES_HEADER, PUSH_LEASE
from libs.telemetry import tracing
from tools.desktop_sim.answers import compose_answer
from tools.desktop_sim.rules import (
    PHASES,
    LocalEntry,
    accepts_generation,
    backoff_delay,
    drain_delay_s,
    handles_interrupt_now,
    is_safe_point,
    order_locally,
    yields_at_checkpoint,
)
from tools.desktop_sim.timings import TIMING_PROFILES, TimingProfile

log = logging.getLogger("desktop_sim")

PREEMPT_REASON = "collect_now_preempt"


# The hub's application close codes that mean "stop": reconnecting would be refused or would fight the other
# process that holds this token (see the README's "Security model").
STOP_CODES = {4401: "token_rotated", 4403: "disabled", 4409: "replaced"}
_SOCKET_ENDED = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                 aiohttp.WSMsgType.ERROR)


@dataclass(slots=True)
class SimOptions:
    hub_url: str
    token: str
    name: str = ""
    timings: TimingProfile = field(default_factory=lambda: TIMING_PROFILES["fast"])
    max_concurrent: int = 1
    heartbeat_interval_s: float = 5.0
    ws_ping_interval_s: float = 10.0
    reconnect_base_s: float = 0.1
    reconnect_max_s: float = 5.0
    idle_poll_s: float | None = 5.0
    mention_rate: float = 0.4
    failure_rate: float = 0.0
    seed: int | None = None
    auto_lease: bool = True
    # Ask for push-lease on the upgrade (docs/desktop-protocol.md "Push-lease"): a granted hub sends executions already
    # leased on task_available, started without a lease call. False: an old pull-lease client.
    push_lease: bool = False
    # Misbehaviour for tests: ignore pushed leases (as a client that lost the event would), so they expire.
    ignore_pushed_leases: bool = False
    # Misbehaviour for tests
    ignore_interrupts: bool = False
    die_at_phase: str | None = None
    die_on_task: int = 1
    platform_health: dict[str, str] = field(default_factory=dict)
    # More dispatch-hub base URLs (a load balancer's job in production): when the current hub cannot be reached,
    # or its socket drops, the client moves on to the next one in the list (wrapping around to `hub_url`).
    hub_urls: tuple[str, ...] = ()


@dataclass(slots=True)
class SimStats:
    connects: int = 0
    hellos: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    event_arrivals: dict[str, float] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    leased: list[tuple[str, str]] = field(default_factory=list)
    lease_times: dict[str, float] = field(default_factory=dict)
    # Lease calls made, tasks started from a pushed lease (no call), and every pushed token seen per task.
    lease_calls: int = 0
    pushed: list[str] = field(default_factory=list)
    pushed_tokens: dict[str, list[str]] = field(default_factory=dict)
    # The capabilities the last hello granted.
    granted: list[str] = field(default_factory=list)
    executed: list[tuple[str, str]] = field(default_factory=list)
    results_refused: list[tuple[str, int]] = field(default_factory=list)
    aborted: list[tuple[str, int]] = field(default_factory=list)
    cancel_refused: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    interrupt_generation_mismatch_count: int = 0
    safe_point_intervals_ms: list[float] = field(default_factory=list)
    phases: dict[str, list[str]] = field(default_factory=dict)
    # task id -> execution_owner of each lease this client took.
    owners: dict[str, str] = field(default_factory=dict)
    died: bool = False
    # Why the hub told this client to stop reconnecting (close code 4401/4403/4409 or a 401 handshake).
    refused: str | None = None

    def snapshot(self) -> dict[str, Any]:
        return {"connects": self.connects, "hellos": self.hellos, "events": len(self.events),
                "leased": len(self.leased), "executed": len(self.executed), "aborted": len(self.aborted),
                "interrupt_generation_mismatch_count": self.interrupt_generation_mismatch_count,
                "results_refused": len(self.results_refused), "died": self.died}


@dataclass(slots=True)
class ActiveTask:
    task_id: str
    lease_token: str
    lane: str
    priority: int
    platform: str
    brand: str
    question: str
    last_seen_generation: int
    phase: str = "PREPARING"
    interrupt_requested: bool = False
    interrupt_reason: str | None = None
    # The lease response's `execution_owner`: legacy work yields to an interrupt only before it really started.
    execution_owner: str = "desktop_tasks"
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    last_safe_point_at: float = field(default_factory=time.monotonic)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None
    done: bool = False
    ordinal: int = 0
    # The `traceparent` of the event this task came with (sent as a header on its calls), and of the interrupt.
    traceparent: str | None = None
    interrupt_traceparent: str | None = None


Command = tuple[Any, ...]


def pushed_lease(event: dict[str, Any]) -> dict[str, Any]:
    """The lease a pushed `task_available` carries, shaped as a lease call's task."""
    return {"task_id": str(event["task_id"]), "lease_token": event["lease_token"], "lane": event["lane"],
            "priority": event["priority"], "platform": event["platform"], "brand": event["brand"],
            "question": event["question"], "interrupt_generation": int(event.get("interrupt_generation") or 0),
            "lease_epoch": event.get("lease_epoch"), "lease_expires_at": event.get("lease_expires_at"),
            "execution_owner": "desktop_tasks"}


class SimClient:
    def __init__(self, options: SimOptions, *, session: aiohttp.ClientSession | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.options = options
        self.stats = SimStats()
        self.client_id: str | None = None
        self.connected = asyncio.Event()
        self._session = session
        self._own_session = session is None
        self._on_event = on_event
        self._rng = random.Random(options.seed)
        self._commands: asyncio.Queue[Command] = asyncio.Queue()
        self._active: dict[str, ActiveTask] = {}
        self._known: dict[str, LocalEntry] = {}
        self._generations: dict[str, int] = {}
        self._traceparents: dict[str, str] = {}  # task id -> its latest event's traceparent, until leased
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._leases_started = 0
        self._hubs = (options.hub_url, *options.hub_urls)
        self._hub_index = 0

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  trace_configs=tracing.client_trace_configs())
        self._tasks = [asyncio.create_task(self._scheduler(), name=f"sim-scheduler-{self.options.name}"),
                       asyncio.create_task(self._connection_loop(), name=f"sim-ws-{self.options.name}")]
        if self.options.idle_poll_s:
            self._tasks.append(asyncio.create_task(self._idle_poller(), name=f"sim-poll-{self.options.name}"))

    async def stop(self) -> None:
        self._stopping.set()
        for active in list(self._active.values()):
            active.stop.set()
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        for task in self._tasks:
            task.cancel()
        runners = [a.runner for a in self._active.values() if a.runner is not None]
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*self._tasks, *runners, return_exceptions=True)
        if self._own_session and self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> SimClient:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    def disconnect(self) -> None:
        """Drop the socket (tests): the connection loop reconnects with backoff."""
        if self._ws is not None:
            asyncio.get_running_loop().create_task(self._ws.close())

    def pump(self) -> None:
        self._commands.put_nowait(("pump",))

    def set_platform_health(self, health: dict[str, str]) -> None:
        """What this client reports of its logins from its next heartbeat on (a user's login broke, or was fixed)."""
        self.options.platform_health = dict(health)

    @property
    def active_task_ids(self) -> list[str]:
        return list(self._active)

    def active_phase(self, task_id: str) -> str | None:
        active = self._active.get(task_id)
        return active.phase if active else None

    # ---- HTTP --------------------------------------------------------------------------------
    @property
    def hub_url(self) -> str:
        """The hub this client talks to now (one of `hub_url` and `hub_urls`)."""
        return self._hubs[self._hub_index]

    def _next_hub(self) -> None:
        self._hub_index = (self._hub_index + 1) % len(self._hubs)

    def _url(self, path: str) -> str:
        return self.hub_url.rstrip("/") + path

    async def _post(self, path: str, body: dict[str, Any], *, traceparent: str | None = None) -> tuple[int, Any]:
        """POST to the hub; `traceparent` (from the task's event) goes as the header, so the hub's spans continue
        that trace (with tracing on here, the aiohttp client's span sits between, a child of it). A hub that
        cannot be reached (or drops the call) is failed over to the next one; each hub is tried twice (a keep-alive
        connection the hub closed fails once)."""
        assert self._session is not None
        headers = {"Authorization": f"Bearer {self.options.token}", "Content-Type": "application/json"}
        if traceparent:
            headers["traceparent"] = traceparent
        attempts = 2 * len(self._hubs)
        for tried in range(1, attempts + 1):
            try:
                with tracing.attached(traceparent):
                    async with self._session.post(self._url(path), data=msgspec.json.encode(body),
                                                  headers=headers) as resp:
                        return resp.status, await resp.json(content_type=None)
            except (aiohttp.ClientConnectionError, OSError):
                if tried == attempts:
                    raise
                self._next_hub()
        raise AssertionError("unreachable: the last hub's failure is raised")

    # ---- WebSocket ---------------------------------------------------------------------------
    async def _connection_loop(self) -> None:
        attempt = 0
        assert self._session is not None
        drain_delay: float | None = None
        while not self._stopping.is_set():
            heartbeat: asyncio.Task[None] | None = None
            try:
                ws = await self._session.ws_connect(
                    self._url("/api/desktop/ws"), heartbeat=self.options.ws_ping_interval_s,
                    headers={"Authorization": f"Bearer {self.options.token}",
                             **({CAPABILITIES_HEADER: PUSH_LEASE} if self.options.push_lease else {})})
                self._ws = ws
                self.stats.connects += 1
                heartbeat = asyncio.create_task(self._heartbeats(ws))
                while True:
                    msg = await ws.receive()
                    if msg.type in _SOCKET_ENDED:
                        self._note_close(msg.data if msg.type is aiohttp.WSMsgType.CLOSE else None)
                        if msg.type is aiohttp.WSMsgType.CLOSE:
                            drain_delay = drain_delay_s(msg.data, str(msg.extra or ""))
                        break
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        continue
                    event: dict[str, Any] = msgspec.json.decode(msg.data)
                    task_id = event.get("task_id")
                    if task_id and task_id not in self.stats.event_arrivals:
                        self.stats.event_arrivals[task_id] = time.monotonic()
                    if event.get("type") == "hello":
                        attempt = 0
                    if self._on_event is not None:
                        self._on_event(event)
                    self._commands.put_nowait(("event", event))
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status == 401:
                    self.stats.refused = "unauthorized"  # unknown or rotated token, or a disabled client
                    log.warning("the hub refused this client's token; not reconnecting",
                                extra={"sim": self.options.name})
                elif exc.status == 429 and exc.headers and exc.headers.get("Retry-After", "").isdigit():
                    retry_after = int(exc.headers["Retry-After"])
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), retry_after)
                log.debug("handshake refused", extra={"sim": self.options.name, "status": exc.status})
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.debug("connection failed", extra={"sim": self.options.name, "error": str(exc)})
            finally:
                self._ws = None
                self.connected.clear()
                if heartbeat is not None:
                    heartbeat.cancel()
            if self._stopping.is_set() or self.stats.died or self.stats.refused is not None:
                return
            self._next_hub()  # the socket dropped or never opened: the next hub, if there are more
            if drain_delay is not None:  # a draining hub (4503) drew this socket's delay: spread, not backoff
                delay, drain_delay = drain_delay, None
            else:
                delay = backoff_delay(attempt, base_s=self.options.reconnect_base_s,
                                      max_s=self.options.reconnect_max_s, rng=self._rng)
                attempt += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    def _note_close(self, code: int | None) -> None:
        """The hub's close codes a client acts on: 4401 (token rotated), 4403 (disabled) and 4409 (another
        process uses this token) mean "do not reconnect"; anything else is reconnected with backoff."""
        reason = STOP_CODES.get(int(code)) if code is not None else None
        if reason is not None:
            self.stats.refused = reason
            log.warning("the hub closed this client's socket for good", extra={"sim": self.options.name,
                                                                               "code": code, "reason": reason})

    async def _heartbeats(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while not ws.closed:
            await asyncio.sleep(self.options.heartbeat_interval_s)
            active = next(iter(self._active.values()), None)
            message: dict[str, Any] = {"type": "heartbeat", "sent_at": datetime.now(UTC).isoformat(),
                                       "local_queue_depth": len(self._known)}
            if self.options.platform_health:
                message["platform_health"] = self.options.platform_health
            if active is not None:
                message["active_task_id"] = active.task_id
                message["execution_phase"] = active.phase
            with contextlib.suppress(Exception):
                await ws.send_str(msgspec.json.encode(message).decode())

    async def _idle_poller(self) -> None:
        """A slow safety net only: dispatch is signal-driven (task_available, finished tasks)."""
        assert self.options.idle_poll_s is not None
        while not self._stopping.is_set():
            await asyncio.sleep(self.options.idle_poll_s)
            if not self._active and self.connected.is_set():
                self.pump()

    # ---- the serial scheduler loop -------------------------------------------------------------
    async def _scheduler(self) -> None:
        while True:
            command = await self._commands.get()
            try:
                await self._handle(command)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scheduler command failed", extra={"sim": self.options.name, "command": command[0]})
                if command[0] == "checkpoint":
                    # No hub answered the extend (or the cancel): the task is given up here, and its lease expires
                    # on the server. Kept, it would hold one of this client's slots for good.
                    active = self._active.get(command[1])
                    if active is not None:
                        self._finish(active)
                    if not command[3].done():
                        command[3].set_result(False)

    async def _handle(self, command: Command) -> None:
        kind = command[0]
        if kind == "event":
            await self._on_server_event(command[1])
        elif kind == "checkpoint":
            _, task_id, next_phase, decision = command
            decision.set_result(await self._checkpoint(task_id, next_phase))
        elif kind == "finished":
            self._active.pop(command[1], None)
            await self._pump()
        elif kind == "pump":
            await self._pump()

    async def _on_server_event(self, event: dict[str, Any]) -> None:
        self.stats.events.append(event)
        etype = event.get("type")
        if etype == "hello":
            self.stats.hellos += 1
            self.client_id = str(event["client_id"])
            self.stats.granted = list(event.get("capabilities") or [])
            self._known.clear()  # the replay that follows is the truth
            self._traceparents.clear()
            self.connected.set()
            await self._pump()
        elif etype == "task_available":
            await self._on_task_available(event)
        elif etype == "task_control":
            await self._on_task_control(event)
        elif etype == "error":
            self.stats.errors.append(event)

    def _accept_generation(self, task_id: str, generation: int) -> bool:
        last = self._generations.get(task_id, 0)
        active = self._active.get(task_id)
        if active is not None:
            last = max(last, active.last_seen_generation)
        if not accepts_generation(generation, last):
            self.stats.interrupt_generation_mismatch_count += 1
            return False
        self._generations[task_id] = generation
        if active is not None:
            active.last_seen_generation = generation
        return True

    async def _on_task_available(self, event: dict[str, Any]) -> None:
        task_id = str(event["task_id"])
        if event.get("kind") != "monitor":
            return  # publish tasks are not simulated
        if not self._accept_generation(task_id, int(event.get("interrupt_generation", 0))):
            return
        if event.get("traceparent") and task_id not in self._active:
            self._traceparents[task_id] = str(event["traceparent"])
        if event.get("lease_token"):
            self.stats.pushed_tokens.setdefault(task_id, []).append(str(event["lease_token"]))
            if self.options.ignore_pushed_leases:
                return
            if task_id not in self._active and self.options.auto_lease and not self.stats.died:
                self._known.pop(task_id, None)
                self.stats.pushed.append(task_id)
                self._start(pushed_lease(event), traceparent=event.get("traceparent"))
            return
        if task_id not in self._active:
            self._known[task_id] = LocalEntry(
                task_id=task_id, kind="monitor", lane=str(event["lane"]), priority=int(event["priority"]),
                available_at=time.monotonic(), enqueued_at=str(event.get("updated_at", "")),
                updated_at=str(event.get("updated_at", "")))
        await self._pump(traceparent=event.get("traceparent"))

    async def _on_task_control(self, event: dict[str, Any]) -> None:
        task_id = str(event["task_id"])
        if not self._accept_generation(task_id, int(event.get("interrupt_generation", 0))):
            return
        control = event.get("control")
        active = self._active.get(task_id)
        if active is None:
            if control in ("cancelled", "lease_revoked"):
                self._known.pop(task_id, None)
                self._traceparents.pop(task_id, None)
            return
        if control == "interrupt_requested":
            active.interrupt_requested = True
            active.interrupt_traceparent = event.get("traceparent") or active.interrupt_traceparent
            active.interrupt_reason = str(event.get("reason") or PREEMPT_REASON)
            if handles_interrupt_now(active.phase) and not self.options.ignore_interrupts:
                await self._abort(active, safe_point_interval_ms=None)
        elif control in ("cancelled", "lease_revoked"):
            # The server already ended it: stop quietly, no callback.
            self._finish(active)
            self.stats.dropped.append((task_id, str(control)))
            await self._pump()

    async def _checkpoint(self, task_id: str, next_phase: str) -> bool:
        """A running task reached the end of a phase. Decide here, in the serial loop: interrupt at a
        safe point, or move on (extend with the new phase). Returns whether to continue."""
        active = self._active.get(task_id)
        if active is None or active.done:
            return False
        interval_ms: float | None = None
        if is_safe_point(next_phase):
            now = time.monotonic()
            interval_ms = (now - active.last_safe_point_at) * 1000
            active.last_safe_point_at = now
            self.stats.safe_point_intervals_ms.append(interval_ms)
        if (active.interrupt_requested and not self.options.ignore_interrupts
                and yields_at_checkpoint(active.execution_owner, active.phase, next_phase)):
            await self._abort(active, safe_point_interval_ms=interval_ms)
            return False
        if (self.options.die_at_phase == next_phase and active.ordinal == self.options.die_on_task
                and not self.stats.died):
            await self._die()
            return False
        active.phase = next_phase
        self.stats.phases.setdefault(task_id, []).append(next_phase)
        body: dict[str, Any] = {"lease_token": active.lease_token, "execution_phase": next_phase}
        if interval_ms is not None:
            body["safe_point_interval_ms"] = int(interval_ms)
        status, response = await self._post(f"/api/desktop/tasks/{task_id}/extend", body,
                                            traceparent=active.traceparent)
        if status != 200:
            self.stats.cancel_refused.append((task_id, str(response.get("error"))))
            self._finish(active)
            return False
        if response.get("interrupt_requested") and self._accept_generation(
                task_id, int(response.get("interrupt_generation", 0))):
            # The extend answer is a backup channel for a task_control the socket may have missed.
            active.interrupt_requested = True
        return True

    async def _abort(self, active: ActiveTask, *, safe_point_interval_ms: float | None) -> None:
        body: dict[str, Any] = {"lease_token": active.lease_token, "reason": PREEMPT_REASON,
                                "interrupt_generation": active.last_seen_generation,
                                "execution_phase": active.phase}
        if safe_point_interval_ms is not None:
            body["safe_point_interval_ms"] = int(safe_point_interval_ms)
        path = f"/api/desktop/tasks/{active.task_id}/cancel"
        traceparent = active.interrupt_traceparent or active.traceparent  # the click that asked for it
        status, response = await self._post(path, body, traceparent=traceparent)
        if status == 409 and response.get("error") == "stale_generation":
            # The server holds a newer interrupt (and re-sent it): acknowledge that one.
            active.last_seen_generation = int(response["current_generation"])
            self._generations[active.task_id] = active.last_seen_generation
            body["interrupt_generation"] = active.last_seen_generation
            status, response = await self._post(path, body, traceparent=traceparent)
        if status == 200:
            self.stats.aborted.append((active.task_id, active.last_seen_generation))
        else:
            self.stats.cancel_refused.append((active.task_id, str(response.get("error"))))
        self._finish(active)
        await self._pump()  # §14.4 item 6: straight on to the next (high) task

    def _finish(self, active: ActiveTask) -> None:
        active.done = True
        active.stop.set()
        self._active.pop(active.task_id, None)

    async def _die(self) -> None:
        """Crash mid-task: no callback, no goodbye; the lease will expire on the server."""
        self.stats.died = True
        self._stopping.set()
        for other in list(self._active.values()):
            other.done = True
            other.stop.set()
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()

    async def _pump(self, *, traceparent: str | None = None) -> None:
        """Pull-lease while there is free capacity (§14.4 item 6: the best task comes first). `traceparent`: of
        the event that prompted it."""
        if not self.options.auto_lease or self.stats.died or self._stopping.is_set():
            return
        if PUSH_LEASE in self.stats.granted and not self._known:
            return  # pushed leases arrive by themselves; a lease call only for work the hub said is queued
        free = self.options.max_concurrent - len(self._active)
        while free > 0:
            self.stats.lease_calls += 1
            status, body = await self._post("/api/desktop/monitor/lease", {"max_tasks": free},
                                            traceparent=traceparent)
            if status != 200:
                self.stats.errors.append({"lease_status": status, **(body or {})})
                return
            tasks = body["tasks"]
            if not tasks:
                self._known.clear()
                self._traceparents.clear()
                return
            entries = {t["task_id"]: t for t in tasks}
            now = time.monotonic()
            ordered = order_locally([LocalEntry(task_id=t["task_id"], kind="monitor", lane=t["lane"],
                                                priority=int(t["priority"]), available_at=now,
                                                enqueued_at="", updated_at="") for t in tasks])
            for entry in ordered:
                self._start(entries[entry.task_id], traceparent=traceparent)
            free -= len(tasks)

    def _start(self, leased: dict[str, Any], *, traceparent: str | None = None) -> None:
        task_id = leased["task_id"]
        self._known.pop(task_id, None)
        traceparent = self._traceparents.pop(task_id, None) or traceparent
        generation = max(int(leased["interrupt_generation"]), self._generations.get(task_id, 0))
        active = ActiveTask(task_id=task_id, lease_token=leased["lease_token"], lane=leased["lane"],
                            priority=int(leased["priority"]), platform=leased["platform"]["code"],
                            brand=leased["brand"]["name"], question=leased["question"]["text"],
                            last_seen_generation=generation,
                            interrupt_requested=bool(leased.get("interrupt_requested", False)),
                            execution_owner=str(leased.get("execution_owner") or "desktop_tasks"),
                            traceparent=traceparent)
        self.stats.owners[task_id] = active.execution_owner
        self._active[task_id] = active
        self._leases_started += 1
        active.ordinal = self._leases_started
        self.stats.leased.append((task_id, active.lane))
        self.stats.lease_times[task_id] = time.monotonic()
        self.stats.phases[task_id] = ["PREPARING"]
        active.runner = asyncio.create_task(self._run(active), name=f"sim-task-{task_id}")

    # ---- task runner (phases only; decisions are the scheduler's) -------------------------------
    async def _run(self, active: ActiveTask) -> None:
        timings = self.options.timings
        for index, phase in enumerate(PHASES):
            if index > 0:
                decision: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                self._commands.put_nowait(("checkpoint", active.task_id, phase, decision))
                if not await decision:
                    return
            if phase == "POSTING":
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(active.stop.wait(), timings.duration(active.platform, phase, self._rng))
            if active.stop.is_set():
                return
        await self._post_result(active)

    async def _post_result(self, active: ActiveTask) -> None:
        failed = self._rng.random() < self.options.failure_rate
        answer = compose_answer(question=active.question, brand=active.brand, platform=active.platform,
                                rng=self._rng, mention_rate=self.options.mention_rate)
        body: dict[str, Any] = {
            "lease_token": active.lease_token, "status": "failed" if failed else "succeeded",
            "started_at": active.started_at.isoformat(), "finished_at": datetime.now(UTC).isoformat()}
        if failed:
            body["error"] = "answer did not load before the timeout"
        else:
            body.update(answer_text=answer.text, citations=answer.citations, brand_mentioned=answer.brand_mentioned)
        path = f"/api/desktop/tasks/{active.task_id}/result"
        for attempt in range(8):
            try:
                status, _ = await self._post(path, body, traceparent=active.traceparent)
            except (aiohttp.ClientError, OSError):
                status = 0
            if status == 202:
                self.stats.executed.append((active.task_id, active.lane))
                break
            if status in (404, 409):
                self.stats.results_refused.append((active.task_id, status))
                break
            await asyncio.sleep(backoff_delay(attempt, base_s=0.2, max_s=3.0, rng=self._rng))
        active.done = True
        self._commands.put_nowait(("finished", active.task_id))
