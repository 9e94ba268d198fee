"""`monitorctl rollout advance` (docs/legacy-path.md "The ramp"): the next step of the configured ramp, taken only when
the current step's gates held for its dwell (libs/domain/rollout.py decides; this gathers its inputs from Postgres).

The current step started when `rollout_percentage` was last stored (`dispatch_settings.updated_at`: every
`rollout set`, `rollout advance` and `rollback` stores it). The watched gates come from the consistency reconcile's
rows in `rollout_observations`; the preemption outcomes from the executions interrupted since the step started.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from libs.db.pool import Conn
from libs.dispatch_settings import DispatchSettings, load_settings, set_setting
from libs.domain.rollout import GateInputs, GateThresholds, Observation, Verdict, evaluate, parse_ramp
from libs.tasks import admin_ops
from services.dispatch_coordinator.admin import ROLLOUT_LOCK

_STEP_STARTED = """
SELECT updated_at, now() AS now FROM dispatch_settings WHERE key = 'rollout_percentage'
"""
_NOW = "SELECT now() AS now"
_OBSERVATIONS = """
SELECT observed_at, ingest_lag_ms, reconcile_fixes, orphans FROM rollout_observations
WHERE observed_at >= %(since)s ORDER BY observed_at, id
"""


def thresholds(settings: DispatchSettings) -> GateThresholds:
    return GateThresholds(
        preempt_success_min=settings.rollout_gate_preempt_success_min,
        min_preemptions=settings.rollout_gate_min_preemptions,
        ingest_lag_max_ms=settings.rollout_gate_ingest_lag_ms,
        max_reconcile_fixes=settings.rollout_gate_max_reconcile_fixes,
        max_orphans=settings.rollout_gate_max_orphans,
        # Three missed consistency reconcile runs in a row: the gates were not watched.
        max_gap_seconds=3.0 * max(settings.reconcile_interval_seconds, 1))


async def _verdict(conn: Conn, settings: DispatchSettings) -> Verdict:
    row = await (await conn.execute(_STEP_STARTED)).fetchone()
    if row is None:  # never stored: the default since the schema was created
        now_row = await (await conn.execute(_NOW)).fetchone()
        assert now_row is not None
        now = now_row["now"]
        started = datetime.fromtimestamp(0, UTC)
    else:
        now, started = row["now"], row["updated_at"]
    cur = await conn.execute(_OBSERVATIONS, {"since": started})
    observations = tuple(Observation(observed_at=r["observed_at"], ingest_lag_ms=float(r["ingest_lag_ms"]),
                                     orphans=int(r["orphans"]), reconcile_fixes=int(r["reconcile_fixes"]))
                         for r in await cur.fetchall())
    pre = await admin_ops.preemption_outcomes(conn, since=started)
    inputs = GateInputs(now=now, step_started_at=started, observations=observations,
                        preempt_yielded=pre.yielded, preempt_timed_out=pre.timed_out)
    return evaluate(parse_ramp(settings.rollout_ramp), settings.rollout_percentage, inputs, thresholds(settings))


def _report(verdict: Verdict, settings: DispatchSettings, *, applied: bool, dry_run: bool) -> dict[str, Any]:
    return {
        "applied": applied,
        "dry_run": dry_run,
        "allowed": verdict.allowed,
        "rollout_percentage": {"before": verdict.current,
                               "after": verdict.target if applied else verdict.current},
        "next_step": verdict.target,
        "ramp": settings.rollout_ramp,
        "dwell_seconds": verdict.dwell_seconds,
        "held_seconds": round(verdict.held_seconds, 1),
        "held_since": verdict.held_since.isoformat(),
        "gates": verdict.gates,
        "reasons": verdict.reasons,
    }


async def advance(conn: Conn, *, dry_run: bool = False) -> dict[str, Any]:
    """Take the ramp's next step if the current one's gates held for its dwell; `applied` False and `reasons`
    naming why not otherwise. Under the rollout lock, so two advances never both take a step."""
    async with conn.transaction():
        if not dry_run:
            await conn.execute(ROLLOUT_LOCK)
        settings = await load_settings(conn)
        verdict = await _verdict(conn, settings)
        if verdict.allowed and not dry_run:
            assert verdict.target is not None
            await set_setting(conn, "rollout_percentage", verdict.target)
            return _report(verdict, settings, applied=True, dry_run=False)
    return _report(verdict, settings, applied=False, dry_run=dry_run)
