"""Checks of a reshard from the raw facts (the applied-result ledger): per-key order, and that no key was ever applied
by two (epoch, shard) at once."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Applied:
    key: str
    result_id: str
    seq: int
    epoch: int
    shard: int
    tx_started_at: datetime
    applied_at: datetime


def overlaps(rows: Iterable[Applied]) -> list[str]:
    """Keys whose applies by one (epoch, shard) overlap in time another's, or go back to an earlier epoch: for each
    key, the span [first transaction start, last ledger write] of each (epoch, shard), taken in epoch order, must
    each end before the next begins."""
    spans: dict[str, dict[tuple[int, int], list[datetime]]] = defaultdict(dict)
    for r in rows:
        span = spans[r.key].setdefault((r.epoch, r.shard), [r.tx_started_at, r.applied_at])
        span[0], span[1] = min(span[0], r.tx_started_at), max(span[1], r.applied_at)
    found = []
    for key, by_owner in spans.items():
        ordered = sorted(by_owner.items())
        if len({epoch for epoch, _ in by_owner}) != len(by_owner):
            found.append(f"{key}: two shards of one epoch {sorted(by_owner)}")
        for (a, (_, a_end)), (b, (b_start, _)) in itertools.pairwise(ordered):
            if not a_end < b_start:
                found.append(f"{key}: {a} applied until {a_end.isoformat()}, {b} from {b_start.isoformat()}")
    return found


def order_breaks(rows: Iterable[Applied], published: dict[str, Sequence[str]]) -> list[str]:
    """Keys whose results were not applied (ledger order) in the order they were published, one after another."""
    applied: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for r in rows:
        applied[r.key].append((r.seq, r.result_id))
    return [key for key, ids in published.items() if [rid for _, rid in sorted(applied[key])] != list(ids)]
