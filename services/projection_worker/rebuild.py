"""One projection rebuild: claim a coalesced key, recompute it from raw facts, release or delete it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Literal

from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.telemetry import metrics as m
from services.projection_worker import queries as q

log = logging.getLogger("projection.rebuild")

Trigger = Literal["event", "sweep"]


@dataclass(frozen=True, slots=True)
class Claim:
    tenant_id: int
    brand_id: int
    business_date: date
    request_count: int
    last_requested_at: datetime

    @property
    def key(self) -> dict[str, object]:
        return {"tenant_id": self.tenant_id, "brand_id": self.brand_id, "business_date": self.business_date}


@dataclass(frozen=True, slots=True)
class ProjectionConfig:
    instance_id: str
    lease_s: float = 30.0
    max_attempts: int = 10
    sweep_batch: int = 50


class ClaimLost(Exception):
    """The claim expired and another worker took the key: this rebuild is rolled back."""


def _claim(row: dict[str, Any]) -> Claim:
    return Claim(tenant_id=int(row["tenant_id"]), brand_id=int(row["brand_id"]), business_date=row["business_date"],
                 request_count=int(row["request_count"]), last_requested_at=row["last_requested_at"])


class Rebuilder:
    def __init__(self, pool: AsyncConnectionPool[Conn], config: ProjectionConfig) -> None:
        self.pool = pool
        self.config = config

    def _claim_params(self) -> dict[str, object]:
        return {"me": self.config.instance_id, "lease_s": self.config.lease_s,
                "max_attempts": self.config.max_attempts}

    async def claim_key(self, tenant_id: int, brand_id: int, business_date: date) -> Claim | None:
        async with self.pool.connection() as conn:
            cur = await conn.execute(q.CLAIM_KEY, {**self._claim_params(), "tenant_id": tenant_id,
                                                   "brand_id": brand_id, "business_date": business_date})
            row = await cur.fetchone()
        return None if row is None else _claim(row)

    async def claim_oldest(self, limit: int) -> list[Claim]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(q.CLAIM_OLDEST, {**self._claim_params(), "limit": limit})
            return [_claim(row) for row in await cur.fetchall()]

    async def rebuild(self, claim: Claim, trigger: Trigger) -> bool:
        """Recompute the key and finish the claim in one transaction. True when the request was served
        completely (row deleted); False when it was requested again meanwhile (row kept, unclaimed)."""
        started = time.monotonic()
        params = {**claim.key, "me": self.config.instance_id, "request_count": claim.request_count,
                  "last_requested_at": claim.last_requested_at}
        try:
            async with self.pool.connection() as conn, conn.transaction():
                cur = await conn.execute(q.REBUILD_KEY, params)
                stats = await cur.fetchone()
                cur = await conn.execute(q.COMPLETE_CLAIM, params)
                served = await cur.fetchone() is not None
                if not served:
                    cur = await conn.execute(q.RELEASE_RE_REQUESTED, params)
                    if await cur.fetchone() is None:
                        raise ClaimLost(f"claim on {claim.key} lost")
        except ClaimLost:
            log.warning("projection claim lost; rebuild rolled back", extra=_log_key(claim))
            return False
        except Exception:
            m.projection_rebuild_failed_count.inc()
            await self._release_failed(claim)
            raise
        m.projection_rebuild_count.inc(trigger=trigger)
        m.projection_rebuild_duration_ms.observe((time.monotonic() - started) * 1000)
        if not served:
            m.projection_rebuild_rerequested_count.inc()
        log.debug("projection rebuilt", extra={**_log_key(claim), "trigger": trigger, "served": served,
                                               "runs": stats["runs"] if stats else 0})
        return served

    async def _release_failed(self, claim: Claim) -> None:
        try:
            async with self.pool.connection() as conn:
                await conn.execute(q.RELEASE_FAILED, {**claim.key, "me": self.config.instance_id})
        except Exception:
            log.warning("could not release a failed claim; it expires by itself", extra=_log_key(claim))

    async def queue_stats(self) -> tuple[int, float]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(q.QUEUE_STATS)
            row = await cur.fetchone()
        return (0, 0.0) if row is None else (int(row["depth"]), max(0.0, float(row["lag_ms"])))


def _log_key(claim: Claim) -> dict[str, object]:
    return {"tenant_id": claim.tenant_id, "brand_id": claim.brand_id,
            "business_date": claim.business_date.isoformat()}
