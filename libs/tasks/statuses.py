"""The statuses of the shared task tables, named once (docs/architecture.md, state machines; docs/legacy-path.md).

Every statement that asks "is this work still live?" uses these, in Python and, through the `*_SQL` forms, in SQL.
"""

from __future__ import annotations

from typing import Literal, NewType

# monitoring_collect_tasks.status
BusinessStatus = Literal["pending", "leased", "received", "completed", "failed", "skipped", "expired"]
# desktop_tasks.status
ExecutionStatus = Literal["queued", "in_progress", "succeeded", "failed", "aborted", "unknown"]
# legacy_leases.status
LegacyLeaseStatus = Literal["queued", "in_progress", "succeeded", "failed", "aborted", "expired"]

# Why the system ended (or asked to end) work: desktop_tasks / legacy_leases `interrupt_reason`, the attempt's
# `abort_reason`, the lifecycle event's `reason`. A client's own cancel keeps the reason the client gave instead.
EndReason = Literal[
    "collect_now_preempt",  # a click preempted scheduled work (docs/architecture.md §10)
    "interrupt_hard_timeout",  # the client did not yield before the hard timeout
    "lease_expired",  # the lease ran out without a result
    "result_not_applied",  # a legacy result accepted but never applied (dead-lettered)
    "reconciled_from_unknown",  # an unknown execution converged from the evidence
    "client_offline",  # queued work of a client without a fresh heartbeat
    "business_day_expired",  # the business day is over
    "superseded_by_result",  # another execution's result completed the business task
    "phase2_emergency_rollback",  # monitorctl rollback --force
    "platform_unhealthy",  # queued work of a platform the client reports a broken login on
]
ClientCancelReason = NewType("ClientCancelReason", str)

# An execution is active (blocks a second one of its business task: uq_desktop_tasks_monitor_active) while it is
# one of these.
ACTIVE_EXECUTION: tuple[ExecutionStatus, ...] = ("queued", "in_progress", "unknown")
# A legacy lease lives (uq_legacy_leases_active) while offered or pulled.
ACTIVE_LEASE: tuple[LegacyLeaseStatus, ...] = ("queued", "in_progress")
# A business task is finished (nothing moves it again until a click resets one of today's for a fresh collection) in
# one of these; pending, leased and received ones are live.
FINISHED_BUSINESS: tuple[BusinessStatus, ...] = ("completed", "failed", "skipped", "expired")


def sql_list(values: tuple[str, ...]) -> str:
    """`('a', 'b')`: a tuple of statuses as an SQL list literal."""
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


ACTIVE_EXECUTION_SQL = sql_list(ACTIVE_EXECUTION)
ACTIVE_LEASE_SQL = sql_list(ACTIVE_LEASE)
FINISHED_BUSINESS_SQL = sql_list(FINISHED_BUSINESS)

# The business row's legacy lease columns, cleared (SET list): a row that holds no live lease carries none of them.
CLEAR_LEGACY_LEASE_SQL = ("leased_to_executor = NULL, legacy_lease_id = NULL, lease_token_hash = NULL, "
                          "leased_at = NULL, lease_expires_at = NULL")
