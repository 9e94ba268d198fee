"""Pure outbox decisions: backoff, failure classification, the next state after a failed attempt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

FailureKind = Literal["transient", "permanent"]


@dataclass(frozen=True, slots=True)
class FailureOutcome:
    status: Literal["retryable", "dead_letter"]
    delay_ms: int
    reason: str


def backoff_ms(attempts: int, *, base_ms: int, max_ms: int, rng: random.Random | None = None) -> int:
    """Exponential backoff with equal jitter: attempt 1 waits ~base, doubling up to max."""
    exponent = max(attempts - 1, 0)
    ceiling: int = min(max_ms, base_ms * 2 ** min(exponent, 30))
    half = ceiling // 2
    jitter: int = (rng or random).randint(0, max(ceiling - half, 0))
    return half + jitter


def after_failure(
    *, attempts: int, max_attempts: int, kind: FailureKind, error: str, base_ms: int, max_ms: int,
    rng: random.Random | None = None,
) -> FailureOutcome:
    """Attempts were counted at claim; failure handling never counts again."""
    if kind == "permanent":
        return FailureOutcome("dead_letter", 0, f"permanent: {error}")
    if attempts >= max_attempts:
        return FailureOutcome("dead_letter", 0, f"gave up after {attempts} attempts: {error}")
    return FailureOutcome("retryable", backoff_ms(attempts, base_ms=base_ms, max_ms=max_ms, rng=rng), error)
