"""Platform-health pause: a platform whose login is broken on a client gets no scheduled work there.

Clients report their login state per platform in every heartbeat (`platform_health`, e.g.
`{"openai": "login_required", "gemini": "healthy"}`; the hub stores the latest report). Dispatch reads it:

- A client that reports a blocking state for a platform (`login_required`, `captcha`, `rate_limited`) gets no
  normal, boosted or retry work of that platform; its other platforms keep flowing, and an unbound task of
  that platform goes to another client of the tenant whose login works. A platform the client has not
  reported (or reports `healthy`, `degraded`, `unknown`) is dispatched as before. High work (a user's
  collect-now) is not held back: the user asked for it, and the client may fix its login.
- When every eligible client of a tenant blocks a platform, the tenant's platform is paused (automatically);
  the pass then does not even read its candidates, and `monitorctl status` and the metric
  `monitor_tenant_platform_paused{tenant_id,platform,source}` show it. It resumes as soon as one client
  reports the login working again (within a heartbeat flush and a pass: seconds).
- An operator's override per (tenant, platform) wins: `pause` holds the tenant's scheduled work of that
  platform whatever the clients report; `ignore_health` dispatches it whatever they report (a client stuck
  reporting a stale state). `monitorctl platform health-override`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal
from uuid import UUID

BLOCKING_STATES: frozenset[str] = frozenset({"login_required", "captcha", "rate_limited"})
OverrideMode = Literal["pause", "ignore_health"]
PauseSource = Literal["health", "operator"]


def blocked_platforms(health: Mapping[str, str] | None, platform_ids: Mapping[str, int], *,
                      ignored: Iterable[int] = ()) -> frozenset[int]:
    """The platform ids a client's report blocks (codes it does not know, and ignored platforms, block nothing)."""
    if not health:
        return frozenset()
    skip = set(ignored)
    return frozenset(pid for code, state in health.items()
                     if state in BLOCKING_STATES and (pid := platform_ids.get(code)) is not None and pid not in skip)


@dataclass(frozen=True, slots=True)
class ClientHealth:
    client_id: UUID
    tenant_id: int
    blocked: frozenset[int]


def paused_pairs(clients: Iterable[ClientHealth], overrides: Mapping[tuple[int, int], OverrideMode],
                 platforms: Iterable[int]) -> dict[tuple[int, int], PauseSource]:
    """(tenant, platform) pairs whose scheduled work is held: every eligible client of the tenant blocks the
    platform (`health`), or an operator paused it (`operator`); `ignore_health` lifts the former."""
    by_tenant: dict[int, list[frozenset[int]]] = {}
    for client in clients:
        by_tenant.setdefault(client.tenant_id, []).append(client.blocked)
    paused: dict[tuple[int, int], PauseSource] = {}
    for tenant_id, blocked_sets in by_tenant.items():
        for platform_id in platforms:
            if all(platform_id in blocked for blocked in blocked_sets):
                paused[(tenant_id, platform_id)] = "health"
    for pair, mode in overrides.items():
        if mode == "pause":
            paused[pair] = "operator"
        elif mode == "ignore_health" and paused.get(pair) == "health":
            del paused[pair]
    return paused
