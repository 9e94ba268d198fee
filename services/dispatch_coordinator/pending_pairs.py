"""The coordinator's cache of the (tenant, platform) pairs with pending work, per lane: what a full pass reads
candidates for (in each lane, the pairs with work in that lane), and what tells a completion whether a pass could serve
anything."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from psycopg_pool import AsyncConnectionPool

from libs.clock import SYSTEM_CLOCK, Clock
from libs.db.pool import Conn
from libs.domain.lanes import SCHEDULED_LANE
from libs.tasks import dispatch_reads

log = logging.getLogger("dispatch.pass")

# A pass re-reads the pairs (in the background) once they are older than this.
PAIRS_MAX_AGE_S = 1.0


class PendingPairs:
    """Every (tenant, platform) with a pending task, per lane and of either execution path, as of `read_at`, plus
    what the scanner added since (scheduled work). `clock` dates the reads (`read_at`, `stale`)."""

    def __init__(self, pool: AsyncConnectionPool[Conn], *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._pool = pool
        self._clock = clock
        self._pairs: set[tuple[int, int]] = set()  # of every lane
        self._by_lane: dict[str, set[tuple[int, int]]] = {}
        self._tenants: set[int] = set()  # the tenants of `pairs`, for a per-completion lookup
        self._sorted: dict[str, list[tuple[int, int]]] = {}  # a lane's pairs in order, once asked for
        self.read_at = 0.0  # the clock's monotonic time of the last read (0 before the first)
        # A re-read in flight (see `refresh_in_background`), and what `add` added meanwhile.
        self.refreshing: asyncio.Task[None] | None = None
        self._added: set[tuple[int, int]] = set()

    @property
    def pairs(self) -> set[tuple[int, int]]:
        """The pairs with pending work of any lane."""
        return self._pairs

    @property
    def by_lane(self) -> dict[str, set[tuple[int, int]]]:
        return self._by_lane

    @by_lane.setter
    def by_lane(self, by_lane: dict[str, set[tuple[int, int]]]) -> None:
        self._by_lane = {lane: set(pairs) for lane, pairs in by_lane.items()}
        self._pairs = {pair for pairs in self._by_lane.values() for pair in pairs}
        self._tenants = {tenant for tenant, _ in self._pairs}
        self._sorted = {}

    def sorted_lane_pairs(self, lane: str) -> list[tuple[int, int]]:
        """The pairs with pending work in `lane`, in (tenant, platform) order (sorted once per change: a full pass
        walks a window of them)."""
        if lane not in self._sorted:
            self._sorted[lane] = sorted(self._by_lane.get(lane, ()))
        return self._sorted[lane]

    def has_pending(self, tenant_id: int) -> bool:
        return tenant_id in self._tenants

    def add(self, pairs: Sequence[tuple[int, int]]) -> None:
        """New work the scanner just created, in the scheduled lane (so the pass need not wait for the next
        refresh)."""
        self._pairs.update(pairs)
        self._by_lane.setdefault(SCHEDULED_LANE.name, set()).update(pairs)
        self._tenants.update(tenant for tenant, _ in pairs)
        self._sorted.pop(SCHEDULED_LANE.name, None)
        self._added.update(pairs)

    @property
    def stale(self) -> bool:
        return self._clock.monotonic() - self.read_at > PAIRS_MAX_AGE_S

    async def refresh(self, conn: Conn) -> None:
        self._added = set()
        by_lane = await dispatch_reads.pending_lane_pairs(conn)
        by_lane.setdefault(SCHEDULED_LANE.name, set()).update(self._added)
        self.by_lane = by_lane
        self.read_at = self._clock.monotonic()

    def refresh_in_background(self) -> None:
        """Re-read the pairs on a connection of their own while passes go on with the ones they have: the read is a
        probe per pair (40-65 ms for 3,000 pairs, 1,000 tenants), and on the dispatch loop a click arriving meanwhile
        waited for it before its high pass could start."""
        if self.refreshing is not None and not self.refreshing.done():
            return
        self.refreshing = asyncio.create_task(self._refresh_pooled(), name="dispatch-pairs")

    async def _refresh_pooled(self) -> None:
        try:
            async with self._pool.connection() as conn:
                await self.refresh(conn)
        except Exception as exc:  # the next stale pass tries again
            log.warning("reading the pending pairs failed", extra={"error": str(exc)[:300]})
