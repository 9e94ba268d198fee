"""Pure outbox decisions: backoff and the state after a failed attempt."""

from __future__ import annotations

import random

from libs.outbox.state import after_failure, backoff_ms


def test_backoff_grows_exponentially_and_is_capped() -> None:
    rng = random.Random(7)
    ceilings = []
    for attempt in range(1, 12):
        values = [backoff_ms(attempt, base_ms=500, max_ms=60_000, rng=rng) for _ in range(50)]
        ceiling = min(60_000, 500 * 2 ** (attempt - 1))
        assert all(ceiling // 2 <= v <= ceiling for v in values), attempt
        ceilings.append(max(values))
    assert ceilings[-1] <= 60_000
    assert ceilings[3] > ceilings[0]


def test_transient_failure_retries_until_max_attempts_then_dead_letters() -> None:
    retry = after_failure(attempts=3, max_attempts=5, kind="transient", error="timeout", base_ms=100, max_ms=1000)
    assert retry.status == "retryable" and retry.delay_ms > 0
    final = after_failure(attempts=5, max_attempts=5, kind="transient", error="timeout", base_ms=100, max_ms=1000)
    assert final.status == "dead_letter"
    assert "gave up after 5 attempts: timeout" == final.reason


def test_permanent_failure_dead_letters_at_once() -> None:
    outcome = after_failure(attempts=1, max_attempts=10, kind="permanent", error="bad payload", base_ms=1, max_ms=2)
    assert outcome.status == "dead_letter"
    assert outcome.reason.startswith("permanent:")
