"""What the reconcile end-to-end scenarios run on top of `tests.support.stack`: the reconciler too,
and timeouts short enough for every scenario to end within a minute."""

from __future__ import annotations

from typing import Any

from libs.db.pool import Conn
from libs.dispatch_settings import set_setting
from tests.support.stack import DISPATCH_SERVICES

SERVICES = (*DISPATCH_SERVICES, "reconciler")

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


async def configure(conn: Conn, **overrides: Any) -> None:
    for key, value in {**FAST_SETTINGS, **overrides}.items():
        await set_setting(conn, key, value)
