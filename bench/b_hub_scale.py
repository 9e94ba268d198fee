"""One dispatch-hub holding a whole fleet: 10,000 WebSocket desktops by default (`--clients N`; `--quick`: 1,000).

Real service processes (outbox-pump, dispatch-coordinator, dispatch-hub, collect-now-api, ingest-shard-workers,
as in `bench collect_now`) and the fleet in several client processes (`bench/hub_scale_client.py`, 2,000 lean
clients each: authenticate, hello + replay, heartbeat at the hub's interval). Every seeded client has one queued
execution, so every (re)connect carries a replay. Measured, in this order:

1. connect: every client at once, until each has its hello and replay; hub RSS before and after (per connection);
2. fan-out: one `task_available` per client published straight to the dispatch exchange as the outbox relay would
   (one `dispatch_batch` envelope per hub per relay batch; HUB_SCALE_FANOUT=single|both), until all arrived;
3. probe: click (POST collect-now) -> high `task_available` on one more client's socket, with the fleet connected
   and heartbeating (collect-now-api -> coordinator -> broker -> hub: the `bench collect_now` path), and each click
   hop by hop (bench/hub_hops.py: the 202, the coordinator's high pass start and commit from its "high pass
   committed" log line, the outbox row's publish, a broker tap queue of the benchmark's own, the socket, the
   lease), p50 / p99 per hop, with the fleet's event-loop lag (`lag`: a starved fleet stamps arrivals late) and the
   dispatch passes meanwhile. The probe reconnects after a reset or lost socket (a connect storm on this box) and
   counts them;
4. reconnect storm: the hub is killed (SIGKILL) and started again; until every client has its new hello and replay.

With `--hubs N` the fleet is spread over N hub replicas by a simulated load balancer (bench/hub_scale_client.py:
desktop i to hub i % N first, a random other hub after a refusal or a drain), and it also measures
- intake per hub: how many of the fan-out's dispatch events each hub's queue took, against its share of sockets
  (targeted delivery: each hub should take only its own clients' events);
- rolling restart: each hub in turn SIGTERM'd (it drains: 4503 with a jittered reconnect delay), started again,
  until every client is back with its replay: the time per hub, the hub's exit time, and the events lost among
  task_available events written through the outbox for random fleet clients meanwhile (each must reach its
  client, live or in a replay);
- the leader's (dispatch-coordinator's) CPU in each phase: the connect and each drain are storms of
  client.online / client.offline events.

All clients share 127.0.0.1, so the hub runs with HUB_UPGRADE_BURST_PER_ADDRESS and
HUB_UPGRADES_PER_ADDRESS_PER_S far above the fleet (the per-address bucket would otherwise refuse the storm); the
per-client limits stay at their defaults. The soft file-descriptor limit is raised to the hard one, for this
process and the children (hub, clients) it starts.

    .venv/bin/python -m bench hub_scale [--clients 10000] [--hubs 1] [--quick]
    HUB_SCALE_PROFILE=/tmp/prof .venv/bin/python -m bench hub_scale   (py-spy, when installed, samples the hub in
                                                                       each phase; the hottest frames are printed)
    HUB_SCALE_PHASES=fan-out,probe,storm,rolling (the default: all of them; connect always runs first)
    HUB_SCALE_FANOUT=batch|single|both (the fan-out's rounds: dispatch batches, one message per event, alternating)
    HUB_SCALE_WAITS=1   (with the per-hop table: each hop's part of the clicks' time, largest first, and the slowest
                         clicks hop by hop)
    HUB_SCALE_FLEET_NICE=N   (the fleet's processes under `nice -n N`: `fleet_nice`)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import msgspec
from aiormq.abc import ChannelFrame
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from bench import hub_hops
from bench.b_collect_now import _hub_hop as collect_now_hub_hop
from bench.b_collect_now import open_limits_for_probe
from bench.common import bench_environment, percentile, summary
from libs.auth import hash_token, new_client_token
from libs.config import Settings
from libs.contracts.amqp import DISPATCH_BATCH
from libs.contracts.wire import TaskAvailable
from libs.db.pool import connect
from libs.demo import seed_demo
from libs.domain.lanes import lane_spec
from libs.mq.hub_routing import hub_routing_key
from libs.mq.topology import DISPATCH, Topology
from libs.outbox import dispatch_batches
from libs.outbox.relay import ClaimedEvent
from libs.outbox.writer import enqueue
from services.dispatch_hub.envelope import unwrap
from services.dispatch_hub.logic import sockets_to_shed
from tests.support.procs import ServiceProcess, die_with_parent, service_env
from tests.support.stack import DISPATCH_SERVICES, Stack, running_stack

JWT_SECRET = "bench-hub-scale-gateway-secret-0123456789"
CLIENTS_PER_PROCESS = 2000
CLIENTS_PER_TENANT = 100
CONNECT_DEADLINE_S = 300.0
FANOUT_DEADLINE_S = 30.0
FANOUT_ROUNDS = 3
STORM_DEADLINE_S = 120.0

_TENANTS = "INSERT INTO tenants (name, time_zone) SELECT 'scale-' || g, 'UTC' FROM generate_series(1, %(n)s) g " \
           "RETURNING id"
_CLIENTS_COPY = "COPY desktop_clients (id, tenant_id, workspace_id, user_id, name, token_hash) FROM STDIN"
# One queued execution per fleet client (a publish task: it needs no business task), so that every hello
# is followed by a replay.
_REPLAY_TASKS = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
                           source)
SELECT gen_random_uuid(), 'publish', c.tenant_id, c.workspace_id, c.id, 'queued', %(priority)s, 'normal',
       %(weight)s, 'publish'
FROM desktop_clients c WHERE c.tenant_id = ANY(%(tenants)s)
"""

# One more queued publish execution for one fleet client, with its task_available through the outbox (the rolling
# restart's "events lost": each must reach its client, live or in the replay of its next connect).
_ONE_TASK = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
                           source)
SELECT %(id)s, 'publish', c.tenant_id, c.workspace_id, c.id, 'queued', %(priority)s, 'normal', %(weight)s, 'publish'
FROM desktop_clients c WHERE c.id = %(client)s
RETURNING tenant_id
"""
ROLLING_EVENT_EVERY_S = 0.25
# Clicks made while the fleet connects (a storm of client.online on the hub and the leader) or reconnects, on
# questions of their own (a click on a question clicked already is an idempotent replay, with no new task).
STORM_CLICKS = 30  # each storm (the connect, the reconnect after a kill) clicks its own questions
ROLL_DEADLINE_S = 120.0


@dataclass(frozen=True, slots=True)
class World:
    fleet: list[tuple[str, str]]  # (client_id, token)
    probe: dict[str, Any]  # a seed_demo tenant with one client and `clicks` questions


async def _prepare(settings: Settings, *, fleet: int, clicks: int) -> World:
    conn = await connect(settings.database_url)
    try:
        probe = await seed_demo(conn, tenants=1, brands=1, questions=clicks + 2 * STORM_CLICKS, clients=1,
                                platforms=("openai",),
                                due=False)
        cur = await conn.execute(_TENANTS, {"n": math.ceil(fleet / CLIENTS_PER_TENANT)})
        tenants = [int(r["id"]) for r in await cur.fetchall()]
        clients = []
        async with conn.cursor().copy(_CLIENTS_COPY) as copy:
            for i in range(fleet):
                client_id, token, tenant = uuid.uuid4(), new_client_token(), tenants[i // CLIENTS_PER_TENANT]
                await copy.write_row((client_id, tenant, tenant, tenant, f"scale-{i}", hash_token(token)))
                clients.append((str(client_id), token))
        spec = lane_spec("publish", "normal")
        await conn.execute(_REPLAY_TASKS, {"priority": spec.default_priority, "weight": spec.weight,
                                           "tenants": tenants})
        await open_limits_for_probe(conn, probe["tenants"][0]["tenant_id"])
    finally:
        await conn.close()
    return World(fleet=clients, probe=probe["tenants"][0])


# ---- the fleet's processes ------------------------------------------------------------------------


def fleet_nice() -> list[str]:
    """`nice -n N` before the fleet's command when HUB_SCALE_FLEET_NICE=N (else nothing): on this benchmark's two
    cores the fleet's processes (10,000 sockets' frames, heartbeats, pongs) compete with the services for CPU, which
    desktops on their own machines never do; niced, the kernel runs the services first and the fleet takes the idle
    cycles, so a probe's latency is the services' own (the `lag` command tells when the fleet itself runs late)."""
    n = os.environ.get("HUB_SCALE_FLEET_NICE", "").strip()
    return ["nice", "-n", str(int(n))] if n else []


class ClientProcess:
    """One `bench.hub_scale_client` process: JSON-line commands in, answers out."""

    def __init__(self, proc: asyncio.subprocess.Process, size: int) -> None:
        self.proc = proc
        self.size = size

    @classmethod
    async def start(cls, hubs: list[str], tokens: list[str], folder: Path, index: int, offset: int) -> ClientProcess:
        config = folder / f"fleet-{index}.json"
        config.write_text(json.dumps({"hubs": hubs, "tokens": tokens, "offset": offset}))
        proc = await asyncio.create_subprocess_exec(
            *fleet_nice(), sys.executable, "-m", "bench.hub_scale_client", str(config), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 24, preexec_fn=die_with_parent)
        client = cls(proc, len(tokens))
        await client.read()  # {"started": n}
        return client

    async def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"a fleet process exited with {self.proc.returncode}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        await self.proc.stdin.drain()
        return await self.read()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ask(cmd="stop"), 30)
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 10)
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def _status(fleet: list[ClientProcess], since: float) -> dict[str, Any]:
    answers = await asyncio.gather(*(p.ask(cmd="status", since=since) for p in fleet))
    errors: dict[str, int] = {}
    for a in answers:
        for key, n in a["errors"].items():
            errors[key] = errors.get(key, 0) + n
    return {"ready": sum(a["ready"] for a in answers), "last_ready": max(a["last_ready"] for a in answers),
            "open": sum(a["open"] for a in answers), "hellos": sum(a["hellos"] for a in answers), "errors": errors,
            "drained": sum(a.get("drained", 0) for a in answers)}


async def _until_ready(fleet: list[ClientProcess], *, since: float, deadline_s: float,
                       stack: Stack, label: str, shown_from: float | None = None) -> tuple[dict[str, Any], bool]:
    """Poll the fleet until every client's current socket had its hello and replay after `since`."""
    total = sum(p.size for p in fleet)
    deadline = time.monotonic() + deadline_s
    status: dict[str, Any] = {}
    next_note = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = await _status(fleet, since)
        if status["ready"] >= total:
            return status, True
        if time.monotonic() >= next_note:
            next_note += 10
            elapsed = time.time() - (shown_from or since)
            print(f"    {label}: {status['ready']}/{total} ready after {elapsed:.0f} s; hub RSS "
                  f"{_rss_mib(stack):.0f} MiB; handshake failures so far {status['errors']}", flush=True)
        await asyncio.sleep(0.1)  # polling the fleet's processes with a deadline
    return status, False


# ---- the hub process ------------------------------------------------------------------------------


def _hubs(stack: Stack) -> list[ServiceProcess]:
    """The hub replicas: `dispatch-hub` and the extra ones (`dispatch-hub-2`, ...)."""
    return [proc for name, proc in stack.procs.items() if name.startswith("dispatch-hub")]


def _hub_pid(stack: Stack, hub: ServiceProcess | None = None) -> int:
    """The pid of `hub`, the first hub by default."""
    proc = (hub or stack.procs["dispatch-hub"]).proc
    assert proc is not None
    return proc.pid


def _pid_rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib(stack: Stack) -> float:
    """The hubs' RSS together."""
    return sum(_pid_rss_mib(h.proc.pid) for h in _hubs(stack) if h.proc is not None)


def _cpu_s(stack: Stack) -> float:
    """The hubs' CPU time so far (user + system, together), seconds."""
    return sum(_pid_cpu_s(h.proc.pid) for h in _hubs(stack) if h.proc is not None)


def _pid_cpu_s(pid: int) -> float:
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def _others_cpu_s(stack: Stack, fleet: list[ClientProcess]) -> dict[str, float]:
    """CPU seconds so far of the fleet's processes (together) and of the other services."""
    times = {"fleet": sum(_pid_cpu_s(p.proc.pid) for p in fleet)}
    for name, service in stack.procs.items():
        if not name.startswith("dispatch-hub") and service.proc is not None:
            times[name] = _pid_cpu_s(service.proc.pid)
    return times


async def _leader(stack: Stack) -> tuple[float, float]:
    """The coordinator's CPU seconds and dispatch passes so far."""
    proc = stack.procs["dispatch-coordinator"].proc
    assert proc is not None
    return _pid_cpu_s(proc.pid), await stack.metric("dispatch-coordinator", "dispatch_pass_duration_ms_count")


def _leader_note(before: tuple[float, float], after: tuple[float, float], seconds: float) -> str:
    cpu, passes = after[0] - before[0], after[1] - before[1]
    share = cpu / max(seconds, 1e-9) * 100
    return f"leader (coordinator) {cpu:.1f} s CPU ({share:.0f}% of a core), {passes:.0f} passes"


def _cpu_note(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{name} {after[name] - before.get(name, 0.0):.1f} s" for name in after)


class Profile:
    """`py-spy record` on a hub (the first by default) for one phase, when HUB_SCALE_PROFILE names a folder (py-spy
    is not a dependency of the project: `pip install py-spy` to profile)."""

    def __init__(self, stack: Stack, phase: str, hub: ServiceProcess | None = None) -> None:
        self.folder = os.environ.get("HUB_SCALE_PROFILE", "")
        self.stack, self.phase, self.hub = stack, phase, hub
        self.proc: asyncio.subprocess.Process | None = None
        if self.folder:
            os.makedirs(self.folder, exist_ok=True)

    async def __aenter__(self) -> Profile:
        spy = Path(sys.executable).with_name("py-spy")
        if self.folder and spy.exists():
            self.proc = await asyncio.create_subprocess_exec(
                str(spy), "record", "--pid", str(_hub_pid(self.stack, self.hub)),
                "--format", "raw", "--rate", "100",
                "--nonblocking", "-o", str(Path(self.folder) / f"{self.phase}.raw"), stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 30)
        print(f"    profile ({self.phase}): " + "; ".join(_hottest(Path(self.folder) / f"{self.phase}.raw", 12)),
              flush=True)


def _hottest(raw: Path, n: int) -> list[str]:
    """The frames most often on the stack (inclusive), from py-spy's collapsed stacks, skipping the entry points."""
    inclusive: dict[str, int] = {}
    total = 0
    for line in (raw.read_text() if raw.exists() else "").splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        for frame in set(stack.split(";")):
            inclusive[frame] = inclusive.get(frame, 0) + int(count)
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])
    return [f"{c / total * 100:.0f}% {f}" for f, c in ranked if c < total * 0.9][:n]


def _listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full (the whole machine)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        lines = Path("/proc/net/netstat").read_text().splitlines()
        names, values = lines[0].split(), lines[1].split()
        return int(values[names.index("ListenOverflows")])
    return 0


def _load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _hub_errors(stack: Stack) -> tuple[list[str], list[str]]:
    """The distinct errors and warnings the hubs logged (with the exception's last line), most frequent first; the
    first traceback of each follows its line. Beside them, the garbage collections that held a hub's loop, the
    longest first (hub, generation, pause), and the full collections it ran while calm."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    pauses: list[tuple[float, str]] = []
    calm: list[str] = []
    for name, hub in stack.procs.items():
        if not name.startswith("dispatch-hub"):
            continue
        for line in hub.logs().splitlines():
            if '"full garbage collection while calm"' in line:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    calm.append(f"{name} {record['pause_ms']} ms freed {record['freed']}")
            if '"level": "error"' not in line and '"level": "warning"' not in line:
                continue
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if "pause_ms" in record:
                    pauses.append((float(record["pause_ms"]),
                                   f"{name} gen {record.get('generation')} (CPU {record.get('cpu_ms')} ms, "
                                   f"freed {record.get('collected')})"))
                exc = str(record.get("exc") or "").strip().splitlines()
                key = f"{record.get('level')}: {record.get('event')}{': ' + exc[-1] if exc else ''}"
                counts[key] = counts.get(key, 0) + 1
                first.setdefault(key, "\n".join(f"      {line}" for line in exc[-12:]))
    kinds = [f"{n}x {key}\n{first[key]}" for key, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    collections = []
    if pauses:
        collections.append("garbage collections over 100 ms: " + ", ".join(
            f"{where}: {ms:.0f} ms" for ms, where in sorted(pauses, reverse=True)[:12]))
    if calm:
        collections.append("full collections while calm: " + "; ".join(calm))
    return kinds, collections


# ---- phases ---------------------------------------------------------------------------------------


async def _hub_metric(hub: ServiceProcess, sample: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(hub.url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


async def _per_hub(stack: Stack, sample: str) -> list[float]:
    return list(await asyncio.gather(*(_hub_metric(h, sample) for h in _hubs(stack))))


async def _routed_keys(settings: Settings, clients: list[tuple[str, str]]) -> dict[str, str]:
    """Each client's `monitor.normal.<client>` as the outbox relay would publish it (towards its hub)."""
    conn = await connect(settings.database_url)
    try:
        cur = await conn.execute("SELECT id::text AS id, connected_hub FROM desktop_clients WHERE id = ANY(%s)",
                                 ([uuid.UUID(c) for c, _ in clients],))
        hubs = {r["id"]: r["connected_hub"] for r in await cur.fetchall()}
    finally:
        await conn.close()
    return {c: (hub_routing_key(hubs[c], f"monitor.normal.{c}") if hubs.get(c) else f"monitor.normal.{c}")
            for c, _ in clients}


def _fan_out_frames(topology: Topology, clients: list[tuple[str, str]], keys: dict[str, str], marker: uuid.UUID,
                    relay_batch: int, max_content: int) -> list[Any]:
    """The broker messages the outbox relay would publish for one `task_available` per client: the rows in relay
    batches of `relay_batch` (the pump's `OUTBOX_BATCH_SIZE`), each batch's events towards one hub packed into
    `dispatch_batch` envelopes by the relay's own functions (libs/outbox/dispatch_batches.py), the rest alone."""
    now = datetime.now(UTC)
    events = []
    for n, (client_id, _) in enumerate(clients, start=1):
        body = msgspec.json.encode(TaskAvailable(
            kind="monitor", task_id=marker, target_client_id=uuid.UUID(client_id), priority=100, lane="normal",
            updated_at=now))
        events.append(ClaimedEvent(id=n, event_id=uuid.uuid4(), exchange=DISPATCH, routing_key=keys[client_id],
                                   message_type="task_available", payload=body, headers={},
                                   ordering_key=f"client:{client_id}", tenant_id=None, traceparent=None, attempts=1,
                                   max_attempts=10, created_at=now))
    messages: list[tuple[str, str, bytes]] = []  # (routing key, AMQP type, body)
    for start in range(0, len(events), relay_batch):
        packed = dispatch_batches.plan([[e] for e in events[start:start + relay_batch]],
                                       dispatch_exchange=DISPATCH, valid=lambda _: True)
        messages += [(e.routing_key, e.message_type, e.payload) for run in packed.single for e in run]
        for hub, hub_events in packed.by_hub.items():
            messages += [(env.routing_key, DISPATCH_BATCH, env.body) for env in dispatch_batches.pack(hub, hub_events)]
    frames: list[Any] = []
    for key, kind, body in messages:
        frames += [spec.Basic.Publish(exchange=topology.dispatch_exchange, routing_key=key),
                   ContentHeader(properties=spec.Basic.Properties(delivery_mode=1, message_type=kind),
                                 body_size=len(body)),
                   # A body above the connection's frame_max goes in several body frames, as aio-pika's publish sends
                   # it (an envelope of a full relay batch is ~135 KiB; one frame of it closes the connection).
                   *(ContentBody(body[at:at + max_content]) for at in range(0, len(body), max_content))]
    return frames


async def _fan_out(stack: Stack, fleet: list[ClientProcess], clients: list[tuple[str, str]]) -> None:
    """One `task_available` per client, published straight to the dispatch exchange as the outbox relay would
    publish them (`_fan_out_frames`: towards each client's hub, read before the clock starts; one envelope per hub
    per relay batch; `HUB_SCALE_FANOUT=single`: one message per event, as before dispatch batches; `both`: the
    two alternate). The publishes
    are marshalled before the clock starts and written to the broker in one go: a Python publisher's own cost
    (~130-500 µs a message on this box, over a second for 10,000) would otherwise be most of the figure, and in
    production the events come from publishers on other machines. After the rounds: each hub's intake against its
    share of the sockets."""
    settings = stack.settings
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    keys = await _routed_keys(settings, clients)
    mode = os.environ.get("HUB_SCALE_FANOUT", "batch")
    # `both`: single and batched rounds alternate, so the two are compared on the same stack and the same load.
    modes = ["single", "batch"] * FANOUT_ROUNDS if mode == "both" else [mode] * FANOUT_ROUNDS
    intake0 = await _per_hub(stack, "hub_dispatch_events_received_total")
    connection = await aio_pika.connect(settings.amqp_url)
    try:
        channel: Any = await (await connection.channel(publisher_confirms=False)).get_underlay_channel()
        for round_no, round_mode in enumerate(modes, start=1):
            marker = uuid.uuid4()
            relay_batch = 1 if round_mode == "single" else settings.outbox_batch_size
            frames = _fan_out_frames(topology, clients, keys, marker, relay_batch, channel.max_content_size)
            written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            payload = ChannelFrame.marshall(channel_number=channel.number, frames=frames, drain_future=written)
            cpu0 = _cpu_s(stack)
            started = time.time()
            await channel.write_queue.put(payload)
            await written
            published = time.time()
            deadline = time.monotonic() + FANOUT_DEADLINE_S
            times: list[float] = []
            while time.monotonic() < deadline:
                answers = await asyncio.gather(*(p.ask(cmd="arrivals", task_id=str(marker)) for p in fleet))
                times = [t for a in answers for t in a["times"]]
                if len(times) >= len(clients):
                    break
                await asyncio.sleep(0.05)  # polling the fleet's processes with a deadline
            hub_cpu = _cpu_s(stack) - cpu0
            spans = [(t - started) * 1000 for t in times]
            print(f"  fan-out #{round_no} ({round_mode}): {len(times)}/{len(clients)} arrived; "
                  f"{len(frames) // 3} broker messages for {len(clients)} events written in "
                  f"{(published - started) * 1000:.0f} ms; publish -> arrival (ms): "
                  f"{summary(spans) if spans else 'none'}; hub CPU {hub_cpu:.2f} s "
                  f"({hub_cpu / max(1, len(clients)) * 1e6:.0f} µs an event); {_load()}", flush=True)
            await asyncio.sleep(1)
    finally:
        await connection.close()
    intake = [b - a for a, b in zip(intake0, await _per_hub(stack, "hub_dispatch_events_received_total"),
                                    strict=True)]
    sockets = await _per_hub(stack, "desktop_websocket_connections")
    total_in, total_sockets = max(1.0, sum(intake)), max(1.0, sum(sockets))
    shares = [f"hub {i + 1}: {int(n)} events for {int(k)} sockets ({n / total_in * 100:.1f}% of the intake, "
              f"{k / total_sockets * 100:.1f}% of the sockets; off by "
              f"{(n / total_in) / max(1e-9, k / total_sockets) * 100 - 100:+.1f}%)"
              for i, (n, k) in enumerate(zip(intake, sockets, strict=True))]
    print(f"  intake per hub over {len(modes)} rounds: " + "; ".join(shares), flush=True)


class _SocketLost(Exception):
    """The probe's WebSocket closed or reset under it (a connect storm on a loaded box)."""


async def _next_event(ws: aiohttp.ClientWebSocketResponse, timeout: float) -> dict[str, Any]:
    message = await ws.receive(timeout=timeout)
    if message.type != aiohttp.WSMsgType.TEXT:  # CLOSE, CLOSED, ERROR: the socket is gone
        raise _SocketLost(f"{message.type.name}: {message.data!r}"[:200])
    event: dict[str, Any] = msgspec.json.decode(message.data)
    return event


# What a probe's HTTP call or socket may meet in a connect storm on this box: a reset, a refused or dropped connection
# (`aiohttp.ClientConnectionResetError` among them), a socket closed under it. The probe reconnects and goes on.
_PROBE_LOST = (aiohttp.ClientConnectionError, _SocketLost, ConnectionResetError)
PROBE_RECONNECTS = 30


@dataclass(slots=True)
class _ProbeClient:
    """The probe desktop: its WebSocket (reopened after a reset) and the resets it met."""

    http: aiohttp.ClientSession
    hub: str
    auth: dict[str, str]
    ws: aiohttp.ClientWebSocketResponse | None = None
    resets: int = 0

    async def open(self) -> aiohttp.ClientWebSocketResponse:
        """(Re)connect: the hello, its replay read past (earlier clicks' events, not the next click's), then any task
        a lost socket left leased or queued finished, so the next click's task is the only one."""
        for attempt in range(PROBE_RECONNECTS):
            try:
                ws = await self.http.ws_connect(f"{self.hub}/api/desktop/ws", headers=self.auth)
                hello = await _next_event(ws, 30)
                assert hello["type"] == "hello", hello
                for _ in range(int(hello.get("replayed_available", 0)) + int(hello.get("replayed_controls", 0))):
                    await _next_event(ws, 10)
                if self.resets:
                    await self.finish(await self.lease(10))
                self.ws = ws
                return ws
            except (*_PROBE_LOST, aiohttp.WSServerHandshakeError, TimeoutError) as exc:  # a refusal (503) too
                self.resets += 1
                print(f"  probe: connecting the probe's socket failed ({type(exc).__name__}); again", flush=True)
                await asyncio.sleep(min(5.0, 0.2 * 2 ** attempt))  # reconnect backoff, as a desktop's
        raise RuntimeError(f"the probe could not connect in {PROBE_RECONNECTS} attempts")

    async def lease(self, max_tasks: int = 1) -> list[dict[str, Any]]:
        async with self.http.post(f"{self.hub}/api/desktop/monitor/lease", json={"max_tasks": max_tasks},
                                  headers=self.auth) as resp:
            tasks: list[dict[str, Any]] = (await resp.json())["tasks"]
        return tasks

    async def finish(self, tasks: list[dict[str, Any]]) -> None:
        for task in tasks:
            async with self.http.post(f"{self.hub}/api/desktop/tasks/{task['task_id']}/result", json={
                    "lease_token": task["lease_token"], "status": "succeeded", "answer_text": "bench"},
                    headers=self.auth) as resp:
                await resp.read()

    async def reset(self, exc: BaseException) -> None:
        self.resets += 1
        print(f"  probe: the probe's connection was lost ({type(exc).__name__}: {str(exc)[:120]}); reconnecting",
              flush=True)
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
        await self.open()


@dataclass(slots=True)
class ProbeRun:
    """A probe phase's clicks: click -> task_available (ms), each click's marks (bench/hub_hops.py), the probe's
    connection resets."""

    to_socket: list[float]
    marks: list[dict[str, float | None]]
    resets: int


class _BrokerTap:
    """A queue of the benchmark's own bound to every dispatch key of the probe client (`#.<client>`, the hub-routed
    ones too): when the broker delivered each of its events (task id -> wall clock), beside the hub's queue."""

    def __init__(self, settings: Settings, client_id: str) -> None:
        self.settings, self.client_id = settings, client_id
        self.seen: dict[str, float] = {}
        self._connection: Any = None

    async def __aenter__(self) -> _BrokerTap:
        topology = Topology(self.settings.mq_prefix, self.settings.ingest_shards)
        self._connection = await aio_pika.connect(self.settings.amqp_url)
        channel = await self._connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(topology.dispatch_exchange, routing_key=f"#.{self.client_id}")
        await queue.consume(self._on_message, no_ack=True)
        return self

    async def _on_message(self, message: Any) -> None:
        now = time.time()
        bodies = [e.body for e in unwrap(message.body).events] if message.type == DISPATCH_BATCH else [message.body]
        for body in bodies:
            with contextlib.suppress(msgspec.MsgspecError, AttributeError):
                task_id = msgspec.json.decode(body).get("task_id")
                if task_id:
                    self.seen.setdefault(str(task_id), now)

    async def __aexit__(self, *_: object) -> None:
        await self._connection.close()


async def _probe(stack: Stack, world: World, clicks: int, *, during_storm: asyncio.Event | None = None,
                 hub_url: str | None = None) -> ProbeRun:
    """Click -> high task_available on the probe's socket; then lease and post the result, as a desktop does; each
    click's marks for the per-hop breakdown (`_hop_marks`). A reset or lost connection (a connect storm) is counted,
    the socket reopened, and the click that met it left out. `during_storm`: click the storm's own questions until
    it is set, and measure no hub hop. `hub_url`: the hub the probe connects to (the first one by default)."""
    probe = world.probe
    questions = probe["brands"][0]["question_ids"]
    # The probe phase clicks the first `clicks` questions, the connect storm the next STORM_CLICKS, the reconnect
    # storm (on another hub) the last ones.
    if during_storm is None:
        question_ids = questions[:clicks]
    else:
        question_ids = questions[clicks + STORM_CLICKS:] if hub_url else questions[clicks:clicks + STORM_CLICKS]
    client, brand = probe["clients"][0], probe["brands"][0]
    jwt = stack.jwt(probe)
    api = stack.api_url
    to_socket: list[float] = []
    marks: list[dict[str, float | None]] = []
    task_ids: list[str] = []  # each click's task, beside its marks
    refused = 0
    async with aiohttp.ClientSession() as http, _BrokerTap(stack.settings, client["client_id"]) as tap:
        desktop = _ProbeClient(http, hub_url or stack.hub_url, {"Authorization": f"Bearer {client['token']}"})
        await desktop.open()
        for question_id in question_ids:
            if during_storm is not None and during_storm.is_set():
                break
            try:
                for _ in range(10):  # a click refused while the tenant's previous one still holds its lock: again
                    clicked = time.time()
                    async with http.post(f"{api}/api/tenant/monitoring/brands/{brand['brand_id']}/collect-now",
                                         json={"target_client_id": client["client_id"], "question_ids": [question_id]},
                                         headers={"Authorization": f"Bearer {jwt}"}) as resp:
                        if resp.status in (200, 201, 202):
                            break
                        assert resp.status in (409, 429), await resp.text()
                        refused += 1
                    await asyncio.sleep(0.5)
                accepted = time.time()
                assert desktop.ws is not None
                try:
                    while True:
                        event = await _next_event(desktop.ws, 5)
                        if event.get("type") == "task_available" and event.get("lane") == "high":
                            break
                except TimeoutError:
                    print("  probe: a click's task_available did not arrive within 5 s", flush=True)
                    continue
                on_socket = time.time()
                to_socket.append((on_socket - clicked) * 1000)
                tasks = await desktop.lease()
                marks.append({"clicked": clicked, "accepted": accepted, "on_socket": on_socket, "leased": time.time()})
                task_ids.append(str(event["task_id"]))
                await desktop.finish(tasks)
            except _PROBE_LOST as exc:
                await desktop.reset(exc)
                continue
            await asyncio.sleep(0.1)  # clicks are human-paced; keep them apart
        if during_storm is None:
            assert desktop.ws is not None
            hops = await _hub_hop(stack, desktop.ws, client["client_id"], samples=clicks)
            print(f"  probe: hub hop (event published straight to the exchange -> on the probe's socket, ms): "
                  f"{summary(hops)}", flush=True)
        if desktop.ws is not None:
            await desktop.ws.close()
        at_broker = dict(tap.seen)
    if refused:
        print(f"  probe: {refused} clicks refused as busy (409/429) and clicked again", flush=True)
    if desktop.resets:
        print(f"  probe: {desktop.resets} connection resets or failed connects met and reconnected (the clicks "
              f"that met one are left out)", flush=True)
    return ProbeRun(to_socket, await _hop_marks(stack, client["client_id"], list(zip(task_ids, marks, strict=True)),
                                                at_broker), desktop.resets)


# The click's high TaskAvailable in the outbox: published_at is its publisher's broker-confirm time.
_PUBLISHED = """
SELECT extract(epoch FROM published_at)::float8 AS published FROM outbox
WHERE routing_key LIKE '%%.' || %(client)s AND payload LIKE %(task)s AND published_at IS NOT NULL
ORDER BY published_at LIMIT 1
"""


def _high_passes(log_text: str) -> tuple[dict[str, tuple[float, float]], list[tuple[float, float, bool]]]:
    """From the coordinator's log: task id -> (pass_started_at, committed_at) of its "high pass committed" line, and
    the "high pass woken" lines as (picked_at, woken_at, during_full_pass), in order."""
    passes: dict[str, tuple[float, float]] = {}
    wakes: list[tuple[float, float, bool]] = []
    for line in log_text.splitlines():
        if '"high pass committed"' not in line and '"high pass woken"' not in line:
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = json.loads(line)
            if record.get("event") == "high pass woken":
                wakes.append((float(record["picked_at"]), float(record["woken_at"]), bool(record["during_full_pass"])))
                continue
            for task_id in record["task_ids"]:
                passes[str(task_id)] = (float(record["pass_started_at"]), float(record["committed_at"]))
    return passes, wakes


def _wake_of(wakes: list[tuple[float, float, bool]], started: float) -> tuple[float, float, bool] | None:
    """The wake-up a high pass served: the last one the loop took up before the pass began."""
    taken = [w for w in wakes if w[0] <= started and w[1] > 0]
    return max(taken, default=None)


async def _hop_marks(stack: Stack, client_id: str, clicks: list[tuple[str, dict[str, float | None]]],
                     at_broker: dict[str, float]) -> list[dict[str, float | None]]:
    """Each click's marks completed from the services: the coordinator's high pass (its log), the publish (the
    outbox row), the broker's delivery (the tap). A mark not found stays None (e.g. a click a full pass dispatched
    has no high pass)."""
    passes, wakes = _high_passes(stack.procs["dispatch-coordinator"].logs())
    out: list[dict[str, float | None]] = []
    conn = await connect(stack.settings.database_url)
    try:
        for task_id, click in clicks:
            cur = await conn.execute(_PUBLISHED, {"client": client_id, "task": f"%{task_id}%".encode()})
            row = await cur.fetchone()
            started, committed = passes.get(task_id, (None, None))
            wake = _wake_of(wakes, started) if started is not None else None
            out.append({**click, "woken": wake[1] if wake else None,
                        "behind_full_pass": float(wake[2]) if wake else None, "pass_started": started,
                        "committed": committed, "published": row["published"] if row else None,
                        "at_broker": at_broker.get(task_id)})
    finally:
        await conn.close()
    return out


def _print_hops(label: str, run: ProbeRun, *, waits: bool) -> None:
    """The per-hop table (p50 / p99 ms); with HUB_SCALE_WAITS=1 also where the time went and the slowest clicks."""
    marks = run.marks
    by_full = sum(1 for m in marks if m.get("pass_started") is None)
    behind = sum(1 for m in marks if m.get("behind_full_pass"))
    print(f"  {label}: per hop (ms; {len(marks)} clicks, {by_full} of them dispatched by a full pass, not the high "
          f"pass; {behind} woke the coordinator during a full pass; {run.resets} probe connection resets):",
          flush=True)
    for hop, n, p50, p99 in hub_hops.hop_rows(marks):
        print(f"    {hop:<55} n={n:<4} p50 {p50:8.1f}  p99 {p99:8.1f}", flush=True)
    if not waits:
        return
    parts = hub_hops.shares(marks)
    print(f"  {label}: where the time went (each hop's part of the complete clicks' click -> lease time): "
          + ("; ".join(f"{hop} {share * 100:.0f}%" for hop, share in parts) if parts else "no complete click"),
          flush=True)
    print(f"  {label}: slowest clicks (click -> lease ms: the hops in the table's order): " + "; ".join(
        f"{total:.0f}: " + " / ".join("-" if h is None else f"{h:.0f}" for h in hops)
        for total, hops in hub_hops.slowest(marks, 3)), flush=True)


async def _fleet_lag(fleet: list[ClientProcess]) -> str:
    """The fleet processes' event-loop lag since the last ask (all processes together)."""
    answers = await asyncio.gather(*(p.ask(cmd="lag") for p in fleet))
    lag = hub_hops.lag_summary([s for a in answers for s in a["lag_ms"]])
    return (f"fleet event-loop lag (ms, {int(lag['n'])} samples): p50 {lag['p50']:.1f} p99 {lag['p99']:.1f} "
            f"max {lag['max']:.1f}")


async def _passes(stack: Stack) -> tuple[float, float]:
    """The coordinator's dispatch-loop iterations so far and their summed duration (ms)."""
    return (await stack.metric("dispatch-coordinator", "dispatch_pass_duration_ms_count"),
            await stack.metric("dispatch-coordinator", "dispatch_pass_duration_ms_sum"))


def _passes_note(before: tuple[float, float], after: tuple[float, float]) -> str:
    n, ms = after[0] - before[0], after[1] - before[1]
    return f"dispatch passes meanwhile: {n:.0f}, {ms / max(n, 1):.0f} ms each on average, {ms / 1000:.1f} s in all"


async def _hub_hop(stack: Stack, ws: aiohttp.ClientWebSocketResponse, client_id: str, *,
                   samples: int) -> list[float]:
    """The hub's own share of a click: an event published to the dispatch exchange -> on the socket."""
    return await collect_now_hub_hop(stack.settings, ws, client_id, samples=samples, gap_s=0.05)


async def _storm(stack: Stack, fleet: list[ClientProcess], total: int, world: World, clicks: int) -> None:
    """kill -9 of the first hub, started again, until every client is back; with several hubs, clicks meanwhile for
    the probe on another hub (which takes its share of the reconnects: HUB_SCALE_PROFILE profiles it meanwhile)."""
    hub = stack.procs["dispatch-hub"]
    # The probe clicks on another hub, which takes its share of the killed hub's clients (the simulated load balancer
    # picks one of the others at random, bench/hub_scale_client.py) while they are refused by the killed one.
    other_hubs = [h for h in _hubs(stack) if h is not hub]
    settled = asyncio.Event()
    clicking: tuple[asyncio.Task[ProbeRun], Profile] | None = None
    if other_hubs:
        clicking = (asyncio.create_task(_probe(stack, world, clicks, during_storm=settled, hub_url=other_hubs[0].url)),
                    await Profile(stack, "storm-probe-hub", hub=other_hubs[0]).__aenter__())
    killed = time.time()
    overflows, others = _listen_overflows(), _others_cpu_s(stack, fleet)
    hub.kill()
    await asyncio.to_thread(hub.start, timeout=60)
    up = time.time()
    cpu0, leader0 = _cpu_s(stack), await _leader(stack)
    async with Profile(stack, "storm"):
        # Every client ready again, counting those of the other hubs that never left (since=0: ready at all).
        status, done = await _until_ready(fleet, since=0.0 if len(_hubs(stack)) > 1 else killed,
                                          deadline_s=STORM_DEADLINE_S, stack=stack, label="storm", shown_from=killed)
    last = status["last_ready"]
    print(f"  reconnect storm: {status['ready']}/{total} reconnected with their replay; kill -> all ready "
          f"{last - killed:.1f} s (hub back up after {up - killed:.1f} s; "
          f"{f'up -> all ready {last - up:.1f} s' if last >= up else 'all ready on the other hubs before it was up'})"
          f"{'' if done else f' -- deadline of {STORM_DEADLINE_S:.0f} s reached'}; hub RSS {_rss_mib(stack):.0f} MiB, "
          f"hub CPU {_cpu_s(stack) - cpu0:.1f} s; handshake failures seen by clients: {status['errors']}; "
          f"listen queue overflows {_listen_overflows() - overflows}; {_load()}; CPU meanwhile: "
          f"{_cpu_note(others, _others_cpu_s(stack, fleet))}; "
          f"{_leader_note(leader0, await _leader(stack), time.time() - up)}", flush=True)
    if clicking is not None:
        task, profile = clicking
        settled.set()
        run = await task
        await profile.__aexit__()
        label = "clicks on another hub during the reconnect storm"
        print(f"  {label}: click -> task_available (ms): "
              f"{summary(run.to_socket) if run.to_socket else 'none arrived'}; "
              f"p99 {percentile(run.to_socket, 99):.1f} ms", flush=True)
        _print_hops(label, run, waits=os.environ.get("HUB_SCALE_WAITS", "") == "1")


async def _write_events(settings: Settings, clients: list[tuple[str, str]], written: list[str],
                        stop: asyncio.Event) -> None:
    """Until `stop`: every ROLLING_EVENT_EVERY_S a queued execution for a random fleet client and its
    task_available, in one transaction (the coordinator's shape of a dispatch)."""
    spec = lane_spec("publish", "normal")
    conn = await connect(settings.database_url)
    rng = random.Random(7)
    try:
        while not stop.is_set():
            client_id, _ = rng.choice(clients)
            task_id = uuid.uuid4()
            async with conn.transaction():
                cur = await conn.execute(_ONE_TASK, {"id": task_id, "client": client_id, "priority":
                                                     spec.default_priority, "weight": spec.weight})
                row = await cur.fetchone()
                assert row is not None
                await enqueue(conn, exchange=DISPATCH, routing_key=f"publish.{client_id}", tenant_id=row["tenant_id"],
                              message=TaskAvailable(kind="publish", task_id=task_id, priority=spec.default_priority,
                                                    target_client_id=uuid.UUID(client_id), lane="normal",
                                                    updated_at=datetime.now(UTC)))
            written.append(str(task_id))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ROLLING_EVENT_EVERY_S)
    finally:
        await conn.close()


async def _rolling_restart(stack: Stack, fleet: list[ClientProcess], world: World, total: int) -> None:
    """Each hub in turn: SIGTERM (it drains), started again, until every client of the fleet is back with its
    replay; meanwhile task_available events through the outbox for random clients, none of which may be lost."""
    written: list[str] = []
    stop = asyncio.Event()
    writer = asyncio.create_task(_write_events(stack.settings, world.fleet, written, stop))
    try:
        for n, hub in enumerate(_hubs(stack), start=1):
            others, drained0 = _others_cpu_s(stack, fleet), (await _status(fleet, 0.0))["drained"]
            leader0 = await _leader(stack)
            terminated = time.time()
            assert hub.proc is not None
            hub.proc.terminate()
            code = await asyncio.to_thread(hub.proc.wait, 60)
            exited = time.time()
            hub.kill()  # closes its log
            await asyncio.to_thread(hub.start, timeout=60)
            up = time.time()
            status, done = await _until_ready(fleet, since=0.0, deadline_s=ROLL_DEADLINE_S, stack=stack,
                                              label=f"roll hub {n}", shown_from=terminated)
            settled = max(status["last_ready"], up) - terminated
            print(f"  rolling restart, hub {n}: exit {exited - terminated:.1f} s after SIGTERM (code {code}); "
                  f"{status['drained'] - drained0} sockets told to reconnect elsewhere; every client back with "
                  f"its replay {settled:.1f} s after SIGTERM{'' if done else ' -- deadline reached'} (hub up "
                  f"{up - terminated:.1f} s after it); {_load()}; CPU meanwhile: "
                  f"{_cpu_note(others, _others_cpu_s(stack, fleet))}; "
                  f"{_leader_note(leader0, await _leader(stack), time.time() - terminated)}", flush=True)
    finally:
        stop.set()
        await writer
    deadline = time.monotonic() + 30
    missing = set(written)
    while missing and time.monotonic() < deadline:
        answers = await asyncio.gather(*(p.ask(cmd="arrived", task_ids=sorted(missing)) for p in fleet))
        missing -= {t for a in answers for t in a["arrived"]}
        await asyncio.sleep(0.5)  # polling the fleet's processes with a deadline
    print(f"  rolling restart: {len(written)} task_available events written through the outbox during the roll, "
          f"{len(written) - len(missing)} reached their clients (live or replayed), events lost: {len(missing)}",
          flush=True)
    await _rebalanced(stack)


# How long the benchmark watches the hubs even out after a roll (rebalancing: services/dispatch_hub/logic.py).
REBALANCE_DEADLINE_S = 300.0


async def _rebalanced(stack: Stack) -> None:
    """After the roll: each hub's sockets (what it writes with its sweep), then until none holds more than its share
    (`sockets_to_shed` would close nothing), or the deadline: how long that took and the spread before and after."""
    conn = await connect(stack.settings.database_url)
    try:
        async def spread() -> dict[str, int]:
            cur = await conn.execute("SELECT hub_id, sockets FROM hub_instances "
                                     "WHERE seen_at > now() - interval '10 seconds' ORDER BY hub_id")
            return {r["hub_id"]: int(r["sockets"]) for r in await cur.fetchall()}

        slack = stack.settings.hub_rebalance_slack
        started, first = time.monotonic(), await spread()
        now = first
        while time.monotonic() - started < REBALANCE_DEADLINE_S:
            total = sum(now.values())
            if slack <= 0 or not any(sockets_to_shed(n, total, len(now), slack=slack, changed=0,
                                                     lightest=min(now.values())) for n in now.values()):
                break
            await asyncio.sleep(1.0)  # sampling the hubs' own counts, a sweep apart, with a deadline
            now = await spread()
        print(f"  after the roll, sockets per hub: {sorted(first.values())} -> {sorted(now.values())} in "
              f"{time.monotonic() - started:.0f} s (HUB_REBALANCE_SLACK={slack}); {_load()}", flush=True)
    finally:
        await conn.close()


async def _scenario(clients: int, clicks: int, hubs: int = 1) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fleet_size = clients - 1  # the probe is the last client
    processes = math.ceil(fleet_size / CLIENTS_PER_PROCESS)
    print(f"  {clients} clients ({fleet_size} in {processes} fleet processes + 1 probe) over {hubs} hub(s); "
          f"file descriptors: soft "
          f"limit {soft} raised to {hard} for this process and its children; {_load()}", flush=True)
    async with bench_environment(shards=16) as base:
        settings = replace(base, gateway_jwt_secret=JWT_SECRET)
        world = await _prepare(settings, fleet=fleet_size, clicks=clicks)
        with tempfile.TemporaryDirectory() as logs:
            env: dict[str, Any] = {"DB_POOL_MAX": 6, "HUB_UPGRADE_BURST_PER_ADDRESS": 4 * clients + 1000,
                                   "HUB_UPGRADES_PER_ADDRESS_PER_S": 4 * clients + 1000}
            async with running_stack(settings, Path(logs), services=DISPATCH_SERVICES, **env) as stack:
                hub_env = service_env(settings, **env)
                extra = {f"dispatch-hub-{n}": ServiceProcess("dispatch-hub", hub_env, log_dir=Path(logs))
                         for n in range(2, hubs + 1)}
                stack.procs.update(extra)  # stopped with the stack
                await asyncio.gather(*(asyncio.to_thread(h.start) for h in extra.values()))
                fleet: list[ClientProcess] = []
                try:
                    await _run(stack, world, fleet, Path(logs), clicks=clicks)
                finally:
                    await asyncio.gather(*(p.stop() for p in fleet))
                    kinds, collections = _hub_errors(stack)
                    print(f"  hub errors and warnings logged: {len(kinds)} kinds"
                          + "".join(f"\n    {e}" for e in kinds[:5] + collections), flush=True)


async def _run(stack: Stack, world: World, fleet: list[ClientProcess], folder: Path, *, clicks: int) -> None:
    tokens = [token for _, token in world.fleet]
    total = len(tokens)
    chunks = [tokens[i:i + CLIENTS_PER_PROCESS] for i in range(0, total, CLIENTS_PER_PROCESS)]
    hub_urls = [h.url for h in _hubs(stack)]
    fleet += await asyncio.gather(*(ClientProcess.start(hub_urls, chunk, folder, i, offset=i * CLIENTS_PER_PROCESS)
                                    for i, chunk in enumerate(chunks)))
    rss0, cpu0, overflows, others = _rss_mib(stack), _cpu_s(stack), _listen_overflows(), _others_cpu_s(stack, fleet)
    leader0 = await _leader(stack)
    connected = asyncio.Event()
    clicking = asyncio.create_task(_probe(stack, world, clicks, during_storm=connected))
    async with Profile(stack, "connect"):
        started = time.time()
        await asyncio.gather(*(p.ask(cmd="connect") for p in fleet))
        status, done = await _until_ready(fleet, since=started, deadline_s=CONNECT_DEADLINE_S, stack=stack,
                                          label="connect")
    connected.set()
    storm = await clicking
    storm_clicks = storm.to_socket
    print(f"  clicks during the connect storm: click -> task_available (ms): "
          f"{summary(storm_clicks) if storm_clicks else 'none arrived'}; p99 {percentile(storm_clicks, 99):.1f} ms",
          flush=True)
    waits = os.environ.get("HUB_SCALE_WAITS", "") == "1"
    _print_hops("clicks during the connect storm", storm, waits=waits)
    rss = _rss_mib(stack)
    per = (rss - rss0) * 1024 / max(1, status["ready"])
    took = f"{status['last_ready'] - started:.1f} s" if status["ready"] else "-"
    print(f"  connect: {status['ready']}/{total} with hello + replay in {took}"
          f"{'' if done else f' -- deadline of {CONNECT_DEADLINE_S:.0f} s reached'}; hub RSS {rss0:.0f} -> "
          f"{rss:.0f} MiB ({per:.1f} KiB per connection), hub CPU {_cpu_s(stack) - cpu0:.1f} s; handshake failures "
          f"seen by clients: {status['errors']}; listen queue overflows {_listen_overflows() - overflows}; {_load()}; "
          f"CPU meanwhile: {_cpu_note(others, _others_cpu_s(stack, fleet))}; "
          f"{_leader_note(leader0, await _leader(stack), time.time() - started)}", flush=True)
    if not done:
        return
    phases = os.environ.get("HUB_SCALE_PHASES", "fan-out,probe,storm,rolling").split(",")
    cpu0, leader0 = _cpu_s(stack), await _leader(stack)
    async with Profile(stack, "steady"):
        await asyncio.sleep(12)  # a heartbeat interval: every client heartbeated once, the hub pinged every socket
    print(f"  steady: hub RSS {_rss_mib(stack):.0f} MiB after a heartbeat interval; hub CPU "
          f"{(_cpu_s(stack) - cpu0) / 12 * 100:.0f}% of a core; {_leader_note(leader0, await _leader(stack), 12)}; "
          f"{_load()}", flush=True)
    if "fan-out" in phases:
        async with Profile(stack, "fan-out"):
            await _fan_out(stack, fleet, world.fleet)
    if "probe" in phases:
        cpu0, leader0, passes0 = _cpu_s(stack), await _leader(stack), await _passes(stack)
        others, probe_started = _others_cpu_s(stack, fleet), time.time()
        await _fleet_lag(fleet)  # the samples so far are not the probe's
        async with Profile(stack, "probe"):
            run = await _probe(stack, world, clicks)
        to_socket = run.to_socket
        print(f"  probe with {total} others connected: click -> task_available (ms): "
              f"{summary(to_socket) if to_socket else 'none arrived'}; p99 {percentile(to_socket, 99):.1f} ms; "
              f"hub CPU {_cpu_s(stack) - cpu0:.1f} s; {_load()}", flush=True)
        _print_hops(f"probe with {total} others connected", run, waits=waits)
        print(f"  probe: {await _fleet_lag(fleet)}; {_passes_note(passes0, await _passes(stack))}; "
              f"{_leader_note(leader0, await _leader(stack), time.time() - probe_started)}; CPU meanwhile: "
              f"{_cpu_note(others, _others_cpu_s(stack, fleet))}; {_load()}", flush=True)
    if "storm" in phases:
        await _storm(stack, fleet, total, world, clicks)
    if "rolling" in phases:
        await _rolling_restart(stack, fleet, world, total)


async def run(args: argparse.Namespace) -> None:
    clients = int(getattr(args, "clients", None) or (1000 if args.quick else 10_000))
    clicks = 20 if args.quick else 100
    await _scenario(clients, clicks, hubs=max(1, int(getattr(args, "hubs", None) or 1)))


if __name__ == "__main__":  # `python -m bench.b_hub_scale` works too
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hubs", type=int)
    import uvloop

    uvloop.run(run(parser.parse_args()))
