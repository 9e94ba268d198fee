"""Schedule scanner (docs/architecture.md §9.1): due plans become business tasks in bounded batches, idempotently."""

from __future__ import annotations

from dataclasses import dataclass, field

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.domain.lanes import NORMAL_PRIORITY
from libs.tasks import business
from libs.telemetry import metrics
from services.dispatch_coordinator import queries as q


@dataclass(slots=True)
class ScanResult:
    plans: int = 0
    created: int = 0
    # (tenant_id, ai_platform_id) pairs of new desktop_tasks-path work.
    pairs: set[tuple[int, int]] = field(default_factory=set)


_zones: list[str] | None = None


async def _known_zones(conn: Conn) -> list[str]:
    global _zones
    if _zones is None:
        cur = await conn.execute(q.TIME_ZONES)
        row = await cur.fetchone()
        assert row is not None
        _zones = sorted(row["names"] or [])
    return _zones


async def scan_once(pool: AsyncConnectionPool[Conn], *, batch_size: int, rollout_percentage: int) -> ScanResult:
    """One batch, one statement: lock due plans (SKIP LOCKED), create one task per plan for its latest due
    slot (ON CONFLICT on the business key DO NOTHING), advance each plan past now."""
    result = ScanResult()
    async with pool.connection() as conn:
        zones = await _known_zones(conn)
        batch = await business.scan_due_plans(conn, limit=batch_size, zones=zones, priority=NORMAL_PRIORITY,
                                              rollout_percentage=rollout_percentage)
    result.plans = batch.plans
    for group in batch.created:
        result.created += group.n
        metrics.dispatch_scanner_tasks_created_count.inc(group.n, execution_owner=group.execution_owner)
        if group.execution_owner == "desktop_tasks":
            result.pairs.add((group.tenant_id, group.ai_platform_id))
    if result.plans:
        metrics.dispatch_scanner_plans_count.inc(result.plans)
    return result
