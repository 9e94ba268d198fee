"""The desktop client's local rules as pure functions (docs/architecture.md §10.2, §10.4, §14.2, §14.4)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from libs.contracts.wire import HUB_DRAINING_CLOSE, reconnect_delay_ms
from libs.domain.lanes import lane_weight

PHASES: tuple[str, ...] = (
    "PREPARING", "NAVIGATING", "AUTHENTICATING", "INPUTTING", "SUBMITTING", "WAITING", "PARSING", "POSTING")
# §14.2: "not really started" is exactly these; an interrupt is handled at once, not at a safe point.
NOT_STARTED: frozenset[str] = frozenset({"PREPARING", "NAVIGATING"})
# §10.4 safe points, as "entering this phase": before opening the page, before input, before submit,
# after the raw answer and before parsing. Never during login (AUTHENTICATING) or while waiting for
# the platform (WAITING), nor while posting the result.
SAFE_POINT_BEFORE: frozenset[str] = frozenset({"NAVIGATING", "INPUTTING", "SUBMITTING", "PARSING"})


@dataclass(frozen=True, slots=True)
class LocalEntry:
    """A task the client knows about, with the §14.2 sort fields."""

    task_id: str
    kind: str
    lane: str
    priority: int
    available_at: float
    enqueued_at: str
    updated_at: str


def local_weight(kind: str, lane: str) -> int:
    try:
        return lane_weight(kind, lane)
    except ValueError:
        return 0


def local_sort_key(entry: LocalEntry) -> tuple[int, int, float, str, str]:
    """§14.2: lane_weight DESC, priority DESC, availableAt ASC, enqueuedAt ASC, updatedAt ASC."""
    return (-local_weight(entry.kind, entry.lane), -entry.priority, entry.available_at, entry.enqueued_at,
            entry.updated_at)


def order_locally(entries: list[LocalEntry]) -> list[LocalEntry]:
    return sorted(entries, key=local_sort_key)


def accepts_generation(event_generation: int, last_seen_generation: int) -> bool:
    """§10.2 / §14.4: act only on events with generation >= the last one seen for the task."""
    return event_generation >= last_seen_generation


def is_safe_point(next_phase: str) -> bool:
    return next_phase in SAFE_POINT_BEFORE


def handles_interrupt_now(phase: str) -> bool:
    """An interrupt on a task that has not really started is handled on the next serial check."""
    return phase in NOT_STARTED


def yields_at_checkpoint(execution_owner: str, phase: str, next_phase: str) -> bool:
    """Whether an interrupted task cancels at the end of `phase` (about to enter `next_phase`).

    desktop_tasks work yields at a safe point (§10.4); legacy work follows Phase 1 (docs/legacy-path.md): it yields
    only while it has not really started (PREPARING or NAVIGATING) and otherwise runs to its result. The lease
    response says which path a task is on, so the choice is per task.
    """
    if execution_owner == "legacy":
        return phase in NOT_STARTED
    return is_safe_point(next_phase)


def backoff_delay(attempt: int, *, base_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter in [50%, 100%] of the capped delay."""
    capped = min(max_s, base_s * (2 ** min(attempt, 30)))
    jitter: float = (rng or random.Random()).uniform(0.5, 1.0)
    return float(capped * jitter)


def drain_delay_s(code: int | None, reason: str) -> float | None:
    """The delay a draining hub named for this socket (close 4503, `draining; reconnect after <N> ms`), in seconds;
    None for any other close (reconnect with backoff)."""
    if code != HUB_DRAINING_CLOSE:
        return None
    delay_ms = reconnect_delay_ms(reason)
    return None if delay_ms is None else delay_ms / 1000
