"""The guarded rollout ramp (docs/legacy-path.md "The ramp"): which percentage comes next, and whether the current
step's gates have held for its dwell time. Plain values in, a decision out; `monitorctl rollout advance` gathers the
inputs (services/dispatch_coordinator/rollout_ramp.py).

A ramp is written `5:2d,25:4d,50:7d,100`: each step's percentage and how long it must be watched (its dwell) before
the next one may start. The default is the specification's D1 5 % -> D3 25 % -> D7 50 % -> D14 100 %.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

DEFAULT_RAMP = "5:2d,25:4d,50:7d,100"

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_STEP = re.compile(r"^\s*(\d{1,3})\s*(?::\s*(\d+)\s*([smhd]))?\s*$")


@dataclass(frozen=True, slots=True)
class RampStep:
    percentage: int
    dwell_seconds: int  # how long this step is watched before the next one may start (0 for the last)


class RampError(ValueError):
    pass


def parse_ramp(text: str) -> tuple[RampStep, ...]:
    """`5:2d,25:4d,50:7d,100` -> steps; strictly increasing percentages in 1..100, ending at 100, every step but
    the last with a dwell (a dwell of 0 is written `:0s`)."""
    steps: list[RampStep] = []
    parts = text.split(",")
    for n, part in enumerate(parts):
        match = _STEP.match(part)
        if match is None:
            raise RampError(f"rollout ramp step {part.strip()!r} is not PERCENT:DWELL (e.g. 5:2d; units s, m, h, d)")
        pct = int(match.group(1))
        if not 1 <= pct <= 100:
            raise RampError(f"rollout ramp step {pct} is outside 1..100")
        if steps and pct <= steps[-1].percentage:
            raise RampError(f"rollout ramp percentages must increase ({steps[-1].percentage} then {pct})")
        if match.group(2) is None and n < len(parts) - 1:
            raise RampError(f"rollout ramp step {pct} needs a dwell (e.g. {pct}:2d)")
        steps.append(RampStep(pct, int(match.group(2)) * _UNITS[match.group(3)] if match.group(2) else 0))
    if steps[-1].percentage != 100:
        raise RampError("the rollout ramp must end at 100")
    return tuple(steps)


def next_step(ramp: tuple[RampStep, ...], current: int) -> RampStep | None:
    """The first step above `current` (None at 100)."""
    return next((step for step in ramp if step.percentage > current), None)


def current_dwell(ramp: tuple[RampStep, ...], current: int) -> int:
    """The dwell of the step `current` is on: the highest step at or below it (a percentage set by hand between two
    steps is watched as the step below it); 0 below the first step, where nothing runs on the new path yet."""
    below = [step for step in ramp if step.percentage <= current]
    return below[-1].dwell_seconds if below else 0


@dataclass(frozen=True, slots=True)
class GateThresholds:
    preempt_success_min: float  # yielded / (yielded + hard timeouts) over the step
    min_preemptions: int  # fewer interrupts than this over the step: not enough evidence
    ingest_lag_max_ms: int
    max_reconcile_fixes: int  # per consistency reconcile run
    max_orphans: int
    max_gap_seconds: float  # longer than this without an observation: the gates were not watched


@dataclass(frozen=True, slots=True)
class Observation:
    """One consistency reconcile run's figures (table rollout_observations)."""

    observed_at: datetime
    ingest_lag_ms: float
    orphans: int
    reconcile_fixes: int


@dataclass(frozen=True, slots=True)
class GateInputs:
    now: datetime
    step_started_at: datetime
    observations: tuple[Observation, ...]  # since the step started, oldest first
    preempt_yielded: int  # running executions that yielded to a click since the step started
    preempt_timed_out: int  # ... and that were force-cancelled at the hard timeout


@dataclass(slots=True)
class Verdict:
    current: int
    target: int | None
    dwell_seconds: int
    held_since: datetime
    held_seconds: float
    gates: list[dict[str, object]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return self.target is not None and not self.reasons


def _breaches(obs: Observation, t: GateThresholds) -> list[str]:
    found = []
    if obs.ingest_lag_ms > t.ingest_lag_max_ms:
        found.append(f"ingest lag {obs.ingest_lag_ms:.0f} ms over {t.ingest_lag_max_ms} ms")
    if obs.reconcile_fixes > t.max_reconcile_fixes:
        found.append(f"the consistency reconcile fixed {obs.reconcile_fixes} row(s) (at most "
                     f"{t.max_reconcile_fixes})")
    if obs.orphans > t.max_orphans:
        found.append(f"{obs.orphans} migration orphan task(s) (at most {t.max_orphans})")
    return found


def evaluate(ramp: tuple[RampStep, ...], current: int, inputs: GateInputs, t: GateThresholds) -> Verdict:
    """May the rollout go from `current` to the next step now?

    The step's watched gates (ingest lag, reconcile fixes, migration orphans, each consistency reconcile run's
    figures) must have held, observed without a gap longer than `max_gap_seconds`, for the step's dwell: the clock
    starts at the step's start, and again after the last observation that breached a gate or the last gap. The
    preemption success rate is taken over the whole step and needs `min_preemptions` interrupts as evidence. Below
    the first step (0 %) nothing runs on the new path: entering the ramp needs no gate."""
    target = next_step(ramp, current)
    dwell = current_dwell(ramp, current)
    verdict = Verdict(current=current, target=target.percentage if target else None, dwell_seconds=dwell,
                      held_since=inputs.step_started_at, held_seconds=0.0)
    if target is None:
        verdict.reasons.append(f"the rollout is at {current}%: the last step of the ramp")
        return verdict
    if current < ramp[0].percentage:
        verdict.held_seconds = (inputs.now - inputs.step_started_at).total_seconds()
        return verdict

    held_since = inputs.step_started_at
    last_seen = inputs.step_started_at
    last_breach: tuple[datetime, list[str]] | None = None
    gap: tuple[datetime, datetime] | None = None
    restart = False  # after a breach or a gap the gates are known to hold from the next good observation on
    for obs in inputs.observations:
        if (obs.observed_at - last_seen).total_seconds() > t.max_gap_seconds:
            gap = (last_seen, obs.observed_at)
            restart = True
        breached = _breaches(obs, t)
        if breached:
            last_breach = (obs.observed_at, breached)
            restart = True
        elif restart:
            held_since, restart = max(held_since, obs.observed_at), False
        last_seen = max(last_seen, obs.observed_at)
    if restart:  # the last observation breached: nothing has held yet
        held_since = inputs.now
    unwatched = (inputs.now - last_seen).total_seconds()
    if unwatched > t.max_gap_seconds:
        held_since = inputs.now
    verdict.held_since = held_since
    verdict.held_seconds = max(0.0, (inputs.now - held_since).total_seconds())

    latest = inputs.observations[-1] if inputs.observations else None
    latest_breaches = _breaches(latest, t) if latest else []
    verdict.gates.append({"gate": "watched", "ok": not latest_breaches and unwatched <= t.max_gap_seconds,
                          "observations": len(inputs.observations), "last_observed_s_ago": round(unwatched, 1),
                          "last_gap": [gap[0].isoformat(), gap[1].isoformat()] if gap else None,
                          "detail": "; ".join(latest_breaches) or "ingest lag, reconcile fixes and orphans within "
                                                                  "their thresholds"})
    verdict.gates.append({"gate": "dwell", "ok": verdict.held_seconds >= dwell, "dwell_s": dwell,
                          "held_s": round(verdict.held_seconds, 1), "held_since": held_since.isoformat()})
    if unwatched > t.max_gap_seconds:
        verdict.reasons.append(
            f"the gates are not being watched: no consistency reconcile observation for {unwatched:.0f} s "
            f"(at most {t.max_gap_seconds:.0f} s; is the reconciler running?)")
    elif latest_breaches:
        verdict.reasons.append("a gate fails now: " + "; ".join(latest_breaches))
    elif verdict.held_seconds < dwell:
        if last_breach is not None and last_breach[0] < held_since:
            verdict.reasons.append(f"a gate failed at {last_breach[0].isoformat()} ({'; '.join(last_breach[1])}); "
                                   f"held again for {verdict.held_seconds:.0f} s of the {dwell} s dwell")
        else:
            verdict.reasons.append(f"the {current}% step has held for {verdict.held_seconds:.0f} s of its {dwell} s "
                                   f"dwell")

    interrupts = inputs.preempt_yielded + inputs.preempt_timed_out
    rate = inputs.preempt_yielded / interrupts if interrupts else None
    preempt_ok = interrupts >= t.min_preemptions and (rate is None or rate >= t.preempt_success_min)
    verdict.gates.append({"gate": "preempt_success_rate", "ok": preempt_ok, "rate": rate, "interrupts": interrupts,
                          "min": t.preempt_success_min, "min_interrupts": t.min_preemptions})
    if interrupts < t.min_preemptions:
        verdict.reasons.append(f"not enough evidence: {interrupts} preemption(s) of running work this step, "
                               f"{t.min_preemptions} needed (rollout_gate_min_preemptions)")
    elif rate is not None and rate < t.preempt_success_min:
        verdict.reasons.append(f"preemption success rate {rate:.1%} below {t.preempt_success_min:.0%} "
                               f"({inputs.preempt_timed_out} of {interrupts} hit the hard timeout)")
    return verdict
