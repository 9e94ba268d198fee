"""Schedule scanner rules (docs/architecture.md §9.1, §16.2.2): which occurrence a due plan produces, for which
business date, and which execution path owns the new business task."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

UTC_ZONE = ZoneInfo("UTC")


@functools.lru_cache(maxsize=1024)
def tenant_zone(name: str) -> ZoneInfo:
    """The tenant's time zone; an unknown name falls back to UTC (a bad row never stops the scanner)."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return UTC_ZONE


@dataclass(frozen=True, slots=True)
class Occurrence:
    slot: datetime           # the latest due run time
    business_date: date      # its date in the tenant's time zone
    next_run_at: datetime    # the first run time after `now`
    skipped: int             # earlier due slots folded into this one (the scanner was behind)


def plan_occurrence(next_run_at: datetime, interval_seconds: int, now: datetime, time_zone: str) -> Occurrence:
    """A due plan (next_run_at <= now) yields one task for its latest due slot, and moves past `now`.

    A scanner that was down for days does not backfill every missed day: collecting yesterday's
    question today would be stored under the wrong business date anyway.
    """
    interval = timedelta(seconds=max(1, interval_seconds))
    behind = max(0, math.floor((now - next_run_at) / interval))
    slot = next_run_at + behind * interval
    return Occurrence(slot=slot, business_date=slot.astimezone(tenant_zone(time_zone)).date(),
                      next_run_at=slot + interval, skipped=behind)


def execution_owner_for(tenant_id: int, rollout_percentage: int) -> str:
    """§16.2.2 rollout: `tenant_id % 100 < rollout_percentage` -> desktop_tasks, else legacy."""
    return "desktop_tasks" if tenant_id % 100 < rollout_percentage else "legacy"
