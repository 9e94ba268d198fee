"""Hot-reloaded operator settings (`dispatch_settings` table): defaults here, overrides in the table.

Hot paths read them through `SettingsCache` (re-read at most every second or few, in the background), so
`monitorctl budgets set` and friends take effect within seconds without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import msgspec
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.domain.lanes import MONITOR_LANE_NAMES
from libs.domain.rollout import DEFAULT_RAMP, RampError, parse_ramp

log = logging.getLogger("dispatch_settings")

# The lanes an operator may pause (`monitorctl lane pause`), from the lane table (libs/domain/lanes.py).
LANES: tuple[str, ...] = tuple(sorted(MONITOR_LANE_NAMES))


@dataclass(frozen=True, slots=True)
class DispatchSettings:
    # Budgets (docs/architecture.md §9.2)
    cluster_dispatch_per_minute: int = 300
    tenant_dispatch_per_minute: int = 30
    # Share of dispatches kept for normal work while high is busy (§9.3: 10-20%).
    normal_background_share: float = 0.15
    # Length of a budget window (§9.2: one minute); the budgets above are per window.
    budget_window_seconds: int = 60
    # Share of each window's cluster budget only high work may use (collect-now headroom).
    high_reserved_share: float = 0.10
    # Retry lane enters only while high and the tenant's normal backlog are at or below this (§9.3).
    retry_low_watermark: int = 100
    # Coordinator pacing: executions per dispatch transaction, plans per scanner batch, safety-net tick.
    dispatch_batch_size: int = 500
    scan_batch_size: int = 2000
    dispatch_tick_ms: int = 1000
    # Full passes woken by events (completions, new tasks) start at most this often: a burst of completions
    # shares one pass instead of a pass each (high work never waits for it).
    dispatch_min_interval_ms: int = 100
    paused_lanes: tuple[str, ...] = ()
    # Auto slow-down thresholds (§12.4)
    auto_slowdown_enabled: bool = True
    ingest_lag_threshold_ms: int = 30_000
    projection_lag_threshold_ms: int = 60_000
    db_write_p95_threshold_ms: int = 500
    conflict_rate_threshold: float = 0.05
    # Aging (§9.4)
    aging_interval_seconds: int = 30
    aging_fraction: float = 0.10
    aging_cap: int = 900
    # Execution
    max_dispatch_attempts: int = 3
    lease_ttl_seconds: int = 120
    heartbeat_timeout_seconds: int = 30
    unknown_grace_seconds: int = 120
    # Collect-now (§10.6, §15.3)
    request_ttl_seconds: int = 300
    request_no_dispatch_warn_seconds: int = 30
    idempotency_window_seconds: int = 300
    max_active_requests_per_tenant: int = 2
    max_requests_per_user_per_hour: int = 20
    # The most business tasks (questions x platforms of the day) one collect-now may promote; larger is refused.
    collect_now_max_scope_tasks: int = 500
    # Phase 2 rollout (§16.2.2): tenant_id % 100 < rollout_percentage -> desktop_tasks
    rollout_percentage: int = 100
    reconcile_interval_seconds: int = 300
    # Interrupt timeouts from measured safe points (libs/domain/safe_points.py): the P95's window, how often a
    # dynamic platform's timeouts may change (weekly), and the fewest samples that may change them.
    safe_point_window_days: int = 7
    interrupt_tuning_interval_seconds: int = 604_800
    safe_point_min_samples: int = 100
    # Ceilings (§9.2, the circuit-breaker column): no budget or limit can be set above its ceiling, and a
    # ceiling changes only through its own command (`monitorctl budgets set-ceiling`), never by `budgets set`.
    cluster_dispatch_per_minute_ceiling: int = 500
    tenant_dispatch_per_minute_ceiling: int = 60
    client_max_concurrent_ceiling: int = 4
    client_max_queue_depth_ceiling: int = 40
    platform_max_concurrent_ceiling: int = 2
    # The guarded rollout ramp (§16.2.2, libs/domain/rollout.py): its steps and dwells, and the gates each step
    # must hold for its dwell before `monitorctl rollout advance` takes the next one.
    rollout_ramp: str = DEFAULT_RAMP
    rollout_gate_preempt_success_min: float = 0.95
    rollout_gate_min_preemptions: int = 10
    rollout_gate_ingest_lag_ms: int = 30_000
    rollout_gate_max_reconcile_fixes: int = 0
    rollout_gate_max_orphans: int = 0
    # §10.5 bounds on the measured safe points: a client's samples count once it has this many, and a platform is
    # tuned from the median of its clients' P95s only with this many such clients (libs/domain/safe_points.py).
    safe_point_min_client_samples: int = 20
    safe_point_min_clients: int = 3


_TYPES = {f.name: f.type for f in fields(DispatchSettings)}
_DEFAULTS = DispatchSettings()

# What each ceiling bounds: dispatch settings by key, and per-client / per-platform limits by name.
CEILING_OF: dict[str, str] = {
    "cluster_dispatch_per_minute": "cluster_dispatch_per_minute_ceiling",
    "tenant_dispatch_per_minute": "tenant_dispatch_per_minute_ceiling",
    "client.max_concurrent": "client_max_concurrent_ceiling",
    "client.max_queue_depth": "client_max_queue_depth_ceiling",
    "platform.max_concurrent": "platform_max_concurrent_ceiling",
}
CEILINGS = frozenset(CEILING_OF.values())


class SettingError(ValueError):
    pass


def check_ceiling(settings: DispatchSettings, what: str, value: int) -> None:
    """Refuse a budget or limit above its ceiling, naming both and the command that raises the ceiling."""
    ceiling_key = CEILING_OF.get(what)
    if ceiling_key is None:
        return
    ceiling = int(getattr(settings, ceiling_key))
    if value > ceiling:
        raise SettingError(f"{what} = {value} is above its ceiling {ceiling}; raising a ceiling is a deliberate "
                           f"step of its own: `monitorctl budgets set-ceiling {ceiling_key} {value}`")


def check_budget_coupling(settings: DispatchSettings) -> None:
    """§9.2's coupling rule "cluster budget > sum of tenant budgets", as `budgets set` can hold it: the cluster's
    per-window budget must stay above the sum of the budgets of the tenants that can reach it at once. Read literally
    over every tenant, the rule would cap the installation at cluster / tenant tenants (10 with the defaults), so it is
    held for the one tenant a `budgets set` always knows about: a single tenant's budget is strictly below the
    cluster's, so no one tenant ever exhausts the cluster window and leaves nothing for the others or for
    collect-now. Across many busy tenants the cluster budget is the one that binds (`budget_sum_warning`)."""
    if settings.tenant_dispatch_per_minute >= settings.cluster_dispatch_per_minute:
        raise SettingError(
            f"tenant_dispatch_per_minute = {settings.tenant_dispatch_per_minute} must stay below "
            f"cluster_dispatch_per_minute = {settings.cluster_dispatch_per_minute} (§9.2: the cluster budget exceeds "
            "the sum of the tenant budgets; one tenant alone must not be able to use the whole cluster window)")


def budget_sum_warning(settings: DispatchSettings, active_tenants: int) -> str | None:
    """The literal §9.2 sum over the tenants that dispatched lately: when their budgets add up past the cluster's,
    say so (not an error: the cluster budget then binds, shared round-robin, with the high reserve kept)."""
    total = settings.tenant_dispatch_per_minute * active_tenants
    if active_tenants > 1 and total >= settings.cluster_dispatch_per_minute:
        return (f"{active_tenants} tenants dispatched in the last two budget windows; their budgets sum to {total} "
                f">= cluster_dispatch_per_minute {settings.cluster_dispatch_per_minute}: the cluster budget binds "
                f"first (about {settings.cluster_dispatch_per_minute // active_tenants} a tenant when all are busy)")
    return None


def check_new_ceiling(settings: DispatchSettings, ceiling_key: str, value: int) -> None:
    """A ceiling may be lowered, but not below what its budget is set to now (lower the budget first)."""
    if ceiling_key not in CEILINGS:
        raise SettingError(f"{ceiling_key!r} is not a ceiling; ceilings: {', '.join(sorted(CEILINGS))}")
    bounded = next(what for what, key in CEILING_OF.items() if key == ceiling_key)
    if bounded in _TYPES and value < int(getattr(settings, bounded)):
        raise SettingError(f"{ceiling_key} = {value} is below {bounded} = {getattr(settings, bounded)}; "
                           f"lower {bounded} first")


def coerce(key: str, value: Any) -> Any:
    """Validate one setting's value; raises SettingError naming the key."""
    if key not in _TYPES:
        raise SettingError(f"unknown setting {key!r}; known: {', '.join(sorted(_TYPES))}")
    default = getattr(_DEFAULTS, key)
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                value = value.lower() in {"1", "true", "yes", "on"}
            return bool(value)
        if isinstance(default, int):
            number = int(value)
            if number < 0:
                raise SettingError(f"{key} must be >= 0")
            if key == "rollout_percentage" and number > 100:
                raise SettingError("rollout_percentage must be between 0 and 100")
            return number
        if isinstance(default, float):
            number_f = float(value)
            if not 0 <= number_f <= 1:
                raise SettingError(f"{key} must be between 0 and 1")
            return number_f
        if isinstance(default, tuple):
            items = value.split(",") if isinstance(value, str) else list(value)
            lanes = tuple(sorted({str(i).strip() for i in items if str(i).strip()}))
            bad = [lane for lane in lanes if lane not in LANES]
            if bad:
                raise SettingError(f"{key}: unknown lane(s) {bad}; lanes are {LANES}")
            return lanes
        if key == "rollout_ramp":
            parse_ramp(str(value))
            return str(value)
    except RampError as exc:
        raise SettingError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, SettingError):
            raise
        raise SettingError(f"{key}: {value!r} is not a valid {type(default).__name__}") from exc
    return value


def from_rows(rows: dict[str, Any]) -> DispatchSettings:
    overrides = {}
    for key, value in rows.items():
        if key in _TYPES:
            try:
                overrides[key] = coerce(key, value)
            except SettingError:
                continue  # a bad stored value never stops dispatch: the default stands
    return replace(_DEFAULTS, **overrides)


async def load_settings(conn: Conn) -> DispatchSettings:
    cur = await conn.execute("SELECT key, value FROM dispatch_settings")
    return from_rows({row["key"]: row["value"] for row in await cur.fetchall()})


async def set_setting(conn: Conn, key: str, value: Any) -> Any:
    """Store one setting (in the caller's transaction), unchecked against ceilings: operators go through
    `services/dispatch_coordinator/admin.py`, which checks them."""
    coerced = coerce(key, value)
    await conn.execute(
        "INSERT INTO dispatch_settings (key, value, updated_at) VALUES (%(key)s, %(value)s, now()) "
        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()",
        {"key": key, "value": msgspec.json.encode(coerced).decode()},
    )
    return coerced


def as_dict(settings: DispatchSettings) -> dict[str, Any]:
    return asdict(settings)


class SettingsCache:
    """`dispatch_settings` re-read at most every `max_age_s`, for hot paths (a collect-now request, a dispatch
    pass, a lease). Once a value is loaded, a stale one is served while a single re-read runs in the background,
    so no request waits for it; a change is in effect within about `max_age_s`. With a pool the re-read uses its
    own connection; without one (or for the very first read) it runs inline on the caller's `conn`."""

    def __init__(self, pool: AsyncConnectionPool[Conn] | None = None, *, max_age_s: float = 1.0,
                 name: str = "dispatch settings") -> None:
        self._pool = pool
        self.max_age_s = max_age_s
        self._name = name
        self._value: DispatchSettings | None = None
        self._loaded_at = 0.0
        self._refreshing: asyncio.Task[None] | None = None

    async def get(self, conn: Conn | None = None) -> DispatchSettings:
        if self._value is None:
            await self._load(conn)
        elif time.monotonic() - self._loaded_at > self.max_age_s:
            if self._pool is None:
                await self._load(conn)
            elif self._refreshing is None:
                self._refreshing = asyncio.create_task(self._refresh(), name=f"refresh {self._name}")
        assert self._value is not None
        return self._value

    async def reload(self, conn: Conn | None = None) -> DispatchSettings:
        """Re-read now and wait for it (a caller that must see a change it just made)."""
        await self._load(conn)
        assert self._value is not None
        return self._value

    async def _load(self, conn: Conn | None) -> None:
        if conn is not None:
            fresh = await load_settings(conn)
        else:
            if self._pool is None:
                raise RuntimeError("SettingsCache without a pool needs the caller's connection")
            async with self._pool.connection() as own:
                fresh = await load_settings(own)
        if self._value is not None and fresh != self._value:
            old = as_dict(self._value)
            log.info(f"{self._name} changed", extra={
                "changed": {k: v for k, v in as_dict(fresh).items() if old.get(k) != v}})
        self._value, self._loaded_at = fresh, time.monotonic()

    async def _refresh(self) -> None:
        try:
            await self._load(None)
        except Exception as exc:  # keep serving the last value; the next get() tries again
            log.warning(f"re-reading {self._name} failed", extra={"error": str(exc)[:300]})
        finally:
            self._refreshing = None
