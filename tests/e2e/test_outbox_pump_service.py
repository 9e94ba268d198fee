"""The outbox-pump service as a real process: ops endpoints, publishing, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from libs.contracts.amqp import LifecycleEvent
from libs.mq.topology import LIFECYCLE
from libs.outbox import enqueue
from tests.support.capture import capture
from tests.support.procs import ServiceProcess, service_env
from tests.support.wait import eventually


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read()


async def _count(pool, status: str) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM outbox WHERE status = %s", (status,))
        row = await cur.fetchone()
        return int(row["n"]) if row else 0


async def test_pump_process_publishes_and_drains_on_sigterm(settings, pool, topology, amqp, tmp_path: Path) -> None:
    async with pool.connection() as conn:
        cur = await conn.execute("INSERT INTO tenants (name) VALUES ('t') RETURNING id")
        tenant_id = (await cur.fetchone())["id"]  # type: ignore[index]
    pump = ServiceProcess("outbox-pump", service_env(settings, OUTBOX_BATCH_SIZE=100), log_dir=tmp_path)
    async with capture(amqp, topology.lifecycle_exchange) as cap:
        await asyncio.to_thread(pump.start)
        try:
            status, body = await asyncio.to_thread(_get, pump.url + "/readyz")
            assert status == 200 and json.loads(body)["checks"] == {"postgres": "ok", "schema": "ok", "rabbitmq": "ok"}
            for batch in range(20):
                async with pool.connection() as conn, conn.transaction():
                    for i in range(100):
                        await enqueue(conn, exchange=LIFECYCLE, routing_key="client.online", tenant_id=tenant_id,
                                      message=LifecycleEvent(event="client.online", tenant_id=tenant_id,
                                                             occurred_at=datetime.now(UTC), reason=f"{batch}:{i}"),
                                      notify=True)
            # Stop while events are still flowing: in-flight publishes finish, claims are released.
            await eventually(lambda: _published_some(pool), message="first publishes")
            code = await asyncio.to_thread(pump.stop)
            assert code == 0, pump.logs()[-3000:]
            assert await _count(pool, "running") == 0, "a claim was left behind at shutdown"
            published = await _count(pool, "published")
            assert await _wait_deliveries(cap, published) >= published
            # A new pump picks up whatever was left, and nothing is published twice.
            second = ServiceProcess("outbox-pump", service_env(settings), log_dir=tmp_path)
            await asyncio.to_thread(second.start)
            try:
                await eventually(lambda: _all_published(pool, 2000), timeout=30, message="all 2000 published")
                await eventually(lambda: _delivered(cap, 2000), timeout=30, message="2000 deliveries")
            finally:
                await asyncio.to_thread(second.stop)
            reasons = [json.loads(b)["reason"] for b in cap.bodies]
            assert len(reasons) == len(set(reasons)) == 2000
        finally:
            pump.kill()
    logs = pump.logs()
    assert '"service": "outbox-pump"' in logs, "logs are structured JSON"


async def _published_some(pool) -> bool:
    return await _count(pool, "published") > 0


async def _all_published(pool, n: int) -> bool:
    return await _count(pool, "published") == n


async def _delivered(cap, n: int) -> bool:
    return len(cap.messages) >= n


async def _wait_deliveries(cap, n: int) -> int:
    await eventually(lambda: _delivered(cap, n), timeout=15, message=f"{n} deliveries")
    return len(cap.messages)


async def test_pump_metrics_endpoint_exposes_outbox_metrics(settings, tmp_path: Path, amqp) -> None:
    pump = ServiceProcess("outbox-pump", service_env(settings), log_dir=tmp_path)
    await asyncio.to_thread(pump.start)
    try:
        status, body = await asyncio.to_thread(_get, pump.url + "/metrics")
        text = body.decode()
        assert status == 200
        assert "outbox_depth" in text and "outbox_commit_to_publish_ms_bucket" in text
        status, _ = await asyncio.to_thread(_get, pump.url + "/healthz")
        assert status == 200
    finally:
        assert await asyncio.to_thread(pump.stop) == 0
