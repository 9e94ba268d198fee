"""Pure decisions of the reconciler (no I/O): unit-tested in tests/unit/test_reconcile_rules.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

UnknownVerdict = Literal["succeeded", "failed", "aborted", "queued"]


@dataclass(frozen=True, slots=True)
class UnknownEvidence:
    """What the database says about an `unknown` execution (docs/architecture.md §8.2)."""

    run_status: str | None  # status of the question_monitor_runs row written for this lease, if any
    lease_alive: bool  # lease_expires_at still in the future


def converge_unknown(evidence: UnknownEvidence) -> UnknownVerdict:
    """Where an `unknown` execution goes.

    - a result row ingested for this lease decides: succeeded / failed;
    - no evidence and the lease expired: the result is lost -> aborted (the business task is retried);
    - no evidence but the lease is still held: back to `queued` on the same row, so the holder
      (fenced by a new lease epoch) or the hub's replay runs it again. The row stays the single
      active execution of its business task either way.
    """
    if evidence.run_status == "succeeded":
        return "succeeded"
    if evidence.run_status == "failed":
        return "failed"
    return "queued" if evidence.lease_alive else "aborted"


def parse_intervals(raw: str) -> dict[str, float]:
    """`"expired_leases=1,offline_clients=0.5"` -> {"expired_leases": 1.0, ...}; raises ValueError."""
    out: dict[str, float] = {}
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected NAME=SECONDS, got {part!r}")
        seconds = float(value)
        if seconds <= 0:
            raise ValueError(f"interval of {name.strip()!r} must be positive")
        out[name.strip()] = seconds
    return out
