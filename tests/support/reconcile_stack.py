"""The whole stack as real processes for the reconcile end-to-end scenarios, with short timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp

from libs.auth import TenantPrincipal, issue_gateway_jwt
from libs.config import Settings
from libs.db.pool import Conn
from libs.dispatch_settings import set_setting
from libs.mq.topology import Topology, delete_all
from tests.support.procs import ServiceProcess, service_env

# >= 32 bytes: PyJWT warns about shorter HMAC keys (and warnings are errors in the suite).
JWT_SECRET = "reconciler-e2e-gateway-secret-0123456789"

SERVICES = ("outbox-pump", "dispatch-coordinator", "dispatch-hub", "collect-now-api", "ingest-shard-workers",
            "reconciler")

# Seconds, small enough for every scenario to end within a minute.
FAST_SETTINGS: dict[str, Any] = {
    "lease_ttl_seconds": 3,
    "heartbeat_timeout_seconds": 3,
    "unknown_grace_seconds": 10,
    "request_no_dispatch_warn_seconds": 2,
    "max_dispatch_attempts": 5,
    "cluster_dispatch_per_minute": 5000,
    "tenant_dispatch_per_minute": 5000,
}
FAST_ENV: dict[str, str | int] = {
    "HEARTBEAT_TIMEOUT_SECONDS": 3,
    "LEASE_TTL_SECONDS": 3,
    "HUB_PING_INTERVAL_S": "0.5",
    "HUB_HEARTBEAT_FLUSH_S": "0.3",
    "RECONCILER_INTERVALS": ("expired_leases=0.5,request_ttl=0.5,offline_clients=0.5,interrupt_timeouts=0.5,"
                             "unknown_executions=1,business_day_expiry=5"),
}


@dataclass
class Stack:
    settings: Settings
    procs: dict[str, ServiceProcess] = field(default_factory=dict)

    @property
    def hub_url(self) -> str:
        return self.procs["dispatch-hub"].url

    @property
    def api_url(self) -> str:
        return self.procs["collect-now-api"].url

    async def collect_now(self, *, tenant_id: int, workspace_id: int, user_id: int, brand_id: int,
                          body: dict[str, Any] | None = None) -> dict[str, Any]:
        jwt = issue_gateway_jwt(self.settings.gateway_jwt_secret,
                                TenantPrincipal(tenant_id=tenant_id, workspace_id=workspace_id, user_id=user_id))
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.api_url}/api/tenant/monitoring/brands/{brand_id}/collect-now", json=body or {},
                headers={"Authorization": f"Bearer {jwt}"}) as resp:
            payload: dict[str, Any] = await resp.json()
            assert resp.status in (200, 201, 202), (resp.status, payload)
            return payload

    async def metric(self, service: str, sample: str) -> float:
        """A sample's value from a service's /metrics (`name{labels}` as printed), 0 when absent."""
        async with aiohttp.ClientSession() as session, session.get(self.procs[service].url + "/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        return 0.0

    def logs(self) -> str:
        return "\n".join(f"===== {name}\n{proc.logs()[-6000:]}" for name, proc in self.procs.items())


async def configure(conn: Conn, **overrides: Any) -> None:
    for key, value in {**FAST_SETTINGS, **overrides}.items():
        await set_setting(conn, key, value)


@contextlib.asynccontextmanager
async def running_stack(settings: Settings, log_dir: Path, *, services: tuple[str, ...] = SERVICES,
                        **env: str | int) -> AsyncIterator[Stack]:
    settings = replace(settings, gateway_jwt_secret=JWT_SECRET)
    stack = Stack(settings)
    base = service_env(settings, **{**FAST_ENV, **env})
    try:
        for name in services:
            stack.procs[name] = ServiceProcess(name, base, log_dir=log_dir)
        # In parallel: each waits for its own /readyz; they find each other through Postgres and RabbitMQ.
        await asyncio.gather(*(asyncio.to_thread(proc.start) for proc in stack.procs.values()))
        yield stack
    finally:
        for proc in reversed(stack.procs.values()):
            await asyncio.to_thread(proc.stop)
        await _delete_topology(settings)


async def _delete_topology(settings: Settings) -> None:
    """The services declared this test's prefixed queues (quorum ones too): remove them, so the shared
    broker does not accumulate a test's worth of queues every run."""
    with contextlib.suppress(Exception):
        connection = await asyncio.wait_for(aio_pika.connect(settings.amqp_url), 10)
        try:
            async with connection.channel() as channel:
                await asyncio.wait_for(delete_all(channel, Topology(settings.mq_prefix, settings.ingest_shards)), 30)
        finally:
            await connection.close()
