"""The whole stack as real service processes, for end-to-end tests and the collect-now benchmark."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp

from libs.auth import TenantPrincipal
from libs.config import Settings
from libs.mq.topology import Topology, delete_all
from tests.support.collect_now import gateway_token
from tests.support.procs import ServiceProcess, service_env

# Everything a click needs to reach a desktop and its result to reach the raw facts.
DISPATCH_SERVICES = ("outbox-pump", "dispatch-coordinator", "dispatch-hub", "collect-now-api", "ingest-shard-workers")
ACCEPTED = (200, 201, 202)


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

    def jwt(self, who: TenantPrincipal | Mapping[str, Any]) -> str:
        """A gateway JWT for a principal, or for a `seed_demo` tenant (its tenant, workspace and user ids)."""
        principal = who if isinstance(who, TenantPrincipal) else TenantPrincipal(
            tenant_id=who["tenant_id"], workspace_id=who["workspace_id"], user_id=who["user_id"])
        return gateway_token(principal, self.settings.gateway_jwt_secret)

    async def collect_now(self, who: TenantPrincipal | Mapping[str, Any], brand_id: int,
                          body: dict[str, Any] | None = None, *,
                          expect: tuple[int, ...] = ACCEPTED) -> dict[str, Any]:
        """Click collect-now as `who`; the response body, after asserting its status is in `expect`."""
        async with aiohttp.ClientSession() as http, http.post(
                f"{self.api_url}/api/tenant/monitoring/brands/{brand_id}/collect-now", json=body or {},
                headers={"Authorization": f"Bearer {self.jwt(who)}"}) as resp:
            payload: dict[str, Any] = await resp.json()
            assert resp.status in expect, (resp.status, payload)
            return payload

    async def metric(self, service: str, sample: str) -> float:
        """A sample's value from a service's /metrics (`name{labels}` as printed), 0 when absent."""
        async with aiohttp.ClientSession() as http, http.get(self.procs[service].url + "/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        return 0.0

    def logs(self) -> str:
        return "\n".join(f"===== {name}\n{proc.logs()[-6000:]}" for name, proc in self.procs.items())


@contextlib.asynccontextmanager
async def running_stack(settings: Settings, log_dir: Path, *, services: tuple[str, ...] = DISPATCH_SERVICES,
                        per_service: Mapping[str, Mapping[str, str]] | None = None,
                        **env: str | int) -> AsyncIterator[Stack]:
    """`services` as processes configured from `settings` plus `env` overrides (and a service's own in
    `per_service`, e.g. its credentials); stopped in reverse order, and the test's prefixed broker topology
    deleted, on the way out."""
    stack = Stack(settings)
    base = service_env(settings, **env)
    try:
        for name in services:
            stack.procs[name] = ServiceProcess(name, {**base, **(per_service or {}).get(name, {})}, log_dir=log_dir)
        # In parallel: each waits for its own /readyz; they find each other through Postgres and RabbitMQ.
        # Every start is let finish before a failure is raised, so none is still starting while we stop.
        started = await asyncio.gather(*(asyncio.to_thread(proc.start) for proc in stack.procs.values()),
                                       return_exceptions=True)
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
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
