"""Daily projections of docs/architecture.md §12.1, defined once here (the projection worker's SQL implements the same).

Both `monitoring_brand_daily` (key tenant_id, brand_id, business_date) and
`monitoring_brand_platform_daily` (the same key plus ai_platform_id) are recomputed from the raw
facts of that key only and overwritten in place; a key (or platform) without runs has no row.

Columns:
- `runs`: rows of `question_monitor_runs` for the key — one per (question, platform, collector_type,
  run_mode), i.e. the latest effective result of each business task of that day (§12.3).
- `succeeded_runs` / `failed_runs`: those runs whose effective status is succeeded / failed
  (a failed run is a business key with no successful result yet); runs = succeeded + failed.
- `brand_mentioned_runs`: succeeded runs whose answer mentions the brand (a failed run never counts).
- `mention_rate`: brand_mentioned_runs / succeeded_runs, rounded half-up to 4 decimals; 0 without
  succeeded runs.
- `citations`: citation facts of the succeeded runs — distinct cited pages per run (URLs deduplicated
  by `citation_fingerprint` within a run), summed over runs.
- `distinct_cited_domains`: distinct non-empty domains among those citations (a domain cited by
  several runs or platforms counts once at its level).
- `rebuilt_at`: when the row was last recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal


@dataclass(frozen=True, slots=True)
class RunFact:
    run_id: int
    ai_platform_id: int
    status: str
    brand_mentioned: bool


@dataclass(frozen=True, slots=True)
class CitationFact:
    run_id: int
    domain: str


@dataclass(frozen=True, slots=True)
class DailyAggregate:
    runs: int
    succeeded_runs: int
    failed_runs: int
    brand_mentioned_runs: int
    mention_rate: Decimal
    citations: int
    distinct_cited_domains: int


def mention_rate(brand_mentioned_runs: int, succeeded_runs: int) -> Decimal:
    if succeeded_runs <= 0:
        return Decimal("0.0000")
    return (Decimal(brand_mentioned_runs) / Decimal(succeeded_runs)).quantize(Decimal("0.0001"), ROUND_HALF_UP)


def _aggregate(runs: list[RunFact], citations: list[CitationFact]) -> DailyAggregate:
    succeeded = [r for r in runs if r.status == "succeeded"]
    mentioned = sum(1 for r in succeeded if r.brand_mentioned)
    return DailyAggregate(
        runs=len(runs), succeeded_runs=len(succeeded), failed_runs=len(runs) - len(succeeded),
        brand_mentioned_runs=mentioned, mention_rate=mention_rate(mentioned, len(succeeded)),
        citations=len(citations), distinct_cited_domains=len({c.domain for c in citations if c.domain}),
    )


def compute_daily(runs: Iterable[RunFact], citations: Iterable[CitationFact]) -> (
    tuple[DailyAggregate | None, dict[int, DailyAggregate]]
):
    """(brand row or None without runs, {ai_platform_id: platform row}) for one (tenant, brand, day)."""
    all_runs = list(runs)
    succeeded_ids = {r.run_id: r.ai_platform_id for r in all_runs if r.status == "succeeded"}
    counted = [c for c in citations if c.run_id in succeeded_ids]
    if not all_runs:
        return None, {}
    per_platform: dict[int, DailyAggregate] = {}
    for platform in sorted({r.ai_platform_id for r in all_runs}):
        p_runs = [r for r in all_runs if r.ai_platform_id == platform]
        p_cites = [c for c in counted if succeeded_ids[c.run_id] == platform]
        per_platform[platform] = _aggregate(p_runs, p_cites)
    return _aggregate(all_runs, counted), per_platform
