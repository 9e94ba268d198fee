"""Per-event rebuilds, or batch merging while the coordinator reports auto slow-down (docs/architecture.md §12.4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.coordinator_state import SLOWDOWN_MAX_AGE_S, slowdown_from_state


@dataclass(frozen=True, slots=True)
class RebuildMode:
    """merge: ProjectionRebuild events are acked without a rebuild and the queue is rebuilt in batches
    once per merge window. reasons: the slow-down reasons (empty when not merging)."""

    merge: bool
    reasons: tuple[str, ...] = ()
    note: str | None = None


def rebuild_mode(state: dict[str, Any], max_age_s: float = SLOWDOWN_MAX_AGE_S) -> RebuildMode:
    """The mode the coordinator's published state asks for; a missing or stale entry means per-event."""
    active, value = slowdown_from_state(state, max_age_s)
    if not active:
        return RebuildMode(merge=False, note=value.get("note"))
    return RebuildMode(merge=True, reasons=tuple(str(r) for r in value.get("reasons") or ()))
