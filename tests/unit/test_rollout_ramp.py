"""The guarded ramp's decision (libs/domain/rollout.py): which step is next, and when the current one's gates have
held for its dwell."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from libs.dispatch_settings import SettingError, coerce
from libs.domain.rollout import (
    DEFAULT_RAMP,
    GateInputs,
    GateThresholds,
    Observation,
    RampError,
    RampStep,
    evaluate,
    next_step,
    parse_ramp,
)

T0 = datetime(2026, 12, 1, tzinfo=UTC)
RAMP = parse_ramp(DEFAULT_RAMP)
GATES = GateThresholds(preempt_success_min=0.95, min_preemptions=10, ingest_lag_max_ms=30_000, max_reconcile_fixes=0,
                       max_orphans=0, max_gap_seconds=900)


def _obs(at_s: float, *, lag: float = 100.0, orphans: int = 0, fixes: int = 0) -> Observation:
    return Observation(observed_at=T0 + timedelta(seconds=at_s), ingest_lag_ms=lag, orphans=orphans,
                       reconcile_fixes=fixes)


def _inputs(now_s: float, observations: list[Observation], *, yielded: int = 20, timed_out: int = 0) -> GateInputs:
    return GateInputs(now=T0 + timedelta(seconds=now_s), step_started_at=T0, observations=tuple(observations),
                      preempt_yielded=yielded, preempt_timed_out=timed_out)


def _every_5_min(until_s: float) -> list[Observation]:
    return [_obs(s) for s in range(300, int(until_s) + 1, 300)]


def test_the_default_ramp_is_the_specifications_d1_d3_d7_d14() -> None:
    assert RAMP == (RampStep(5, 2 * 86400), RampStep(25, 4 * 86400), RampStep(50, 7 * 86400), RampStep(100, 0))
    assert [next_step(RAMP, p) for p in (0, 5, 10, 25, 50)] == [RAMP[0], RAMP[1], RAMP[1], RAMP[2], RAMP[3]]
    assert next_step(RAMP, 100) is None


@pytest.mark.parametrize("text", ["5:2d,25:4d,50", "25:1d,5:1d,100", "5,100", "5:2x,100", "0:1d,100", ""])
def test_a_ramp_that_cannot_be_followed_is_refused(text: str) -> None:
    with pytest.raises(RampError):
        parse_ramp(text)
    with pytest.raises(SettingError):
        coerce("rollout_ramp", text)
    assert coerce("rollout_ramp", "10:30m,100") == "10:30m,100"


def test_a_step_whose_gates_held_for_its_dwell_advances() -> None:
    dwell = RAMP[0].dwell_seconds
    verdict = evaluate(RAMP, 5, _inputs(dwell + 1, _every_5_min(dwell)), GATES)
    assert verdict.allowed and verdict.target == 25 and verdict.reasons == []


def test_the_dwell_is_waited_for() -> None:
    verdict = evaluate(RAMP, 5, _inputs(3600, _every_5_min(3600)), GATES)
    assert not verdict.allowed and "held for 3600 s of its 172800 s dwell" in verdict.reasons[0]


def test_a_gate_failing_now_refuses_and_names_it() -> None:
    dwell = RAMP[0].dwell_seconds
    observations = [*_every_5_min(dwell), _obs(dwell + 10, orphans=2)]
    verdict = evaluate(RAMP, 5, _inputs(dwell + 20, observations), GATES)
    assert not verdict.allowed and verdict.reasons == ["a gate fails now: 2 migration orphan task(s) (at most 0)"]


def test_a_breach_restarts_the_dwell_clock() -> None:
    dwell = RAMP[0].dwell_seconds
    breach_at = dwell - 600
    observations = [_obs(s, lag=60_000 if s == breach_at else 100.0) for s in range(300, dwell + 1, 300)]
    verdict = evaluate(RAMP, 5, _inputs(dwell + 1, observations), GATES)
    assert not verdict.allowed and "a gate failed at" in verdict.reasons[0] and "ingest lag 60000 ms" in \
        verdict.reasons[0]
    # Held again from the first good observation after the breach, not from the breach itself.
    clean_from = breach_at + 300
    later = [*observations, *[_obs(s) for s in range(dwell + 300, clean_from + dwell + 1, 300)]]
    assert not evaluate(RAMP, 5, _inputs(clean_from + dwell - 1, later), GATES).allowed
    again = evaluate(RAMP, 5, _inputs(clean_from + dwell + 1, later), GATES)
    assert again.allowed and again.held_since == T0 + timedelta(seconds=clean_from)


def test_unwatched_gates_refuse_and_a_gap_restarts_the_clock() -> None:
    dwell = RAMP[0].dwell_seconds
    stale = evaluate(RAMP, 5, _inputs(dwell + 3600, _every_5_min(dwell)), GATES)
    assert not stale.allowed and "not being watched" in stale.reasons[0]
    gap = [o for o in _every_5_min(dwell) if not 3000 < (o.observed_at - T0).total_seconds() < 6000]
    verdict = evaluate(RAMP, 5, _inputs(dwell + 1, gap), GATES)
    assert not verdict.allowed and verdict.held_since == T0 + timedelta(seconds=6000)


@pytest.mark.parametrize(("yielded", "timed_out", "why"), [
    (3, 0, "not enough evidence: 3 preemption(s)"), (18, 2, "preemption success rate 90.0% below 95%")])
def test_the_preemption_gate_needs_evidence_and_a_high_rate(yielded: int, timed_out: int, why: str) -> None:
    dwell = RAMP[0].dwell_seconds
    verdict = evaluate(RAMP, 5, _inputs(dwell + 1, _every_5_min(dwell), yielded=yielded, timed_out=timed_out), GATES)
    assert not verdict.allowed and why in verdict.reasons[0]


def test_entering_the_ramp_needs_no_gate_and_the_last_step_has_no_next() -> None:
    assert evaluate(RAMP, 0, _inputs(1, [], yielded=0), GATES).target == 5
    assert evaluate(RAMP, 0, _inputs(1, [], yielded=0), GATES).allowed
    top = evaluate(RAMP, 100, _inputs(1, []), GATES)
    assert not top.allowed and "last step" in top.reasons[0]
