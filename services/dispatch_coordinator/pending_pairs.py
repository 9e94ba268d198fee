"""The coordinator's cache of the (tenant, platform) pairs with pending work, per lane: what a full pass reads
candidates for (in each lane, the pairs with work in that lane), and what tells a completion whether a pass could serve
anything."""

from __future__ import annotations

import asyncio
import logging
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from psycopg_pool import AsyncConnectionPool

from libs.clock import SYSTEM_CLOCK, Clock
from libs.db.pool import Conn
from libs.domain.lanes import SCHEDULED_LANE
from libs.tasks import dispatch_reads

log = logging.getLogger("dispatch.pass")

# A pass re-reads the pairs (in the background) once they are older than this.
PAIRS_MAX_AGE_S = 1.0
# A background re-read reads a slice of the pairs, in (tenant, platform) order from where the last one ended (its
# cursor wraps around): at most this many (pair, lane) entries or the known entries over SWEEP_SLICES, whichever is
# more. Up to that many entries every re-read is a whole read, as if there were no slices; above it a re-read costs
# what a slice holds, not what the backlog holds (docs/architecture.md "The pending pairs"), and every pair is read
# again within about SWEEP_SLICES re-reads.
SLICE_MIN_ENTRIES = 2_000
SWEEP_SLICES = 10


class PendingPairs:
    """Every (tenant, platform) with a pending task, per lane and of either execution path, as of `read_at`, plus
    what the scanner added since (scheduled work). `clock` dates the reads (`read_at`, `stale`)."""

    def __init__(self, pool: AsyncConnectionPool[Conn], *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._pool = pool
        self._clock = clock
        self._by_lane: dict[str, set[tuple[int, int]]] = {}
        self._lanes_of: dict[tuple[int, int], int] = {}  # a pair -> how many lanes list it: `pairs`
        self._pairs_of: dict[int, int] = {}  # a tenant -> how many of `pairs` are its: a per-completion lookup
        self._sorted: dict[str, list[tuple[int, int]]] = {}  # a lane's pairs in order, once asked for
        # The clock's monotonic time since when every pair was read (the start of the last whole sweep of slices; 0
        # before the first), and of the last read, whole or a slice (`stale`).
        self.read_at = 0.0
        self._last_read = 0.0
        # Where the next slice starts (None: the first pair) and when the sweep it belongs to started.
        self._slice_from: tuple[int, int] | None = None
        self._sweep_started = 0.0
        # A re-read in flight (see `refresh_in_background`), and what `add` added meanwhile.
        self.refreshing: asyncio.Task[None] | None = None
        self._added: set[tuple[int, int]] = set()

    @property
    def pairs(self) -> AbstractSet[tuple[int, int]]:
        """The pairs with pending work of any lane."""
        return self._lanes_of.keys()

    @property
    def by_lane(self) -> dict[str, set[tuple[int, int]]]:
        return self._by_lane

    @by_lane.setter
    def by_lane(self, by_lane: dict[str, set[tuple[int, int]]]) -> None:
        self._by_lane = {lane: set(pairs) for lane, pairs in by_lane.items()}
        self._lanes_of = Counter(pair for pairs in self._by_lane.values() for pair in pairs)
        self._pairs_of = Counter(tenant for tenant, _ in self._lanes_of)
        self._sorted = {}

    def sorted_lane_pairs(self, lane: str) -> list[tuple[int, int]]:
        """The pairs with pending work in `lane`, in (tenant, platform) order (sorted once per change: a full pass
        walks a window of them). Not changed in place: a pass may walk it across a re-read."""
        if lane not in self._sorted:
            self._sorted[lane] = sorted(self._by_lane.get(lane, ()))
        return self._sorted[lane]

    def has_pending(self, tenant_id: int) -> bool:
        return tenant_id in self._pairs_of

    def add(self, pairs: Sequence[tuple[int, int]]) -> None:
        """New work the scanner just created, in the scheduled lane (so the pass need not wait for the next
        refresh)."""
        lane = self._by_lane.setdefault(SCHEDULED_LANE.name, set())
        for pair in pairs:
            if pair not in lane:
                lane.add(pair)
                self._listed(pair)
        self._sorted.pop(SCHEDULED_LANE.name, None)
        self._added.update(pairs)

    def _listed(self, pair: tuple[int, int]) -> None:
        """`pair` is now listed in one more lane."""
        self._lanes_of[pair] = self._lanes_of.get(pair, 0) + 1
        if self._lanes_of[pair] == 1:
            self._pairs_of[pair[0]] = self._pairs_of.get(pair[0], 0) + 1

    def _unlisted(self, pair: tuple[int, int]) -> None:
        """`pair` is listed in one lane less."""
        self._lanes_of[pair] -= 1
        if not self._lanes_of[pair]:
            del self._lanes_of[pair]
            self._pairs_of[pair[0]] -= 1
            if not self._pairs_of[pair[0]]:
                del self._pairs_of[pair[0]]

    @property
    def stale(self) -> bool:
        return self._clock.monotonic() - self._last_read > PAIRS_MAX_AGE_S

    async def refresh(self, conn: Conn) -> None:
        """A whole read of the pairs (the first pass's, before it has any)."""
        self._added = set()
        started = self._clock.monotonic()
        by_lane, _ = await dispatch_reads.pending_lane_pairs_slice(conn, start=None, limit=None)
        self.by_lane = {lane: set(pairs) for lane, pairs in by_lane.items()}
        self._readd_added()
        self.read_at = self._last_read = started
        self._slice_from = None

    async def refresh_slice(self, conn: Conn) -> None:
        """The next slice of the pairs: those from where the last slice ended, up to `SLICE_MIN_ENTRIES` entries or the
        known ones over `SWEEP_SLICES`; what the slice's range held before is replaced by what it holds now. `read_at`
        moves on when a sweep of slices has read every pair since it started."""
        self._added = set()
        started = self._clock.monotonic()
        start = self._slice_from
        if start is None:
            self._sweep_started = started
        limit = max(SLICE_MIN_ENTRIES, math.ceil(sum(self._lanes_of.values()) / SWEEP_SLICES))
        by_lane, end = await dispatch_reads.pending_lane_pairs_slice(conn, start=start, limit=limit)
        self._replace(start, end, by_lane)
        self._readd_added()
        self._last_read = started
        self._slice_from = end
        if end is None:  # the sweep read every pair since it started
            self.read_at = self._sweep_started

    def _replace(self, start: tuple[int, int] | None, end: tuple[int, int] | None,
                 read: dict[str, list[tuple[int, int]]]) -> None:
        """Every lane's pairs from `start` (None: the first) up to `end` (not included; None: the last) become those
        `read` found there (sorted)."""
        for lane in set(self._by_lane) | set(read):
            listed = self._by_lane.setdefault(lane, set())
            ordered = self.sorted_lane_pairs(lane)
            i = 0 if start is None else bisect_left(ordered, start)
            j = len(ordered) if end is None else bisect_left(ordered, end)
            found = read.get(lane, [])
            before, after = set(ordered[i:j]), set(found)
            for pair in before - after:  # most of a slice is what it was: only the changes are counted
                listed.discard(pair)
                self._unlisted(pair)
            for pair in after - before:
                listed.add(pair)
                self._listed(pair)
            if before != after:
                self._sorted[lane] = [*ordered[:i], *found, *ordered[j:]]

    def _readd_added(self) -> None:
        """What the scanner added while a read was in flight (its rows may have committed after the read's snapshot)."""
        if self._added:
            added, self._added = self._added, set()
            self.add(sorted(added))

    def refresh_in_background(self) -> None:
        """Re-read a slice of the pairs on a connection of their own while passes go on with the ones they have: the
        read is a probe per pair (40-65 ms for 3,000 pairs, 1,000 tenants), and on the dispatch loop a click arriving
        meanwhile waited for it before its high pass could start; a whole read of 10,000 pairs at every stale pass,
        37 ms of the server and 9 ms of this process, slowed the pass it ran beside by a third (docs/benchmarks.md
        "The pending pairs in slices")."""
        if self.refreshing is not None and not self.refreshing.done():
            return
        self.refreshing = asyncio.create_task(self._refresh_pooled(), name="dispatch-pairs")

    async def _refresh_pooled(self) -> None:
        try:
            async with self._pool.connection() as conn:
                await self.refresh_slice(conn)
        except Exception as exc:  # the next stale pass tries again
            log.warning("reading the pending pairs failed", extra={"error": str(exc)[:300]})
