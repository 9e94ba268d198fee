"""Service chaos and soak: every service as real processes (two of most, the leader-elected ones hot standbys) on
real Postgres and RabbitMQ, a fleet of simulated desktop clients spread over both hubs, a compressed business
day plus collect-now clicks (optionally some tenants on the legacy execution path, the others on desktop_tasks:
`seed_world(legacy_tenants=...)`), a fault injector, and the invariants read back from the database and the broker,
each on both paths.

Used by tests/e2e/test_service_chaos.py (faults) and bench/soak.py (no faults, resources sampled over time).

Faults: `kill -9` of one replica at a time (the coordinator leader, a pump, the hub with the most sockets, an
ingest worker, the projection worker, the reconciler), restarted after a random pause; every broker connection
of the services closed by the broker (`rabbitmqctl eval`, only the connections that come through this test's
`BrokerLink`, so other test runs on the same broker keep theirs) or cut at the TCP level for a few seconds; and
every Postgres backend of the services terminated. A seeded `random.Random` draws the schedule, the workload
and the clicks, so a failing run can be replayed with its seed (the timing of the machine still varies).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiohttp
import msgspec
import psycopg
from psycopg_pool import AsyncConnectionPool

from libs.auth import TenantPrincipal
from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from libs.domain.schedule import execution_owner_for
from libs.ingest.runs import incoming_wins
from libs.mq.topology import Topology, delete_all
from tests.support.collect_now import gateway_token
from tests.support.procs import ServiceProcess, service_env
from tests.support.projection import as_rows, recomputed_from_facts, stored
from tests.support.tcpproxy import TcpProxy
from tools.desktop_sim.client import SimClient, SimOptions
from tools.desktop_sim.timings import TIMING_PROFILES

# ---- the stack ------------------------------------------------------------------------------------------------

REPLICAS: dict[str, int] = {
    "collect-now-api": 1,
    "dispatch-coordinator": 2,
    "outbox-pump": 2,
    "dispatch-hub": 2,
    "ingest-shard-workers": 2,
    "projection-worker": 1,
    "reconciler": 1,
}

# Timeouts short enough that the work a killed replica or client leaves behind is repaired within seconds, and
# pools small enough that the eleven processes stay well inside Postgres's 100 connections.
CHAOS_ENV: dict[str, str | int] = {
    "HEARTBEAT_TIMEOUT_SECONDS": 3,
    "LEASE_TTL_SECONDS": 3,
    "HUB_PING_INTERVAL_S": "0.5",
    "HUB_HEARTBEAT_FLUSH_S": "0.3",
    "RECONCILER_INTERVALS": ("expired_leases=0.5,request_ttl=0.5,offline_clients=0.5,interrupt_timeouts=0.5,"
                             "unknown_executions=1,business_day_expiry=5"),
    # Every hub kill reconnects its clients at once: the per-client upgrade bucket is not what is tested here.
    "HUB_UPGRADES_PER_CLIENT_PER_S": 2,
    "HUB_UPGRADE_BURST_PER_CLIENT": 20,
    "INGEST_MEMBER_HEARTBEAT_SECONDS": 1,
    "INGEST_MEMBER_TIMEOUT_SECONDS": 4,
    "DB_POOL_MAX": 3,
    "SHUTDOWN_GRACE_SECONDS": 5,
}

# dispatch_settings for the run: budgets small enough to bind (10 s windows), collect-now limits that let a
# click every few seconds through, the fast timeouts of CHAOS_ENV.
CHAOS_SETTINGS: dict[str, Any] = {
    "lease_ttl_seconds": 3,
    "heartbeat_timeout_seconds": 3,
    "unknown_grace_seconds": 10,
    "request_no_dispatch_warn_seconds": 2,
    "max_dispatch_attempts": 5,
    "budget_window_seconds": 10,
    "cluster_dispatch_per_minute": 40,
    "tenant_dispatch_per_minute": 15,
    "request_ttl_seconds": 60,
    "max_requests_per_user_per_hour": 100_000,
    "dispatch_tick_ms": 500,
}
PLATFORM_MAX_CONCURRENT = 2
INTERRUPT_TIMEOUTS_MS = (2_000, 6_000)
TERMINAL_TASK = ("completed", "failed", "skipped", "expired")
OPEN_REQUEST = ("accepted", "dispatching", "running")
ACTIVE_EXECUTION = ("queued", "in_progress", "unknown")
HARNESS_APPLICATIONS = ("tests", "chaos-injector", "soak")
# How many times a replica is started again before the run gives up on it (one second apart).
START_ATTEMPTS = 30


@dataclass
class Replica:
    service: str
    index: int
    proc: ServiceProcess
    up: bool = False

    @property
    def label(self) -> str:
        return f"{self.service}#{self.index}"

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def pid(self) -> int | None:
        return self.proc.proc.pid if self.proc.proc is not None and self.proc.proc.poll() is None else None


class BrokerLink(TcpProxy):
    """The services reach RabbitMQ through here: cut (a network partition), or their connections closed by the
    broker itself, found by the local ports of this proxy's upstream sockets."""

    def upstream_ports(self) -> list[int]:
        ports = []
        for writer in list(self._writers):
            peer = writer.get_extra_info("peername")
            local = writer.get_extra_info("sockname")
            if not writer.is_closing() and peer and local and peer[1] == self.target_port:
                ports.append(int(local[1]))
        return sorted(ports)

    async def close_from_broker(self) -> int:
        """`rabbitmqctl eval`: the broker closes (connection.close, 320 CONNECTION_FORCED) every connection that
        came through this link, as `rabbitmqctl close_all_connections` would, but for this run's services only."""
        ports = ",".join(str(p) for p in self.upstream_ports())
        expression = (
            "[rabbit_networking:close_connection(proplists:get_value(pid, I), \"chaos\") || "
            "I <- rabbit_networking:connection_info_all([pid, peer_port]), "
            f"lists:member(proplists:get_value(peer_port, I), [{ports}])].")
        out = await asyncio.to_thread(_rabbitmqctl, "eval", expression)
        return out.count("ok")


def _rabbitmqctl(*args: str) -> str:
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


@dataclass(frozen=True)
class QueueDepth:
    ready: int
    unacked: int
    consumers: int

    @property
    def messages(self) -> int:
        return self.ready + self.unacked


def queue_stats(prefix: str) -> dict[str, QueueDepth]:
    """Every queue whose name starts with `prefix`: messages ready, delivered but unacknowledged, and consumers
    (`rabbitmqctl`: no management plugin needed, and it sees the hubs' exclusive queues too)."""
    out = _rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "messages_ready",
                       "messages_unacknowledged", "consumers")
    stats: dict[str, QueueDepth] = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and parts[0].startswith(prefix):
            stats[parts[0]] = QueueDepth(int(parts[1]), int(parts[2]), int(parts[3]))
    return stats


def queue_consumers(prefix: str) -> Counter[str]:
    """Consumers per queue whose name starts with `prefix` (`rabbitmqctl list_consumers`: the consumer count of
    `list_queues` lags behind for quorum queues)."""
    out = _rabbitmqctl("list_consumers", "-q", "--no-table-headers", "queue_name")
    return Counter(line.strip() for line in out.splitlines() if line.startswith(prefix))


def work_queues(topology: Topology) -> list[str]:
    """The queues a service consumes for as long as it runs: every ingest shard, projection, lifecycle."""
    return [*(topology.ingest_queue(k) for k in range(topology.ingest_shards)), topology.projection_queue,
            topology.lifecycle_queue("coordinator"), topology.lifecycle_queue("reconciler")]


def queue_depths(prefix: str) -> dict[str, int]:
    """Messages (ready + unacknowledged) of every queue whose name starts with `prefix`."""
    return {name: depth.messages for name, depth in queue_stats(prefix).items()}


class ChaosStack:
    """`REPLICAS` of every service, their AMQP connections through a `BrokerLink`; one replica can be killed and
    started again (same port, so clients find it where it was)."""

    def __init__(self, settings: Settings, log_dir: Path, *, replicas: dict[str, int] | None = None,
                 env: dict[str, str | int] | None = None) -> None:
        self.settings = settings
        self.log_dir = log_dir
        broker = urlsplit(settings.amqp_url)
        self.link = BrokerLink(broker.hostname or "127.0.0.1", broker.port or 5672)
        self._replica_counts = replicas or REPLICAS
        self._env = {**CHAOS_ENV, **(env or {})}
        self.replicas: list[Replica] = []
        # Replicas that exited although nobody killed them: (seconds since start, replica, the end of its log).
        self.crashes: list[tuple[float, str, str]] = []
        # Starts again after a kill or a crash that failed (exited before ready, or not ready in time), each
        # retried: (seconds since start, replica, the end of its log, where the reason is).
        self.failed_starts: list[tuple[float, str, str]] = []
        self._started = time.monotonic()
        self._supervisor: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.link.start()
        broker = urlsplit(self.settings.amqp_url)
        netloc = broker.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{self.link.port}"
        routed = urlunsplit(broker._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))
        base = service_env(dataclasses.replace(self.settings, amqp_url=routed), **self._env)
        for service, count in self._replica_counts.items():
            for index in range(count):
                self.replicas.append(Replica(service, index, ServiceProcess(service, base, log_dir=self.log_dir)))
        started = await asyncio.gather(*(asyncio.to_thread(r.proc.start) for r in self.replicas),
                                       return_exceptions=True)
        for replica, outcome in zip(self.replicas, started, strict=True):
            if isinstance(outcome, BaseException):
                raise outcome
            replica.up = True
        self._started = time.monotonic()
        self._supervisor = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        """What Kubernetes would do: a replica that exited by itself is recorded (a crash is a finding) and
        started again, so the run goes on with every replica."""
        while True:
            for replica in self.replicas:
                if replica.up and replica.proc.proc is not None and replica.proc.proc.poll() is not None:
                    replica.up = False
                    self.crashes.append((round(time.monotonic() - self._started, 1), replica.label,
                                         replica.proc.logs()[-3000:]))
                    await asyncio.to_thread(replica.proc.kill)  # closes its log
                    restart = asyncio.create_task(self._restart_crashed(replica))  # the others stay watched
                    self._restarts.add(restart)
                    restart.add_done_callback(self._restarts.discard)
            await asyncio.sleep(0.5)  # a polling period, not a wait for a condition

    async def _restart_crashed(self, replica: Replica) -> None:
        with contextlib.suppress(Exception):  # every failed start is in failed_starts already
            await self.restart(replica)

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        for restart in list(self._restarts):
            restart.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(r.proc.stop) for r in reversed(self.replicas)))
        for replica in self.replicas:
            replica.up = False
        await self.link.close()
        with contextlib.suppress(Exception):
            connection = await asyncio.wait_for(aio_pika.connect(self.settings.amqp_url), 10)
            try:
                async with connection.channel() as channel:
                    topology = Topology(self.settings.mq_prefix, self.settings.ingest_shards)
                    await asyncio.wait_for(delete_all(channel, topology), 30)
            finally:
                await connection.close()

    def of(self, service: str) -> list[Replica]:
        return [r for r in self.replicas if r.service == service]

    @property
    def hub_urls(self) -> list[str]:
        return [r.url for r in self.of("dispatch-hub")]

    @property
    def api_url(self) -> str:
        return self.of("collect-now-api")[0].url

    async def kill(self, replica: Replica) -> None:
        replica.up = False
        await asyncio.to_thread(replica.proc.kill)

    async def restart(self, replica: Replica) -> None:
        """Start a replica again, as Kubernetes would: a start that fails is recorded in `failed_starts` and
        retried a second later (up to START_ATTEMPTS times), so one failed start does not leave the service a
        replica short for the rest of the run (and every later check with it)."""
        for attempt in range(START_ATTEMPTS):
            try:
                await asyncio.to_thread(replica.proc.start)
            except Exception as exc:
                await asyncio.to_thread(replica.proc.kill)  # a start not ready in time is still running
                self.failed_starts.append((round(time.monotonic() - self._started, 1), replica.label,
                                           str(exc)[-3000:]))
                if attempt == START_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(1.0)  # the back-off between two starts, not a wait for a condition
            else:
                replica.up = True
                return

    async def metric(self, replica: Replica, sample: str) -> float:
        """A sample of a replica's /metrics (`name{labels}` as printed); 0 when absent or unreachable."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http, \
                    http.get(replica.url + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    name, _, value = line.rpartition(" ")
                    if name == sample:
                        return float(value)
        return 0.0

    async def leader(self, service: str) -> Replica | None:
        for replica in self.of(service):
            if replica.up and await self.metric(replica, f'leader_is_active{{role="{service}"}}') == 1.0:
                return replica
        return None

    async def collect_now(self, tenant: dict[str, Any], brand_id: int, body: dict[str, Any]) -> tuple[int, Any]:
        """A user's click (the gateway's JWT for the tenant's demo user); (status, body), whatever the status."""
        principal = TenantPrincipal(tenant_id=tenant["tenant_id"], workspace_id=tenant["workspace_id"],
                                    user_id=tenant["user_id"])
        token = gateway_token(principal, self.settings.gateway_jwt_secret)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http, http.post(
                    f"{self.api_url}/api/tenant/monitoring/brands/{brand_id}/collect-now", json=body,
                    headers={"Authorization": f"Bearer {token}"}) as resp:
                return resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return 0, {"error": type(exc).__name__}

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"===== {r.label}\n{r.proc.logs()[-tail:]}" for r in self.replicas)


@contextlib.asynccontextmanager
async def running_chaos_stack(settings: Settings, log_dir: Path, **kwargs: Any) -> AsyncIterator[ChaosStack]:
    stack = ChaosStack(settings, log_dir, **kwargs)
    try:
        await stack.start()
        yield stack
    finally:
        await stack.stop()


# ---- the workload ---------------------------------------------------------------------------------------------

async def seed_world(conn: Conn, *, tenants: int, brands: int, questions: int, clients: int,
                     legacy_tenants: int = 0) -> dict[str, Any]:
    """Tenants with brands, questions and plans (not due: `schedule_business_day` spreads them), desktop clients,
    and the run's dispatch and platform settings. `legacy_tenants` of the tenants run on the legacy path
    (`rollout_legacy`); each tenant of the result says its `execution_owner`."""
    seeded = await seed_demo(conn, tenants=tenants, brands=brands, questions=questions, clients=clients, due=False)
    for key, value in CHAOS_SETTINGS.items():
        await set_setting(conn, key, value)
    rollout = rollout_legacy([int(t["tenant_id"]) for t in seeded["tenants"]], legacy_tenants)
    await set_setting(conn, "rollout_percentage", rollout)
    for tenant in seeded["tenants"]:
        tenant["execution_owner"] = execution_owner_for(int(tenant["tenant_id"]), rollout)
    seeded["rollout_percentage"] = rollout
    soft, hard = INTERRUPT_TIMEOUTS_MS
    await conn.execute("UPDATE platform_settings SET max_concurrent = %s, interrupt_soft_timeout_ms = %s, "
                       "interrupt_hard_timeout_ms = %s", (PLATFORM_MAX_CONCURRENT, soft, hard))
    return seeded


def rollout_legacy(tenant_ids: Sequence[int], legacy: int) -> int:
    """The `rollout_percentage` that puts exactly `legacy` of the tenants on the legacy path (`tenant_id % 100 <
    rollout` takes desktop_tasks): those with the highest `tenant_id % 100`. Tenant ids are serial from 1 in a test
    database: tenants 1, 2, 3 with one on legacy give rollout 3 (tenant 3 on legacy)."""
    if legacy <= 0:
        return 100
    buckets = sorted(t % 100 for t in tenant_ids)
    rollout = buckets[-legacy]
    if legacy < len(buckets) and buckets[-legacy - 1] >= rollout:
        raise ValueError(f"tenants {sorted(tenant_ids)}: no rollout percentage puts exactly {legacy} on legacy")
    return rollout


async def schedule_business_day(conn: Conn, rng: random.Random, spread_s: float) -> int:
    """A compressed business day: every plan comes due at its own moment in the next `spread_s` seconds (in a
    seeded random order), for the coordinator's scanner to turn into business tasks. Returns the plan count."""
    cur = await conn.execute("SELECT id FROM monitoring_plans ORDER BY id")
    ids = [int(r["id"]) for r in await cur.fetchall()]
    rng.shuffle(ids)
    offsets = [spread_s * i / max(1, len(ids)) for i in range(len(ids))]
    await conn.execute("UPDATE monitoring_plans p SET next_run_at = now() + make_interval(secs => o.offset_s) "
                       "FROM unnest(%(ids)s::bigint[], %(offsets)s::float8[]) AS o(id, offset_s) WHERE p.id = o.id",
                       {"ids": ids, "offsets": offsets})
    return len(ids)


@dataclass
class Click:
    at_s: float
    tenant_id: int
    brand_id: int
    questions: int
    status: int
    request_id: str | None


class Clicker:
    """Collect-now clicks on random tenants, brands and question subsets, at random moments: every tenant once
    first (in a random order, so each execution path gets its clicks), then random tenants."""

    def __init__(self, stack: ChaosStack, seeded: dict[str, Any], rng: random.Random) -> None:
        self.stack = stack
        self.tenants: list[dict[str, Any]] = seeded["tenants"]
        self.rng = rng
        self.clicks: list[Click] = []

    async def run(self, duration_s: float, *, mean_gap_s: float) -> None:
        started = time.monotonic()
        first_round = self.rng.sample(self.tenants, len(self.tenants))
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * mean_gap_s)  # the pace of the users, not a wait
            if time.monotonic() - started >= duration_s:
                return
            tenant = first_round.pop(0) if first_round else self.rng.choice(self.tenants)
            brand = self.rng.choice(tenant["brands"])
            chosen = self.rng.sample(brand["question_ids"], min(len(brand["question_ids"]), self.rng.randint(1, 3)))
            status, body = await self.stack.collect_now(tenant, brand["brand_id"], {"question_ids": chosen})
            request_id = str(body["request_id"]) if status in (200, 202) and isinstance(body, dict) else None
            self.clicks.append(Click(round(time.monotonic() - started, 1), tenant["tenant_id"], brand["brand_id"],
                                     len(chosen), status, request_id))

    def summary(self) -> dict[str, int]:
        return dict(sorted(Counter(str(c.status) for c in self.clicks).items()))

    def by_path(self) -> dict[str, dict[str, int]]:
        """Clicks by the execution path of their tenant, then by status."""
        owner = {int(t["tenant_id"]): str(t.get("execution_owner", "desktop_tasks")) for t in self.tenants}
        paths: dict[str, Counter[str]] = defaultdict(Counter)
        for click in self.clicks:
            paths[owner[click.tenant_id]][str(click.status)] += 1
        return {path: dict(sorted(c.items())) for path, c in sorted(paths.items())}


# ---- the fleet ------------------------------------------------------------------------------------------------

class ChaosClient(SimClient):
    """A simulated desktop that also records, with wall-clock times, what the invariants need: every event it
    received, every result the hub answered 202 for, when it held each execution, and which of its calls the
    lease fence refused."""

    def __init__(self, options: SimOptions, *, session: aiohttp.ClientSession, record: bool = True) -> None:
        super().__init__(options, session=session, on_event=self._record_event if record else None)
        self.record = record
        self.received: list[tuple[float, dict[str, Any]]] = []
        self.accepted_results: set[str] = set()
        # task id -> [leased at, ended here at]: from the lease answer until the client posted its result or
        # cancel, was refused, was told to stop, or gave the task up.
        self.held: dict[str, list[float]] = {}
        self.fenced: dict[str, float] = {}
        self.connected_periods: list[list[float]] = []

    def _record_event(self, event: dict[str, Any]) -> None:
        now = time.time()
        self.received.append((now, event))
        if event.get("type") == "task_control" and event.get("control") in ("cancelled", "lease_revoked"):
            self._ended(str(event.get("task_id")), now)

    def _ended(self, task_id: str, at: float) -> None:
        held = self.held.get(task_id)
        if held is not None and held[1] == math.inf:
            held[1] = at

    async def _post(self, path: str, body: dict[str, Any], *, traceparent: str | None = None) -> tuple[int, Any]:
        parts = path.split("/")
        task_id = parts[4] if path.startswith("/api/desktop/tasks/") and len(parts) > 5 else None
        call = parts[-1]
        if task_id is not None and call in ("result", "cancel"):
            self._ended(task_id, time.time())
        try:
            status, response = await super()._post(path, body, traceparent=traceparent)
        except Exception:
            if task_id is not None:
                self._ended(task_id, time.time())
            raise
        if not self.record:
            return status, response
        now = time.time()
        if path == "/api/desktop/monitor/lease" and status == 200:
            for task in response.get("tasks", []):
                self.held[str(task["task_id"])] = [now, math.inf]
        elif task_id is not None:
            if call == "result" and status == 202:
                self.accepted_results.add(str(response["result_id"]))
            refused = status == 404 or (status == 409 and isinstance(response, dict)
                                        and response.get("error") == "stale_lease")
            if refused:
                self.fenced.setdefault(task_id, now)
            if refused or (call == "extend" and status != 200):
                self._ended(task_id, now)
        return status, response

    def was_connected(self, at: float) -> bool:
        return any(start <= at < end for start, end in self.connected_periods)


class Fleet:
    """ChaosClients, each starting on one hub (round robin) with the others to fail over to."""

    def __init__(self, seeded: dict[str, Any], hub_urls: Sequence[str], rng: random.Random, *,
                 scale: float = 6.0, failure_rate: float = 0.05, concurrency: int = 2, record: bool = True) -> None:
        self.clients: list[ChaosClient] = []
        self.client_tenants: dict[str, int] = {}
        self._seeded = seeded
        self._hubs = list(hub_urls)
        self._rng = rng
        self._scale = scale
        self._failure_rate = failure_rate
        self._concurrency = concurrency
        self._record = record
        self._session: aiohttp.ClientSession | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        timings = TIMING_PROFILES["fast"].scaled(self._scale).with_jitter(0.3)
        platforms = {p["code"]: "healthy" for p in self._seeded["platforms"]}
        index = 0
        for tenant in self._seeded["tenants"]:
            for credentials in tenant["clients"]:
                first = index % len(self._hubs)
                hubs = self._hubs[first:] + self._hubs[:first]
                client = ChaosClient(SimOptions(
                    hub_url=hubs[0], hub_urls=tuple(hubs[1:]), token=credentials["token"], name=f"sim-{index}",
                    timings=timings, max_concurrent=self._concurrency, heartbeat_interval_s=0.5, idle_poll_s=1.0,
                    reconnect_max_s=1.0, failure_rate=self._failure_rate, seed=self._rng.randrange(2**32),
                    platform_health=platforms), session=self._session, record=self._record)
                self.clients.append(client)
                self.client_tenants[str(credentials["client_id"])] = int(tenant["tenant_id"])
                index += 1
        for client in self.clients:
            await client.start()
        self._watcher = asyncio.create_task(self._watch_connections())

    async def _watch_connections(self) -> None:
        """Each client's connected periods (to within the 0.1 s sampling): when a missed control was sent."""
        while True:
            now = time.time()
            for client in self.clients:
                periods = client.connected_periods
                is_open = bool(periods) and periods[-1][1] == math.inf
                if client.connected.is_set() and not is_open:
                    periods.append([now, math.inf])
                elif not client.connected.is_set() and is_open:
                    periods[-1][1] = now
            await asyncio.sleep(0.1)  # a sampling period, not a wait for a condition

    def all_connected(self) -> bool:
        return all(c.connected.is_set() for c in self.clients)

    def by_client_id(self) -> dict[str, ChaosClient]:
        return {c.client_id: c for c in self.clients if c.client_id is not None}

    @property
    def accepted_results(self) -> set[str]:
        return {r for c in self.clients for r in c.accepted_results}

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await asyncio.gather(*(c.stop() for c in self.clients), return_exceptions=True)
        if self._session is not None:
            await self._session.close()


# ---- the faults -----------------------------------------------------------------------------------------------

KILL_TARGETS = ("coordinator-leader", "outbox-pump", "dispatch-hub", "ingest-shard-workers", "projection-worker",
                "reconciler")
_SERVICE_OF = {"coordinator-leader": "dispatch-coordinator"}
# The other faults and their share of the random ones beyond the mandatory first round.
OTHER_FAULTS = {"broker_close": 0.08, "broker_partition": 0.07, "pg_terminate": 0.10}
MANDATORY = (*KILL_TARGETS, "broker_close", "broker_close", "broker_partition", "pg_terminate", "pg_terminate")


@dataclass
class Fault:
    at_s: float
    kind: str
    target: str
    detail: str = ""


class FaultInjector:
    """Draws a schedule (every fault kind at least once, then random ones) and injects it over `duration_s`: one
    fault every `mean_gap_s` on average. A killed replica comes back after 0.3-3 s; at most one replica of a
    service is down at a time (so one hub always takes the clients)."""

    def __init__(self, stack: ChaosStack, rng: random.Random) -> None:
        self.stack = stack
        self.rng = rng
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self._pending: set[asyncio.Task[None]] = set()
        self._started = time.monotonic()

    def schedule(self, count: int) -> list[str]:
        mandatory = list(MANDATORY)
        self.rng.shuffle(mandatory)
        kinds = [*KILL_TARGETS, *OTHER_FAULTS]
        kill_share = (1.0 - sum(OTHER_FAULTS.values())) / len(KILL_TARGETS)
        weights = [kill_share] * len(KILL_TARGETS) + list(OTHER_FAULTS.values())
        extra = self.rng.choices(kinds, weights=weights, k=max(0, count - len(mandatory)))
        return mandatory + extra

    def _elapsed(self) -> float:
        return round(time.monotonic() - self._started, 1)

    async def run(self, duration_s: float, *, mean_gap_s: float) -> None:
        self._started = time.monotonic()
        plan = self.schedule(max(len(MANDATORY), round(duration_s / mean_gap_s)))
        gap = duration_s / len(plan)
        for kind in plan:
            await asyncio.sleep(self.rng.uniform(0.3, 1.7) * gap)  # the fault schedule, not a wait
            if time.monotonic() - self._started >= duration_s:
                break
            try:
                await self.inject(kind)
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.errors.append(f"{self._elapsed()}s {kind}: {type(exc).__name__}: {exc}")
        await self.recover()

    async def recover(self) -> None:
        """Wait for every restart and healed partition still under way."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def inject(self, kind: str) -> None:
        if kind == "broker_close":
            closed = await self.stack.link.close_from_broker()
            self.faults.append(Fault(self._elapsed(), kind, "rabbitmq", f"{closed} connections closed by the broker"))
        elif kind == "broker_partition":
            pause = round(self.rng.uniform(0.5, 3.0), 1)
            self.faults.append(Fault(self._elapsed(), kind, "rabbitmq", f"every connection cut for {pause}s"))
            await self.stack.link.cut()
            self._spawn(self._heal(pause))
        elif kind == "pg_terminate":
            terminated = await self._terminate_backends()
            self.faults.append(Fault(self._elapsed(), kind, "postgres", f"{terminated} backends terminated"))
        else:
            await self._kill(kind)

    async def _heal(self, pause: float) -> None:
        await asyncio.sleep(pause)  # the partition's length, part of the fault
        await self.stack.link.restore()

    async def _terminate_backends(self) -> int:
        async with await psycopg.AsyncConnection.connect(self.stack.settings.database_url, autocommit=True,
                                                         application_name="chaos-injector") as conn:
            cur = await conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND NOT application_name = ANY(%s)", (list(HARNESS_APPLICATIONS),))
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def _victim(self, target: str) -> Replica | None:
        service = _SERVICE_OF.get(target, target)
        replicas = self.stack.of(service)
        if not all(r.up for r in replicas):
            return None  # one of its replicas is down already
        if target == "coordinator-leader":
            return await self.stack.leader(service) or self.rng.choice(replicas)
        if service == "dispatch-hub":
            sockets = [(await self.stack.metric(r, "desktop_websocket_connections"), r.index, r) for r in replicas]
            return max(sockets)[2]
        return self.rng.choice(replicas)

    async def _kill(self, target: str) -> None:
        victim = await self._victim(target)
        if victim is None:  # that service is recovering: another one instead
            others = [t for t in KILL_TARGETS if t != target]
            target = self.rng.choice(others)
            victim = await self._victim(target)
        if victim is None:
            return
        detail = ""
        if victim.service == "dispatch-hub":
            detail = f"{int(await self.stack.metric(victim, 'desktop_websocket_connections'))} sockets"
        elif victim.service in ("dispatch-coordinator", "reconciler"):
            leading = await self.stack.metric(victim, f'leader_is_active{{role="{victim.service}"}}') == 1.0
            detail = "leader" if leading else "standby"
        pause = round(self.rng.uniform(0.3, 3.0), 1)
        await self.stack.kill(victim)
        self.faults.append(Fault(self._elapsed(), "kill -9", victim.label,
                                 f"{detail + ', ' if detail else ''}restarted after {pause}s"))
        self._spawn(self._restart(victim, pause))

    async def _restart(self, victim: Replica, pause: float) -> None:
        await asyncio.sleep(pause)  # how long the replica stays dead, part of the fault
        try:
            await self.stack.restart(victim)
        except Exception as exc:
            self.errors.append(f"{victim.label} did not come back: ...{str(exc)[-2000:]}")  # the end: the reason

    def summary(self) -> dict[str, int]:
        return dict(sorted(Counter(f.kind if f.kind != "kill -9" else f"kill -9 {f.target.split('#')[0]}"
                                   for f in self.faults).items()))


# ---- settling -------------------------------------------------------------------------------------------------

IN_FLIGHT = """
SELECT
  (SELECT count(*) FROM monitoring_plans WHERE enabled AND next_run_at <= now()) AS due_plans,
  (SELECT count(*) FROM monitoring_collect_tasks WHERE status NOT IN ('completed', 'failed', 'skipped', 'expired'))
      AS open_business_tasks,
  (SELECT count(*) FROM desktop_tasks WHERE status IN ('queued', 'in_progress', 'unknown')) AS active_executions,
  (SELECT count(*) FROM legacy_leases WHERE status IN ('queued', 'in_progress')) AS live_legacy_leases,
  (SELECT count(*) FROM monitoring_collect_requests WHERE status IN ('accepted', 'dispatching', 'running'))
      AS open_requests,
  (SELECT count(*) FROM outbox WHERE status IN ('queued', 'running', 'retryable')) AS outbox_in_flight,
  (SELECT count(*) FROM projection_rebuild_queue) AS projection_requests
"""


async def in_flight(pool: AsyncConnectionPool[Conn]) -> dict[str, int]:
    async with pool.connection() as conn:
        cur = await conn.execute(IN_FLIGHT)
        row = await cur.fetchone()
    assert row is not None
    return {k: int(v) for k, v in row.items()}


async def settle(pool: AsyncConnectionPool[Conn], stack: ChaosStack, *, timeout: float) -> tuple[bool, float,
                                                                                                    dict[str, int]]:
    """Poll until nothing is in flight in the database and the broker's queues are empty (every replica up);
    (settled, seconds it took, the last reading)."""
    started = time.monotonic()
    last: dict[str, int] = {}
    while True:
        try:
            last = await in_flight(pool)
            if not any(last.values()) and all(r.up for r in stack.replicas):
                depths = await asyncio.to_thread(queue_depths, stack.settings.mq_prefix)
                last["queued_messages"] = sum(depths.values())
                if last["queued_messages"] == 0:
                    return True, round(time.monotonic() - started, 1), last
        except psycopg.Error:
            pass  # a connection the last fault broke: the pool replaces it
        if time.monotonic() - started >= timeout:
            return False, round(time.monotonic() - started, 1), last
        await asyncio.sleep(1.0)  # polling with a deadline


# ---- invariants -----------------------------------------------------------------------------------------------

# Timestamps are each transaction's now() (its start): a transaction that waited on a lock (a lease waiting for
# the client's lease lock, say) stamps a moment before the commit it waited for. Two intervals that overlap by
# less than this are such stamps, not two things at once.
STAMP_TOLERANCE_S = 0.25
# A published control counts as delivered up to this long after its publish (the hub's push, the socket).
DELIVERY_ALLOWANCE_S = 1.0


@dataclass
class Invariant:
    name: str
    checked: int
    violations: int
    note: str = ""
    examples: list[Any] = field(default_factory=list)


def excess_episodes(intervals: Iterable[tuple[float, float]], limit: int) -> list[tuple[float, float, int]]:
    """(start, duration, peak) of every stretch of time during which more than `limit` of the half-open
    intervals [start, end) were alive at once."""
    events = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s])
    live = 0
    episodes: list[tuple[float, float, int]] = []
    began: float | None = None
    peak = 0
    for at, delta in events:  # ends sort before starts at the same instant (-1 < 1)
        live += delta
        if live > limit and began is None:
            began, peak = at, live
        elif live > limit:
            peak = max(peak, live)
        elif began is not None:
            episodes.append((began, at - began, peak))
            began = None
    return episodes


async def _rows(pool: AsyncConnectionPool[Conn], query: str, params: dict[str, Any] | None = None) -> (
    list[dict[str, Any]]
):
    async with pool.connection() as conn:
        cur = await conn.execute(query, params or {})
        return [dict(r) for r in await cur.fetchall()]


async def check_results(pool: AsyncConnectionPool[Conn], accepted: set[str]) -> list[Invariant]:
    """Every 202 result in the ingest ledger (applied exactly once: the ledger's key is the result id), one run
    row per business key, holding the effective result (success priority over the ledger's apply order), with
    exactly its citations as facts."""
    ledger = await _rows(pool, """
        SELECT a.result_id::text AS result_id, a.seq, a.status, a.monitor_task_id,
               CASE WHEN EXISTS (SELECT 1 FROM legacy_leases l WHERE l.id = a.task_id) THEN 'legacy'
                    ELSE 'execution' END AS path
        FROM ingest_applied_results a ORDER BY a.seq""")
    applied = {r["result_id"] for r in ledger}
    applied_by_path = Counter(str(r["path"]) for r in ledger)
    missing = sorted(accepted - applied)
    effective: dict[int, dict[str, Any]] = {}
    for r in ledger:
        current = effective.get(r["monitor_task_id"])
        if incoming_wins(None if current is None else current["status"], r["status"]):
            effective[r["monitor_task_id"]] = r
    runs = await _rows(pool, """
        SELECT t.id AS monitor_task_id, r.id, r.result_id::text AS result_id, r.status, r.citation_count,
               (SELECT count(*) FROM monitoring_citation_facts f WHERE f.run_id = r.id) AS facts
        FROM question_monitor_runs r JOIN monitoring_collect_tasks t
          ON (t.tenant_id, t.brand_id, t.question_id, t.ai_platform_id, t.collector_type, t.run_mode,
              t.business_date)
           = (r.tenant_id, r.brand_id, r.question_id, r.ai_platform_id, r.collector_type, r.run_mode,
              r.business_date)""")
    runs_of: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        runs_of[run["monitor_task_id"]].append(run)
    not_one = [k for k in effective if len(runs_of.get(k, [])) != 1]
    orphans = [k for k in runs_of if k not in effective]
    wrong = [(k, runs_of[k][0]["result_id"], e["result_id"]) for k, e in effective.items()
             if len(runs_of.get(k, [])) == 1 and runs_of[k][0]["result_id"] != e["result_id"]]
    facts = [(r["id"], r["status"], r["citation_count"], r["facts"]) for r in runs
             if r["facts"] != (r["citation_count"] if r["status"] == "succeeded" else 0)]
    return [
        Invariant("results answered 202 applied to the raw facts exactly once", len(accepted), len(missing),
                  f"{len(applied)} results in the ingest ledger ({applied_by_path['execution']} of executions, "
                  f"{applied_by_path['legacy']} of legacy leases), {len(applied - accepted)} of them without a 202 "
                  "(the client gave up or the hub died after the publish)", missing[:5]),
        Invariant("one raw-fact run per business key with results", len(effective) + len(orphans),
                  len(not_one) + len(orphans), "", (not_one + orphans)[:5]),
        Invariant("each run holds the effective result (success priority, apply order)", len(effective),
                  len(wrong), "", wrong[:5]),
        Invariant("citation facts of each run = its citations", len(runs), len(facts), "", facts[:5]),
    ]


# Every run of a business task on either path, as [start, end) (an open one runs to now): the attempts of its
# desktop_tasks executions, and its legacy leases from the pull (the offer, if it was never pulled) to their end.
# An end stamped before its start (the ending transaction began before the one that started the run committed; see
# STAMP_TOLERANCE_S) spans the two stamps the other way round: a run that was there between them, never an error.
RUNS = """
SELECT path, id, monitor_task_id, least(s, coalesce(e, s)) AS s, CASE WHEN e < s THEN s ELSE e END AS e
FROM (SELECT 'execution' AS path, a.task_id::text || '#' || a.lease_epoch AS id, a.monitor_task_id,
             a.started_at AS s, a.finished_at AS e
      FROM desktop_task_attempts a
      UNION ALL
      SELECT 'legacy', l.id::text, l.monitor_task_id, coalesce(l.leased_at, l.created_at), l.finished_at
      FROM legacy_leases l) stamped
"""


async def check_double_execution(pool: AsyncConnectionPool[Conn]) -> Invariant:
    overlaps = await _rows(pool, f"""
        WITH runs AS MATERIALIZED ({RUNS})
        SELECT a.monitor_task_id, a.path || ' ' || a.id AS first, b.path || ' ' || b.id AS second,
               a.path <> b.path AS across_paths,
               extract(epoch FROM least(coalesce(a.e, clock_timestamp()), coalesce(b.e, clock_timestamp()))
                                - greatest(a.s, b.s))::float8 AS overlap_s
        FROM runs a
        JOIN runs b ON b.monitor_task_id = a.monitor_task_id AND (b.path, b.id) > (a.path, a.id)
        WHERE tstzrange(a.s, coalesce(a.e, 'infinity'), '[)') && tstzrange(b.s, coalesce(b.e, 'infinity'), '[)')""")
    tasks = await _rows(pool, f"""
        SELECT count(DISTINCT monitor_task_id) AS n,
               count(DISTINCT monitor_task_id) FILTER (WHERE path = 'execution') AS execution,
               count(DISTINCT monitor_task_id) FILTER (WHERE path = 'legacy') AS legacy
        FROM ({RUNS}) r""")
    real = [o for o in overlaps if o["overlap_s"] > STAMP_TOLERANCE_S]
    counts = tasks[0]
    return Invariant("no business task with two executions at once (attempts and legacy leases)",
                     int(counts["n"]), len(real),
                     f"{counts['execution']} tasks with executions, {counts['legacy']} with legacy leases; "
                     f"{len(overlaps)} overlaps in all ({sum(o['across_paths'] for o in overlaps)} across paths), "
                     f"the longest {max((o['overlap_s'] for o in overlaps), default=0):.3f}s", real[:5])


async def check_nothing_stuck(pool: AsyncConnectionPool[Conn], stack: ChaosStack) -> list[Invariant]:
    tasks = await _rows(pool, """
        SELECT t.id, t.status, t.execution_owner, t.dispatch_lane, t.dispatch_after <= now() AS due,
               EXISTS (SELECT 1 FROM desktop_tasks d WHERE d.monitor_task_id = t.id
                       AND d.status IN ('queued', 'in_progress', 'unknown'))
               OR EXISTS (SELECT 1 FROM legacy_leases l WHERE l.monitor_task_id = t.id
                          AND l.status IN ('queued', 'in_progress')) AS executing
        FROM monitoring_collect_tasks t""")
    open_tasks = [t for t in tasks if t["status"] not in TERMINAL_TASK]
    # Pending and dispatchable (due, nothing executing it on either path) is where the coordinator picks work up:
    # not stuck. A row still `leased` or `received` (the legacy path's lease on it) after settling is.
    stuck_tasks = [t for t in open_tasks if not (t["status"] == "pending" and t["due"] and not t["executing"])]
    by_status = dict(sorted(Counter(f"{t['execution_owner']} {t['status']}" for t in tasks).items()))
    requests = await _rows(pool, "SELECT id, status FROM monitoring_collect_requests")
    open_requests = [r for r in requests if r["status"] in OPEN_REQUEST]
    outbox = await _rows(pool, """
        SELECT status, count(*) AS n, count(*) FILTER (WHERE created_at < now() - interval '10 seconds') AS old
        FROM outbox GROUP BY status""")
    outbox_by = {r["status"]: r for r in outbox}
    stuck_outbox = sum(int(outbox_by[s]["old"]) for s in ("queued", "running", "retryable") if s in outbox_by)
    dead = int(outbox_by["dead_letter"]["n"]) if "dead_letter" in outbox_by else 0
    leases = await _rows(pool, """
        SELECT id, status, lease_expires_at FROM desktop_tasks
        WHERE (status = 'in_progress' AND lease_expires_at < now() - interval '5 seconds')
           OR (status = 'unknown' AND updated_at < now() - interval '30 seconds')""")
    executions = await _rows(pool, "SELECT count(*) AS n, count(*) FILTER (WHERE status IN ('queued', "
                                   "'in_progress', 'unknown')) AS active FROM desktop_tasks")
    legacy = await check_legacy_leases(pool)
    depths = await asyncio.to_thread(queue_stats, stack.settings.mq_prefix)
    consumers = await asyncio.to_thread(queue_consumers, stack.settings.mq_prefix)
    expected = work_queues(Topology(stack.settings.mq_prefix, stack.settings.ingest_shards))
    unconsumed = [q.removeprefix(stack.settings.mq_prefix) for q in expected if not consumers[q]]
    busy_queues = {name.removeprefix(stack.settings.mq_prefix): d for name, d in depths.items() if d.messages}
    return [
        Invariant("no business task stuck (terminal, or pending and dispatchable)", len(tasks), len(stuck_tasks),
                  f"{by_status}; {len(open_tasks)} not terminal", stuck_tasks[:5]),
        Invariant("no execution with an expired lease (or unknown) past the reconciler's grace",
                  int(executions[0]["n"]), len(leases), f"{executions[0]['active']} executions still active",
                  leases[:5]),
        *legacy,
        Invariant("every collect-now request ended", len(requests), len(open_requests), "", open_requests[:5]),
        Invariant("outbox: nothing queued, running or retryable for more than 10 s",
                  sum(int(r["n"]) for r in outbox), stuck_outbox,
                  ", ".join(f"{r['status']} {r['n']}" for r in outbox)),
        Invariant("outbox: no dead letters", sum(int(r["n"]) for r in outbox), dead),
        Invariant("broker: every queue of the run drained (dead-letter queues too)", len(depths),
                  sum(d.messages for d in busy_queues.values()), "", sorted(busy_queues.items())[:5]),
        Invariant("broker: every work queue has a consumer again (ingest shards, projection, lifecycle)",
                  len(expected), len(unconsumed), "", unconsumed[:5]),
        Invariant("no replica exited unless killed, none failed to start again", len(stack.replicas),
                  len(stack.crashes) + len(stack.failed_starts),
                  f"{len(stack.failed_starts)} failed starts (each retried)" if stack.failed_starts else "",
                  [(at, label, tail[-600:]) for at, label, tail in [*stack.crashes, *stack.failed_starts]][:3]),
    ]


async def check_legacy_leases(pool: AsyncConnectionPool[Conn]) -> list[Invariant]:
    """The legacy path's lease on the business row, after settling: no live lease and no row `leased` or
    `received`; no lease past its expiry beyond the reconciler's grace; the business row's lease columns set only
    while it holds its live lease (`legacy_lease_id` naming it, `leased_to_executor` its client), and every live
    lease named by its business row."""
    leases = await _rows(pool, """
        SELECT l.id, l.monitor_task_id, l.status, l.target_client_id, t.status AS business_status,
               t.legacy_lease_id, t.lease_expires_at
        FROM legacy_leases l JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id""")
    live = [r for r in leases if r["status"] in ("queued", "in_progress")]
    held = await _rows(pool, "SELECT id, status, legacy_lease_id FROM monitoring_collect_tasks "
                             "WHERE status IN ('leased', 'received')")
    expired = await _rows(pool, """
        SELECT t.id, t.status, t.legacy_lease_id, t.lease_expires_at FROM monitoring_collect_tasks t
        WHERE t.status = 'leased' AND t.lease_expires_at < now() - interval '5 seconds'""")
    inconsistent = await _rows(pool, """
        SELECT t.id, t.status, t.execution_owner, t.legacy_lease_id, t.leased_to_executor,
               t.lease_token_hash IS NOT NULL AS token, t.leased_at, t.lease_expires_at, l.status AS lease_status
        FROM monitoring_collect_tasks t LEFT JOIN legacy_leases l ON l.id = t.legacy_lease_id
        WHERE (t.legacy_lease_id IS NOT NULL OR t.leased_to_executor IS NOT NULL OR t.lease_token_hash IS NOT NULL
               OR t.leased_at IS NOT NULL OR t.lease_expires_at IS NOT NULL OR t.status IN ('leased', 'received'))
          AND NOT (t.status IN ('leased', 'received') AND t.execution_owner = 'legacy'
                   AND l.status IN ('queued', 'in_progress') AND l.monitor_task_id = t.id
                   AND t.leased_to_executor = l.target_client_id)
        UNION ALL
        SELECT t.id, t.status, t.execution_owner, t.legacy_lease_id, t.leased_to_executor,
               t.lease_token_hash IS NOT NULL, t.leased_at, t.lease_expires_at, l.status
        FROM legacy_leases l JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id
        WHERE l.status IN ('queued', 'in_progress') AND t.legacy_lease_id IS DISTINCT FROM l.id""")
    by_status = dict(sorted(Counter(str(r["status"]) for r in leases).items()))
    return [
        Invariant("legacy path: no live lease, no business row left leased or received", len(leases),
                  len(live) + len(held), f"leases {by_status}", [*live, *held][:5]),
        Invariant("legacy path: no lease past its expiry beyond the reconciler's grace (5 s)", len(leases),
                  len(expired), "", expired[:5]),
        Invariant("legacy path: lease columns only on a row holding its live lease, every live lease named",
                  len(leases), len(inconsistent), "", inconsistent[:5]),
    ]


async def check_paths(pool: AsyncConnectionPool[Conn], rollout: int) -> Invariant:
    """Each business task on the path the rollout gives its tenant (`rollout_percentage` does not change during the
    run, so every task the scanner or a click created, or a click re-collected, is routed by it), and each run on
    its task's path: executions only of desktop_tasks-owned tasks, legacy leases only of legacy-owned ones."""
    wrong = await _rows(pool, """
        SELECT 'task off its tenant''s path' AS problem, t.id AS monitor_task_id, t.tenant_id, t.execution_owner,
               NULL::text AS run
        FROM monitoring_collect_tasks t
        WHERE t.execution_owner <> CASE WHEN t.tenant_id %% 100 < %(rollout)s THEN 'desktop_tasks' ELSE 'legacy' END
        UNION ALL
        SELECT 'execution of a legacy-owned task', t.id, t.tenant_id, t.execution_owner, d.id::text
        FROM desktop_tasks d JOIN monitoring_collect_tasks t ON t.id = d.monitor_task_id
        WHERE t.execution_owner <> 'desktop_tasks'
        UNION ALL
        SELECT 'legacy lease of a desktop_tasks-owned task', t.id, t.tenant_id, t.execution_owner, l.id::text
        FROM legacy_leases l JOIN monitoring_collect_tasks t ON t.id = l.monitor_task_id
        WHERE t.execution_owner <> 'legacy'""", {"rollout": rollout})
    counts = await _rows(pool, "SELECT (SELECT count(*) FROM monitoring_collect_tasks) AS tasks, "
                               "(SELECT count(*) FROM desktop_tasks) + (SELECT count(*) FROM legacy_leases) AS runs")
    return Invariant(f"each task on its tenant's path (rollout {rollout}), each run on its task's path",
                     int(counts[0]["tasks"]) + int(counts[0]["runs"]), len(wrong), "", wrong[:5])


# What the services log when their own dual-path checks find something: the reconcile's repairs of the legacy path
# (libs/tasks/legacy.py's lease columns left behind, an accepted legacy result never applied) and the
# owner/execution mismatches the reconcile and the coordinator's start-up check alert on. None of it should ever
# be needed.
REPAIR_EVENTS = ("zombie lease cleared", "legacy lease ended: its accepted result was never applied")


def check_service_repairs(stack: ChaosStack) -> Invariant:
    found: list[tuple[str, str, Any]] = []
    lines = 0
    for replica in stack.replicas:
        for line in replica.proc.logs().splitlines():
            if '"event"' not in line:
                continue
            lines += 1
            try:
                event = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            name = str(event.get("event", "")) if isinstance(event, dict) else ""
            if name in REPAIR_EVENTS or name.startswith("ALERT:"):
                found.append((replica.label, name, event.get("monitor_task_id")))
    return Invariant("no dual-path repair or alert in any service's log (zombie leases, lost results, mismatches)",
                     lines, len(found), "", found[:5])


async def check_limits(pool: AsyncConnectionPool[Conn]) -> list[Invariant]:
    settings = {r["key"]: r["value"] for r in await _rows(pool, "SELECT key, value FROM dispatch_settings")}
    window = int(settings.get("budget_window_seconds", 60))
    cluster = int(settings.get("cluster_dispatch_per_minute", 300))
    tenant = int(settings.get("tenant_dispatch_per_minute", 30))
    reserve = float(settings.get("high_reserved_share", 0.10))
    non_high_cap = cluster - math.ceil(cluster * reserve)
    # Executions and legacy offers alike, by their created_at (as the coordinator counts them); refunded: collect-now
    # aborted it before it was ever leased (epoch 0).
    counts = await _rows(pool, """
        SELECT floor(extract(epoch FROM created_at) / %(w)s)::bigint AS window, tenant_id, lane = 'high' AS high,
               count(*) AS n, count(*) FILTER (WHERE path = 'legacy') AS legacy
        FROM (SELECT 'execution' AS path, kind, status, interrupt_reason, lease_epoch, created_at, tenant_id, lane
              FROM desktop_tasks
              UNION ALL
              SELECT 'legacy', kind, status, interrupt_reason, lease_epoch, created_at, tenant_id, lane
              FROM legacy_leases) w
        WHERE kind = 'monitor'
          AND NOT (status = 'aborted' AND coalesce(interrupt_reason, '') = 'collect_now_preempt' AND lease_epoch = 0)
        GROUP BY 1, 2, 3""", {"w": window})
    per_window: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in counts:
        per_window[int(r["window"])].append(r)
    over_cluster = [w for w, rs in per_window.items() if sum(r["n"] for r in rs) > cluster]
    over_non_high = [w for w, rs in per_window.items() if sum(r["n"] for r in rs if not r["high"]) > non_high_cap]
    over_tenant = [(r["window"], r["tenant_id"], r["n"]) for r in counts if not r["high"] and r["n"] > tenant]
    busiest = max((sum(r["n"] for r in rs) for rs in per_window.values()), default=0)
    busiest_tenant = max((r["n"] for r in counts if not r["high"]), default=0)
    windows_with_legacy = len({r["window"] for r in counts if r["legacy"]})
    budget_note = f"{sum(int(r['n']) for r in counts)} counted, {sum(int(r['legacy']) for r in counts)} legacy offers"

    # In progress on the client, on either path: from the lease (an execution's attempt, a legacy lease's pull)
    # until its result reached the hub or it ended.
    attempts = await _rows(pool, """
        SELECT 'execution' AS path, a.client_id, c.max_concurrent_monitor AS limit_,
               extract(epoch FROM a.started_at)::float8 AS s,
               extract(epoch FROM least(coalesce(a.finished_at, clock_timestamp()),
                   CASE WHEN d.lease_epoch = a.lease_epoch THEN d.result_received_at END))::float8 AS e
        FROM desktop_task_attempts a JOIN desktop_tasks d ON d.id = a.task_id
        JOIN desktop_clients c ON c.id = a.client_id
        UNION ALL
        SELECT 'legacy', l.target_client_id, c.max_concurrent_monitor, extract(epoch FROM l.leased_at)::float8,
               extract(epoch FROM least(coalesce(l.finished_at, clock_timestamp()), l.result_received_at))::float8
        FROM legacy_leases l JOIN desktop_clients c ON c.id = l.target_client_id
        WHERE l.leased_at IS NOT NULL""")
    by_client: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    client_limit: dict[Any, int] = {}
    for r in attempts:
        by_client[r["client_id"]].append((r["s"], r["e"]))
        client_limit[r["client_id"]] = int(r["limit_"])
    client_excess = {c: excess_episodes(iv, client_limit[c]) for c, iv in by_client.items()}
    client_over = [(str(c), ep) for c, eps in client_excess.items() for ep in eps if ep[1] > STAMP_TOLERANCE_S]
    client_peak = max((_peak(iv) for iv in by_client.values()), default=0)
    legacy_clients = {r["client_id"] for r in attempts if r["path"] == "legacy"}
    client_note = (f"highest {client_peak}, limit {max(client_limit.values(), default=0)}; "
                   f"{sum(r['path'] == 'legacy' for r in attempts)} of {len(attempts)} legacy leases, on "
                   f"{len(legacy_clients)} clients, highest there "
                   f"{max((_peak(by_client[c]) for c in legacy_clients), default=0)}")

    # Queued or in progress count against (tenant, platform) as the coordinator counts them, on either path; an
    # execution that turned `unknown` (a result the hub took that ingest had not applied within the grace) stops
    # counting then. A legacy lease counts from its offer until it ended (it has no `unknown`).
    grace = float(settings.get("unknown_grace_seconds", 120))
    executions = await _rows(pool, """
        SELECT 'execution' AS path, d.tenant_id, d.ai_platform_id, coalesce(s.max_concurrent, 1) AS limit_,
               extract(epoch FROM d.created_at)::float8 AS s,
               extract(epoch FROM least(coalesce(d.finished_at, clock_timestamp()),
                                        d.result_received_at + make_interval(secs => %(grace)s)))::float8 AS e
        FROM desktop_tasks d LEFT JOIN platform_settings s ON s.ai_platform_id = d.ai_platform_id
        WHERE d.kind = 'monitor'
        UNION ALL
        SELECT 'legacy', l.tenant_id, l.ai_platform_id, coalesce(s.max_concurrent, 1),
               extract(epoch FROM l.created_at)::float8,
               extract(epoch FROM coalesce(l.finished_at, clock_timestamp()))::float8
        FROM legacy_leases l LEFT JOIN platform_settings s ON s.ai_platform_id = l.ai_platform_id
        WHERE l.kind = 'monitor'""", {"grace": grace})
    by_pair: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    pair_limit: dict[tuple[int, int], int] = {}
    for r in executions:
        by_pair[(r["tenant_id"], r["ai_platform_id"])].append((r["s"], r["e"]))
        pair_limit[(r["tenant_id"], r["ai_platform_id"])] = int(r["limit_"])
    pair_over = [(pair, ep) for pair, iv in by_pair.items() for ep in excess_episodes(iv, pair_limit[pair])
                 if ep[1] > STAMP_TOLERANCE_S]
    pair_peak = max((_peak(iv) for iv in by_pair.values()), default=0)
    legacy_pairs = {(r["tenant_id"], r["ai_platform_id"]) for r in executions if r["path"] == "legacy"}
    legacy_pair_peak = max((_peak(by_pair[k]) for k in legacy_pairs), default=0)
    pair_note = (f"highest {pair_peak}, limit {max(pair_limit.values(), default=0)}; "
                 f"{sum(r['path'] == 'legacy' for r in executions)} of {len(executions)} legacy, on "
                 f"{len(legacy_pairs)} pairs, highest there {legacy_pair_peak}")
    return [
        Invariant(f"cluster budget per {window}s window (<= {cluster}), both paths", len(per_window),
                  len(over_cluster), f"busiest window {busiest}; {budget_note}, in {windows_with_legacy} windows",
                  over_cluster[:5]),
        Invariant(f"non-high work per window (<= {non_high_cap}, the high reserve kept)", len(per_window),
                  len(over_non_high), "", over_non_high[:5]),
        Invariant(f"tenant budget per window, non-high (<= {tenant})", len(counts), len(over_tenant),
                  f"busiest tenant window {busiest_tenant}", over_tenant[:5]),
        Invariant("client concurrency (in progress <= max_concurrent_monitor at every instant)", len(by_client),
                  len(client_over), client_note, client_over[:5]),
        Invariant("platform concurrency per (tenant, platform) (active <= max_concurrent)", len(by_pair),
                  len(pair_over), pair_note, pair_over[:5]),
    ]


def _peak(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s])
    live = best = 0
    for _, delta in events:
        live += delta
        best = max(best, live)
    return best


async def check_controls(pool: AsyncConnectionPool[Conn], fleet: Fleet) -> Invariant:
    """Every task_control the outbox published reached its client over the WebSocket (live or in the replay of a
    reconnect), unless it no longer applied: the client was not holding that execution any more when it could
    have arrived (it never leased it, or had already posted its result or cancel), or it was sent while the
    client had no socket (dropped, its hub killed) and the client learnt the same from the lease fence (its next
    call on the execution refused) or, for an interrupt, the execution was over before the client was connected
    again. A control lost while the client's socket was up (a hub's broker link down, say) is always a miss."""
    rows = await _rows(pool, """
        SELECT payload, extract(epoch FROM published_at)::float8 AS published
        FROM outbox WHERE message_type = 'task_control' AND status = 'published' ORDER BY id""")
    clients = fleet.by_client_id()
    # The task_id of a control is an execution's id or a legacy lease's: either ends with its finished_at.
    ends = await _rows(pool, """
        SELECT id, 'execution' AS path, extract(epoch FROM finished_at)::float8 AS finished FROM desktop_tasks
        UNION ALL SELECT id, 'legacy', extract(epoch FROM finished_at)::float8 FROM legacy_leases""")
    ended = {str(r["id"]): r["finished"] for r in ends}
    path_of = {str(r["id"]): str(r["path"]) for r in ends}
    per_path: Counter[str] = Counter()
    received: dict[tuple[str, str], set[str]] = defaultdict(set)
    for sim in clients.values():
        for _, event in sim.received:
            if event.get("type") == "task_control":
                received[(sim.client_id or "", str(event["task_id"]))].add(str(event["control"]))
    outcome: Counter[str] = Counter()
    missed: list[dict[str, Any]] = []
    for row in rows:
        control = msgspec.json.decode(bytes(row["payload"]))
        client_id, task_id, kind = str(control["target_client_id"]), str(control["task_id"]), control["control"]
        per_path[f"{path_of.get(task_id, 'unknown task')} {kind}"] += 1
        client = clients.get(client_id)
        if client is None:
            outcome["to a client outside the fleet"] += 1
            continue
        if kind in received.get((client_id, task_id), set()):
            outcome["delivered"] += 1
            continue
        published = float(row["published"])
        held = client.held.get(task_id)
        if held is None or not held[0] <= published + DELIVERY_ALLOWANCE_S < held[1]:
            outcome["no longer applied (not held by the client then)"] += 1
            continue
        path_down = not (client.was_connected(published)
                         and client.was_connected(published + DELIVERY_ALLOWANCE_S))
        over = ended.get(task_id)
        reconnected = [s for s, _ in client.connected_periods if s > published]
        if path_down and kind != "interrupt_requested" and task_id in client.fenced:
            outcome["lost while the way was down; the lease fence told the client"] += 1
            continue
        if path_down and kind == "interrupt_requested" and over is not None and (
                not reconnected or over <= reconnected[0]):
            outcome["interrupt lost while the way was down; the execution was over before the reconnect"] += 1
            continue
        outcome["missed"] += 1
        missed.append({"client": client_id, "task": task_id, "path": path_of.get(task_id), "control": kind,
                       "reason": control.get("reason"),
                       "published": published, "held": held, "path_down": path_down,
                       "fenced": client.fenced.get(task_id)})
    return Invariant("every client got every task_control that applied to it (both paths)", len(rows), len(missed),
                     "; ".join(f"{k} {v}" for k, v in sorted(outcome.items()))
                     + " | by path: " + ", ".join(f"{k} {v}" for k, v in sorted(per_path.items())), missed[:5])


async def check_projections(pool: AsyncConnectionPool[Conn]) -> Invariant:
    keys = await _rows(pool, """
        SELECT DISTINCT tenant_id, brand_id, business_date FROM question_monitor_runs
        UNION SELECT tenant_id, brand_id, business_date FROM monitoring_brand_daily""")
    differ = []
    for key in keys:
        expected = as_rows(await recomputed_from_facts(pool, key["tenant_id"], key["brand_id"], key["business_date"]))
        actual = await stored(pool, key["tenant_id"], key["brand_id"], key["business_date"])
        if actual != expected:
            differ.append({"key": key, "stored": actual, "recomputed": expected})
    return Invariant("projections = a from-scratch recomputation over the raw facts", len(keys), len(differ), "",
                     differ[:3])


async def check_all(pool: AsyncConnectionPool[Conn], stack: ChaosStack, fleet: Fleet, *,
                    rollout: int = 100) -> list[Invariant]:
    return [*await check_results(pool, fleet.accepted_results), await check_double_execution(pool),
            await check_paths(pool, rollout), *await check_nothing_stuck(pool, stack), check_service_repairs(stack),
            *await check_limits(pool), await check_controls(pool, fleet), await check_projections(pool)]


# ---- the report -----------------------------------------------------------------------------------------------

async def path_summary(pool: AsyncConnectionPool[Conn]) -> dict[str, dict[str, int]]:
    """Per execution path: business tasks (and how many completed), runs (executions or legacy leases) and results
    applied: what a reader checks to see that both paths were exercised."""
    rows = await _rows(pool, """
        SELECT t.execution_owner AS path, count(*) AS business_tasks,
               count(*) FILTER (WHERE t.status = 'completed') AS completed,
               count(DISTINCT t.tenant_id) AS tenants,
               (SELECT count(*) FROM desktop_tasks d JOIN monitoring_collect_tasks b ON b.id = d.monitor_task_id
                WHERE b.execution_owner = t.execution_owner) AS executions,
               (SELECT count(*) FROM legacy_leases l JOIN monitoring_collect_tasks b ON b.id = l.monitor_task_id
                WHERE b.execution_owner = t.execution_owner) AS legacy_leases,
               (SELECT count(*) FROM ingest_applied_results a JOIN monitoring_collect_tasks b
                  ON b.id = a.monitor_task_id WHERE b.execution_owner = t.execution_owner) AS results_applied
        FROM monitoring_collect_tasks t GROUP BY 1 ORDER BY 1""")
    return {str(r.pop("path")): {k: int(v) for k, v in r.items()} for r in rows}


async def work_summary(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    tasks = await _rows(pool, "SELECT status, count(*) AS n FROM monitoring_collect_tasks GROUP BY 1 ORDER BY 1")
    attempts = await _rows(pool, "SELECT status, coalesce(abort_reason, '') AS reason, count(*) AS n "
                                 "FROM desktop_task_attempts GROUP BY 1, 2 ORDER BY 1, 2")
    lanes = await _rows(pool, "SELECT lane, count(*) AS n FROM desktop_tasks GROUP BY 1 ORDER BY 1")
    leases = await _rows(pool, "SELECT status, coalesce(interrupt_reason, '') AS reason, count(*) AS n "
                               "FROM legacy_leases GROUP BY 1, 2 ORDER BY 1, 2")
    lease_lanes = await _rows(pool, "SELECT lane, count(*) AS n FROM legacy_leases GROUP BY 1 ORDER BY 1")
    delays = await _rows(pool, """
        SELECT percentile_disc(ARRAY[0.5, 0.9, 0.99, 1.0]) WITHIN GROUP (ORDER BY s) AS p
        FROM (SELECT extract(epoch FROM l.applied_at - r.result_received_at)::float8 AS s
              FROM ingest_applied_results l
              JOIN (SELECT id, result_received_at FROM desktop_tasks
                    UNION ALL SELECT id, result_received_at FROM legacy_leases) r ON r.id = l.task_id
              WHERE r.result_received_at IS NOT NULL) x""")
    p = delays[0]["p"] or []
    return {"tasks per path": await path_summary(pool),
            "business tasks": {r["status"]: r["n"] for r in tasks},
            "executions by lane": {r["lane"]: r["n"] for r in lanes},
            "attempts": {f"{r['status']}{'/' + r['reason'] if r['reason'] else ''}": r["n"] for r in attempts},
            "legacy leases by lane": {r["lane"]: r["n"] for r in lease_lanes},
            "legacy leases": {f"{r['status']}{'/' + r['reason'] if r['reason'] else ''}": r["n"] for r in leases},
            "result accepted -> raw facts (s)": dict(zip(("p50", "p90", "p99", "max"),
                                                         (round(v, 2) for v in p), strict=False))}


def format_report(*, seed: int, fault_seconds: float, faults: Sequence[Fault], fault_errors: Sequence[str],
                  clicks: dict[str, int], work: dict[str, Any], settled: tuple[bool, float, dict[str, int]],
                  invariants: Sequence[Invariant], results_202: int) -> str:
    lines = [f"service chaos: seed {seed}, {fault_seconds:.0f}s of faults, {len(faults)} faults injected"]
    kinds = Counter(f.kind if f.kind != "kill -9" else f"kill -9 {f.target.split('#')[0]}" for f in faults)
    lines.append("  " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
    lines += [f"  +{f.at_s:7.1f}s  {f.kind:<16} {f.target:<24} {f.detail}" for f in faults]
    lines += [f"  fault not injected: {e}" for e in fault_errors]
    lines.append(f"collect-now clicks by status: {clicks}; results answered 202: {results_202}")
    for key, value in work.items():
        lines.append(f"{key}: {value}")
    ok, seconds, last = settled
    lines.append(f"settled: {ok} after {seconds}s ({last})")
    width = max([82, *(len(inv.name) for inv in invariants)])
    lines.append(f"{'invariant':<{width}} {'checked':>8} {'violations':>10}")
    for inv in invariants:
        lines.append(f"{inv.name:<{width}} {inv.checked:>8} {inv.violations:>10}"
                     + (f"  ({inv.note})" if inv.note else ""))
        for example in inv.examples if inv.violations else []:
            lines.append(f"      e.g. {example}")
    return "\n".join(lines)

