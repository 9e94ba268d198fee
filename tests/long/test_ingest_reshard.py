"""Online resharding under load (docs/reliability.md, "Resharding ingest online"): results flow through the hub's
result publisher (routed by the epoch in Postgres, re-routed when returned) into real `ingest-shard-workers`
processes while `monitorctl ingest reshard` takes the shards 4 -> 8 -> 4. Checked from the ledger: every result
applied exactly once, each key's results in the order they were published, and no key applied by two shards at once
(nor by a new shard before the old one holding it was drained)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import msgspec
import pytest
from aiormq.exceptions import ChannelNotFoundEntity
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.amqp import MonitorResult
from libs.db.pool import Conn
from libs.domain.shard import ingest_shard_key
from libs.ingest.routing import Routing
from libs.mq.topology import Topology
from services.dispatch_hub.results import (
    AmqpResultPublisher,
    BrokerUnavailable,
    RoutingTableRouter,
    publish_routed,
)
from tests.support.ingest_factory import fetch, make_executions, make_result, make_world
from tests.support.procs import ServiceProcess, service_env
from tests.support.reshard_check import Applied, order_breaks, overlaps
from tests.support.wait import eventually

DAY = date(2026, 3, 20)
KEYS = 16  # brands, one business date: 16 shard keys
PER_KEY = 400  # more than the load sends: it runs until both reshards are done
PACE_S = 0.2  # between one key's results: ~16 x 5 results/s at most


def reshard(settings: Settings, shards: int) -> dict[str, object]:
    env = {**os.environ, "DATABASE_URL": settings.database_url, "AMQP_URL": settings.amqp_url,
           "MQ_PREFIX": settings.mq_prefix, "INGEST_SHARDS": str(settings.ingest_shards)}
    done = subprocess.run([sys.executable, "-m", "tools.monitorctl", "--json", "ingest", "reshard", str(shards),
                           "--apply", "--wait", "60"], env=env, capture_output=True, text=True, timeout=90,
                          check=False)
    assert done.returncode == 0, (done.stdout, done.stderr)
    out: dict[str, object] = msgspec.json.decode(done.stdout)
    return out


class CountingRouter(RoutingTableRouter):
    rerouted = 0

    def forget(self) -> None:
        CountingRouter.rerouted += 1
        super().forget()


@pytest.mark.timeout(240)
async def test_reshard_4_to_8_to_4_under_load(pool: AsyncConnectionPool[Conn], settings: Settings,
                                              topology: Topology, amqp, tmp_path: Path) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, brands=KEYS, questions=PER_KEY, platforms=1)
        executions = await make_executions(conn, world, business_date=DAY)
    by_key: dict[str, list[MonitorResult]] = defaultdict(list)
    for e in executions:
        by_key[ingest_shard_key(e.tenant_id, e.brand_id, e.business_date)].append(
            make_result(e, shards=topology.ingest_shards))
    stop_load = asyncio.Event()
    workers = [ServiceProcess("ingest-shard-workers", service_env(
        settings, INSTANCE_ID=name, INGEST_MEMBER_HEARTBEAT_SECONDS="0.3", INGEST_BATCH_SIZE=20, INGEST_PREFETCH=40),
        log_dir=tmp_path) for name in ("w1", "w2")]
    for w in workers:
        await asyncio.to_thread(w.start)
    router = CountingRouter(pool, topology.ingest_shards, max_age_s=1.0)
    # A hub that read the routing before the reshard and never reads it again on its own.
    stale = CountingRouter(pool, topology.ingest_shards, max_age_s=3600)
    assert await stale.current() == Routing(0, 4)
    publisher = AmqpResultPublisher(amqp, topology, router=router)
    await publisher.start()
    published: dict[str, list[str]] = defaultdict(list)
    sent = 0
    transient = 0

    async def one_key(key: str, results: list[MonitorResult]) -> None:
        nonlocal sent, transient
        for result in results:
            if stop_load.is_set():
                return
            while True:  # as a desktop client does: retry the post until it is accepted
                try:
                    await publish_routed(publisher, router, result)
                    break
                except BrokerUnavailable:
                    transient += 1
                    await asyncio.sleep(0.2)
            published[key].append(str(result.result_id))
            sent += 1
            await asyncio.sleep(PACE_S)  # pacing a steady stream, not waiting for anything

    load = asyncio.gather(*(one_key(k, v) for k, v in by_key.items()))
    try:
        await eventually(lambda: sent >= 100, timeout=60, message="load flowing")
        started = time.monotonic()
        up = await asyncio.to_thread(reshard, settings, 8)
        to_8_s = time.monotonic() - started
        assert up["status"] == "done" and up["active"] == {"epoch": 1, "shards": 8}, up
        # The stale hub: its publish to a retired epoch's routing key comes back and is re-routed, not lost.
        [late] = [make_result(e, shards=4) for e in (await _extra_executions(pool, world))]
        stale_published = await publish_routed(publisher, stale, late)
        assert stale_published.routing_epoch == 1
        middle = sent
        await eventually(lambda: sent >= middle + 100, timeout=60, message="load flowing on 8 shards", interval=0.2)
        started = time.monotonic()
        down = await asyncio.to_thread(reshard, settings, 4)
        to_4_s = time.monotonic() - started
        assert down["status"] == "done" and down["active"] == {"epoch": 2, "shards": 4}, down
        after = sent
        await eventually(lambda: sent >= after + 100, timeout=60, message="load flowing on 4 shards again",
                         interval=0.2)
        stop_load.set()
        await load
        total = sent
        assert total < KEYS * PER_KEY  # the load outlasted both reshards
        await eventually(lambda: _count(pool, total + 1), timeout=60, message="every result applied")
    finally:
        stop_load.set()
        await asyncio.gather(load, return_exceptions=True)
        await publisher.close()
        for w in workers:
            await asyncio.to_thread(w.stop)
        await _delete_epoch_queues(amqp, topology)
    rows = [Applied(str(r["key"]), str(r["result_id"]), int(r["seq"]), int(r["routing_epoch"]), int(r["shard"]),
                    r["tx_started_at"], r["applied_at"]) for r in await fetch(pool, LEDGER)]
    # Exactly once: each result once in the ledger (unique), once as a run, and nothing else applied.
    assert len(rows) == total + 1 == len({r.result_id for r in rows})
    runs = await fetch(pool, "SELECT count(*) AS n, count(DISTINCT result_id) AS d FROM question_monitor_runs")
    assert runs[0]["n"] == runs[0]["d"] == total + 1
    assert order_breaks(rows, published) == []
    assert overlaps(rows) == []
    assert {r.epoch for r in rows} == {0, 1, 2}
    # The barrier from its own facts: a key's first apply in a new epoch began after its old shard was drained.
    drains = {(int(d["epoch"]), int(d["shard"])): d["drained_at"] for d in await fetch(
        pool, "SELECT epoch, shard, drained_at FROM ingest_routing_drains")}
    assert len(drains) == 4 + 8
    previous = {0: None, 1: 0, 2: 1}
    firsts: dict[tuple[str, int], Applied] = {}
    lasts: dict[tuple[str, int], Applied] = {}
    for r in sorted(rows, key=lambda r: r.seq):
        firsts.setdefault((r.key, r.epoch), r)
        lasts[(r.key, r.epoch)] = r
    for (key, epoch), first in firsts.items():
        old = previous[epoch]
        if old is not None and (key, old) in lasts:
            assert first.tx_started_at > drains[(old, lasts[(key, old)].shard)], (key, epoch)
    # The retired epochs' queues are gone.
    for epoch, shards in ((0, 4), (1, 8)):
        async with amqp.channel() as channel:
            with pytest.raises(ChannelNotFoundEntity):
                await channel.declare_queue(topology.ingest_queue(shards - 1, epoch), passive=True)
    for w in workers:
        assert "Traceback" not in w.logs()
    print(f"\nreshard under load: {total + 1} results over {KEYS} keys; 4->8 took {to_8_s:.1f} s, 8->4 {to_4_s:.1f} s;"
          f" re-routed publishes {CountingRouter.rerouted}, retried posts {transient}; load {os.getloadavg()}")


async def _delete_epoch_queues(amqp, topology: Topology) -> None:  # type: ignore[no-untyped-def]
    """The queues of the epochs after 0 (the fixture's teardown deletes epoch 0's)."""
    async with amqp.channel() as channel:
        for epoch in (1, 2):
            for shard in range(8):
                await channel.queue_delete(topology.ingest_queue(shard, epoch))


LEDGER = """
SELECT a.result_id, a.seq, a.routing_epoch, a.shard, a.tx_started_at, a.applied_at,
       t.tenant_id || ':' || t.brand_id || ':' || t.business_date AS key
FROM ingest_applied_results a JOIN monitoring_collect_tasks t ON t.id = a.monitor_task_id
"""


async def _extra_executions(pool: AsyncConnectionPool[Conn], world) -> list:  # type: ignore[no-untyped-def]
    async with pool.connection() as conn:
        cur = await conn.execute("INSERT INTO brands (tenant_id, workspace_id, name) VALUES (%s, %s, 'late') "
                                 "RETURNING id", (world.tenant_id, world.workspace_id))
        brand_id = int((await cur.fetchone())["id"])  # type: ignore[index]
        cur = await conn.execute("INSERT INTO monitoring_questions (tenant_id, brand_id, text) VALUES (%s, %s, 'q') "
                                 "RETURNING id", (world.tenant_id, brand_id))
        question_id = int((await cur.fetchone())["id"])  # type: ignore[index]
        late_world = type(world)(world.tenant_id, world.workspace_id, [brand_id], {brand_id: [question_id]},
                                 world.platform_ids[:1], world.client_id)
        return await make_executions(conn, late_world, business_date=DAY)


async def _count(pool: AsyncConnectionPool[Conn], n: int) -> bool:
    rows = await fetch(pool, "SELECT count(*) AS n FROM ingest_applied_results")
    return rows[0]["n"] >= n  # type: ignore[operator]


