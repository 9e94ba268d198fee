"""Schedule scanner (seed §9.1): due plans become business tasks in bounded batches, idempotently."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.domain.lanes import NORMAL_PRIORITY
from libs.domain.schedule import execution_owner_for, plan_occurrence
from libs.domain.shard import ingest_shard_key
from libs.telemetry import metrics
from services.dispatch_coordinator import queries as q


@dataclass(slots=True)
class ScanResult:
    plans: int = 0
    created: int = 0
    # (tenant_id, ai_platform_id) pairs of new desktop_tasks-path work.
    pairs: set[tuple[int, int]] = field(default_factory=set)


async def scan_once(pool: AsyncConnectionPool[Conn], *, batch_size: int, rollout_percentage: int) -> ScanResult:
    """One batch: lock due plans (SKIP LOCKED), create one task per plan for its latest due slot
    (ON CONFLICT on the business key DO NOTHING), advance each plan past now, all in one transaction."""
    result = ScanResult()
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(q.DUE_PLANS, {"limit": batch_size})
        plans = await cur.fetchall()
        if not plans:
            return result
        cur = await conn.execute("SELECT now() AS now")
        row = await cur.fetchone()
        assert row is not None
        now: datetime = row["now"]
        cols: dict[str, list[object]] = {k: [] for k in (
            "tenant_ids", "workspace_ids", "brand_ids", "question_ids", "platform_ids", "collector_types",
            "run_modes", "dates", "plan_ids", "shard_keys", "owners")}
        next_runs: list[datetime] = []
        for p in plans:
            occurrence = plan_occurrence(p["next_run_at"], p["interval_seconds"], now, p["time_zone"])
            cols["tenant_ids"].append(p["tenant_id"])
            cols["workspace_ids"].append(p["workspace_id"])
            cols["brand_ids"].append(p["brand_id"])
            cols["question_ids"].append(p["question_id"])
            cols["platform_ids"].append(p["ai_platform_id"])
            cols["collector_types"].append(p["collector_type"])
            cols["run_modes"].append(p["run_mode"])
            cols["dates"].append(occurrence.business_date)
            cols["plan_ids"].append(p["id"])
            cols["shard_keys"].append(ingest_shard_key(p["tenant_id"], p["brand_id"], occurrence.business_date))
            cols["owners"].append(execution_owner_for(p["tenant_id"], rollout_percentage))
            next_runs.append(occurrence.next_run_at)
        cur = await conn.execute(q.CREATE_TASKS, {**cols, "priority": NORMAL_PRIORITY})
        created = await cur.fetchall()
        await conn.execute(q.ADVANCE_PLANS, {"ids": [p["id"] for p in plans], "next": next_runs})
    result.plans = len(plans)
    result.created = len(created)
    for r in created:
        metrics.dispatch_scanner_tasks_created_count.inc(execution_owner=r["execution_owner"])
        if r["execution_owner"] == "desktop_tasks":
            result.pairs.add((r["tenant_id"], r["ai_platform_id"]))
    metrics.dispatch_scanner_plans_count.inc(len(plans))
    return result
