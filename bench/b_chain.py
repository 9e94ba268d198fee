"""The reference one-hop chain on this machine, for scale: HTTP -> a Postgres transaction that writes one outbox
row and NOTIFY -> the outbox-pump -> RabbitMQ with confirm -> the dispatch-hub -> the WebSocket. The pump and the
hub are the real service processes; a minimal writer process (this module: `python -m bench.b_chain writer`)
stands in for an API. A collect-now click crosses two such hops (collect-now-api's transaction -> the
coordinator; the coordinator's transaction -> the socket) plus the work inside each, so twice this chain is
roughly the floor for click -> task_available here.

    .venv/bin/python -m bench chain
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from bench.common import bench_environment, summary
from libs.config import Settings
from libs.contracts.wire import TaskAvailable
from libs.db.pool import connect, make_pool
from libs.demo import seed_demo
from libs.mq.topology import DISPATCH, Topology
from libs.outbox import OutboxEvent, enqueue_many
from libs.outbox.relay import AmqpPublisher, OutboxRelay, claim_own
from tests.support.procs import ServiceProcess, service_env
from tests.support.stack import running_stack


class Emit(msgspec.Struct, frozen=True):
    client_id: uuid.UUID
    task_id: uuid.UUID
    relay: bool = False  # the writer publishes its own row after the commit (libs/outbox/relay.py)


def writer_app(settings: Settings) -> web.Application:
    """POST /emit: one transaction with one prioritised outbox row and its NOTIFY (or, with `relay`, the row
    claimed in the transaction and published by the writer after its commit), then 202."""
    app = web.Application()
    pool = make_pool(settings, name="bench-chain-writer", min_size=2, max_size=4)
    publisher = AmqpPublisher(settings.amqp_url, Topology(settings.mq_prefix, settings.ingest_shards), timeout=5,
                              name="bench-chain-writer")
    relay = OutboxRelay(pool, publisher, claimed_by="bench-chain-writer")
    relaying: set[asyncio.Task[int]] = set()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await pool.open(wait=True, timeout=30)
        await publisher.start()
        yield
        await publisher.close()
        await pool.close()

    async def emit(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read(), type=Emit)
        event = TaskAvailable(kind="monitor", task_id=body.task_id, target_client_id=body.client_id, priority=5000,
                              lane="high", updated_at=datetime.now(UTC))
        async with pool.connection() as conn, conn.pipeline():
            async with conn.transaction():
                ids = await enqueue_many(conn, [OutboxEvent(
                    exchange=DISPATCH, routing_key=f"monitor.high.{body.client_id}", message=event,
                    ordering_key=f"client:{body.client_id}", priority=1)], notify=not body.relay)
                own = await claim_own(conn, ids, claimed_by=relay.claimed_by, lease_seconds=5) if body.relay else None
            if own is not None:
                task = asyncio.create_task(relay.process(await own.events()))
                relaying.add(task)
                task.add_done_callback(relaying.discard)
        return web.Response(status=202)

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/emit", emit)
    app.router.add_get("/readyz", ready)
    return app


async def run(args: argparse.Namespace) -> None:
    clicks = 15 if args.quick else 100
    async with bench_environment(shards=16) as settings:
        conn = await connect(settings.database_url)
        try:
            seeded = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, platforms=("openai",),
                                     due=False)
        finally:
            await conn.close()
        client = seeded["tenants"][0]["clients"][0]
        with tempfile.TemporaryDirectory() as logs:
            async with running_stack(settings, Path(logs), services=("outbox-pump", "dispatch-hub")) as stack:
                writer = ServiceProcess("python", service_env(settings), log_dir=Path(logs),
                                        args=["-m", "bench.b_chain", "writer"]).start()
                try:
                    for relay in (False, True):
                        try:
                            accepted, values = await _measure(stack.hub_url, writer.url, client, clicks, relay=relay)
                        except TimeoutError:
                            for proc in (writer, *stack.procs.values()):
                                print(f"----- {proc.name} log tail\n{proc.logs()[-3000:]}", flush=True)
                            raise
                        how = "the writer publishes its row" if relay else "NOTIFY -> outbox-pump"
                        print(f"  {how}: POST -> 202 (ms): {summary(accepted)}", flush=True)
                        print(f"  {how}: POST -> task_available on the socket (ms): {summary(values)}",
                              flush=True)
                finally:
                    writer.stop()


async def _measure(hub: str, writer: str, client: dict[str, str], clicks: int, *, relay: bool) -> (
        tuple[list[float], list[float]]):
    """POST -> 202 and POST -> task_available on the socket, per click."""
    values: list[float] = []
    accepted: list[float] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(
            f"{hub}/api/desktop/ws", headers={"Authorization": f"Bearer {client['token']}"}) as ws:
        # The hub binds the client's routing keys before it says hello; an event published before that is
        # unroutable (a real one is replayed from the database, these synthetic ones are not).
        assert msgspec.json.decode((await ws.receive(timeout=10)).data)["type"] == "hello"
        for n in range(clicks + 5):
            task_id = uuid.uuid4()
            started = time.perf_counter()
            async with http.post(f"{writer}/emit", data=msgspec.json.encode(
                    Emit(client_id=uuid.UUID(client["client_id"]), task_id=task_id, relay=relay))) as resp:
                assert resp.status == 202, await resp.text()
            accepted.append((time.perf_counter() - started) * 1000)
            while True:
                event = msgspec.json.decode((await ws.receive(timeout=10)).data)
                if event.get("task_id") == str(task_id):
                    break
            if n >= 5:  # the first few warm the processes up
                values.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.05)  # paced like the collect-now benchmark's clicks
    return accepted[5:], values


def main() -> None:
    import uvloop

    settings = Settings.from_env("bench-chain-writer")
    uvloop.install()
    web.run_app(writer_app(settings), host=settings.http_host, port=settings.http_port, print=None)


if __name__ == "__main__" and sys.argv[1:] == ["writer"]:
    main()
