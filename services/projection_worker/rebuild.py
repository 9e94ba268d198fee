"""Projection rebuilds: claim coalesced keys, recompute them from raw facts, release or delete the requests.

One key per transaction normally; in merge mode (auto slow-down) a batch of keys in one transaction. A key
whose rebuild fails for a reason that is not transient (a poison key) is released with its attempt counted
and the keys claimed with it go on; it is retried until `max_attempts`, then left in the queue table for an
operator. A transient failure (connection, deadlock, lock timeout) gives back every key not yet rebuilt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Literal

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from libs.coordinator_state import read_coordinator_state
from libs.db.pool import Conn
from libs.db.write_health import WriterHealth
from libs.mq.poison import describe_failure, is_transient
from libs.telemetry import metrics as m
from libs.telemetry import tracing
from services.projection_worker import queries as q

log = logging.getLogger("projection.rebuild")

Trigger = Literal["event", "sweep", "merge"]


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

    @property
    def key_tuple(self) -> tuple[int, int, date]:
        return self.tenant_id, self.brand_id, self.business_date


@dataclass(frozen=True, slots=True)
class MergeOutcome:
    """One merged batch: keys rebuilt (committed), of which `served` were deleted and `rerequested`
    kept unclaimed for the next pass; `lost` claims were taken over by another worker (not written)."""

    rebuilt: int = 0
    served: int = 0
    rerequested: int = 0
    lost: int = 0


@dataclass(frozen=True, slots=True)
class ProjectionConfig:
    instance_id: str
    lease_s: float = 30.0
    max_attempts: int = 10
    sweep_batch: int = 50


class ClaimLost(Exception):
    """The claim expired and another worker took the key: this rebuild is rolled back."""


class _ClaimsLost(Exception):
    def __init__(self, claims: list[Claim]) -> None:
        super().__init__(f"{len(claims)} claims lost")
        self.claims = claims


def _claim(row: dict[str, Any]) -> Claim:
    return Claim(tenant_id=int(row["tenant_id"]), brand_id=int(row["brand_id"]), business_date=row["business_date"],
                 request_count=int(row["request_count"]), last_requested_at=row["last_requested_at"])


class Rebuilder:
    def __init__(self, pool: AsyncConnectionPool[Conn], config: ProjectionConfig,
                 write_health: WriterHealth | None = None) -> None:
        self.pool = pool
        self.config = config
        self.write_health = write_health or WriterHealth("projection", config.instance_id)

    def _claim_params(self) -> dict[str, object]:
        return {"me": self.config.instance_id, "lease_s": self.config.lease_s,
                "max_attempts": self.config.max_attempts}

    async def claim_key(self, tenant_id: int, brand_id: int, business_date: date) -> Claim | None:
        async with self.pool.connection() as conn:
            cur = await conn.execute(q.CLAIM_KEY, {**self._claim_params(), "tenant_id": tenant_id,
                                                   "brand_id": brand_id, "business_date": business_date})
            row = await cur.fetchone()
        return None if row is None else _claim(row)

    async def claim_oldest(self, limit: int, *, skip: Collection[tuple[int, int, date]] = ()) -> list[Claim]:
        """Up to `limit` claimable keys, tenants taking turns (each tenant's own keys oldest first), in turn
        order: one tenant's burst of keys cannot fill a claim round, sweep or merge batch while other tenants wait.
        Keys in `skip` are not taken."""
        keys = list(skip)
        async with self.pool.connection() as conn:
            cur = await conn.execute(q.CLAIM_FAIR, {
                **self._claim_params(), "limit": limit, "skip_tenants": [k[0] for k in keys],
                "skip_brands": [k[1] for k in keys], "skip_dates": [k[2] for k in keys]})
            return [_claim(row) for row in await cur.fetchall()]

    async def claimable(self, keys: Collection[tuple[int, int, date]]) -> set[tuple[int, int, date]]:
        """Which of `keys` a claim can take now (queued, not claimed, attempts left)."""
        if not keys:
            return set()
        listed = list(keys)
        async with self.pool.connection() as conn:
            cur = await conn.execute(q.KEYS_CLAIMABLE, {
                "tenant_ids": [k[0] for k in listed], "brand_ids": [k[1] for k in listed],
                "dates": [k[2] for k in listed], "max_attempts": self.config.max_attempts})
            return {_row_key(row) for row in await cur.fetchall()}

    @tracing.traced("projection.rebuild")
    async def rebuild(self, claim: Claim, trigger: Trigger) -> bool:
        """Recompute the key and finish the claim in one transaction. True when the request was served
        completely (row deleted); False when it was requested again meanwhile (row kept, unclaimed)."""
        tracing.set_attributes(trigger=trigger, **claim.key)
        started = time.monotonic()
        params = {**claim.key, "me": self.config.instance_id, "request_count": claim.request_count,
                  "last_requested_at": claim.last_requested_at}
        try:
            async with self.write_health.timed(), self.pool.connection() as conn, conn.transaction():
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

    @tracing.traced("projection.merge")
    async def rebuild_merged(self, claims: list[Claim]) -> MergeOutcome:
        """Recompute every claimed key with one statement and finish every claim, all in one transaction
        (merge mode). A key requested again since its claim is kept, unclaimed, as in `rebuild`. When
        some claims were taken over meanwhile, the batch is rolled back and redone without them."""
        tracing.set_attributes(keys=len(claims))
        held = list(dict.fromkeys(claims))
        lost = 0
        started = time.monotonic()
        while held:
            try:
                served, rerequested = await self._merge_transaction(held)
            except _ClaimsLost as exc:
                lost += len(exc.claims)
                gone = set(exc.claims)
                held = [c for c in held if c not in gone]
                log.warning("projection claims lost; merged batch rolled back and redone without them",
                            extra={"lost": len(exc.claims), "remaining": len(held)})
                continue
            except (psycopg.OperationalError, PoolTimeout):
                # Not about any one key (connection, timeout, deadlock): give the batch back.
                m.projection_rebuild_failed_count.inc()
                await self.release_failed_keys(held)
                raise
            except Exception as exc:
                # Possibly one bad key: rebuild the batch one key at a time so it cannot drag every
                # other key of the batch to max_attempts with it.
                m.projection_rebuild_failed_count.inc()
                log.warning("merged batch failed; rebuilding its keys one by one", exc_info=True,
                            extra={"keys": len(held), "error": str(exc)[:300]})
                return await self._rebuild_one_by_one(held, lost)
            m.projection_rebuild_count.inc(len(held), trigger="merge")
            if rerequested:
                m.projection_rebuild_rerequested_count.inc(rerequested)
            m.projection_merge_duration_ms.observe((time.monotonic() - started) * 1000)
            log.debug("projection batch merged", extra={"keys": len(held), "served": served,
                                                        "rerequested": rerequested, "lost": lost})
            return MergeOutcome(rebuilt=len(held), served=served, rerequested=rerequested, lost=lost)
        return MergeOutcome(lost=lost)

    async def _rebuild_one_by_one(self, held: list[Claim], lost: int) -> MergeOutcome:
        rebuilt, served = await self.rebuild_each(held, "merge")
        return MergeOutcome(rebuilt=rebuilt, served=served, rerequested=rebuilt - served, lost=lost)

    async def rebuild_each(self, claims: list[Claim], trigger: Trigger) -> tuple[int, int]:
        """Rebuild `claims` one key per transaction; returns (keys rebuilt, requests served).

        A key whose rebuild is refused is released (`rebuild` does it) and the next key goes on, so one
        poison key never holds the others' claims until their lease expires. A transient error releases
        the keys not reached yet and propagates."""
        rebuilt = served = 0
        for index, claim in enumerate(claims):
            try:
                done = await self.rebuild(claim, trigger)
            except Exception as exc:
                if is_transient(exc):
                    if claims[index + 1:]:
                        await self.release_failed_keys(claims[index + 1:])
                    raise
                log.warning("projection rebuild refused; key released, the others go on", exc_info=True,
                            extra={**_log_key(claim), "trigger": trigger, "error": describe_failure(exc)})
                continue
            rebuilt += 1
            served += done
        return rebuilt, served

    async def _merge_transaction(self, held: list[Claim]) -> tuple[int, int]:
        me = self.config.instance_id
        async with self.write_health.timed(), self.pool.connection() as conn, conn.transaction():
            await conn.execute(q.REBUILD_KEYS, _key_arrays(held))
            cur = await conn.execute(q.COMPLETE_CLAIMS, {
                **_key_arrays(held), "me": me, "request_counts": [c.request_count for c in held],
                "last_requested": [c.last_requested_at for c in held]})
            served = {_row_key(r) for r in await cur.fetchall()}
            rest = [c for c in held if c.key_tuple not in served]
            released: set[tuple[int, int, date]] = set()
            if rest:
                cur = await conn.execute(q.RELEASE_RE_REQUESTED_KEYS, {
                    **_key_arrays(rest), "me": me, "last_requested": [c.last_requested_at for c in rest]})
                released = {_row_key(r) for r in await cur.fetchall()}
            lost = [c for c in rest if c.key_tuple not in released]
            if lost:
                raise _ClaimsLost(lost)  # rolls the whole batch back
        return len(served), len(released)

    async def release_failed_keys(self, claims: list[Claim]) -> None:
        """Give back claims not rebuilt (their attempt stays counted)."""
        try:
            async with self.pool.connection() as conn:
                await conn.execute(q.RELEASE_FAILED_KEYS, {**_key_arrays(claims), "me": self.config.instance_id})
        except Exception:
            log.warning("could not release failed claims; they expire by themselves", extra={"keys": len(claims)})

    async def coordinator_state(self) -> dict[str, Any]:
        """What the dispatch-coordinator last published (auto slow-down decides the rebuild mode)."""
        async with self.pool.connection() as conn:
            return await read_coordinator_state(conn)

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


def _key_arrays(claims: list[Claim]) -> dict[str, object]:
    return {"tenant_ids": [c.tenant_id for c in claims], "brand_ids": [c.brand_id for c in claims],
            "dates": [c.business_date for c in claims]}


def _row_key(row: dict[str, Any]) -> tuple[int, int, date]:
    return int(row["tenant_id"]), int(row["brand_id"]), row["business_date"]


def _log_key(claim: Claim) -> dict[str, object]:
    return {"tenant_id": claim.tenant_id, "brand_id": claim.brand_id,
            "business_date": claim.business_date.isoformat()}
