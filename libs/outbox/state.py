"""Pure outbox decisions: backoff, failure classification, the next state after a failed attempt, the fields of a
transition's log line, and which dead letters an operator's replay resets."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aiormq.exceptions import PublishError as ReturnedMessage

FailureKind = Literal["transient", "permanent"]
FAILURE_KINDS: tuple[FailureKind, ...] = ("transient", "permanent")


@dataclass(frozen=True, slots=True)
class FailureOutcome:
    status: Literal["retryable", "dead_letter"]
    delay_ms: int
    reason: str
    # The failure's class, kept with a dead letter (outbox.last_error_class): an operator's replay resets
    # transient ones only, unless told otherwise.
    error_class: FailureKind = "transient"


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
        return FailureOutcome("dead_letter", 0, f"permanent: {error}", "permanent")
    if attempts >= max_attempts:
        return FailureOutcome("dead_letter", 0, f"gave up after {attempts} attempts: {error}", "transient")
    return FailureOutcome("retryable", backoff_ms(attempts, base_ms=base_ms, max_ms=max_ms, rng=rng), error)


def broker_failure_kind(exc: BaseException) -> FailureKind:
    """The class of a failed publish, from what the broker (or the connection to it) raised.

    Permanent: the broker returned the message (unroutable or refused for this message alone: publishing it
    again gets the same answer). Transient: anything else, a nack, a missing confirm, a lost connection, and
    also a channel the broker closed, since that fails every publish in flight on the channel, not only the
    one that caused it (classing them all permanent would dead-letter innocent events for good)."""
    if isinstance(exc, ReturnedMessage):
        return "permanent"
    return "transient"


# ---- transition log lines --------------------------------------------------------------------------------------

TRANSITION_EVENT = "outbox transition"
Transition = Literal["claimed", "published", "retry_scheduled", "dead_lettered", "lease_expired", "released",
                     "replayed"]
# What every transition line says about the row: its id, tenant and source tuple, and the attempt it is on.
SOURCE_FIELDS = ("outbox_id", "event_id", "tenant_id", "exchange", "routing_key", "ordering_key", "message_type",
                 "attempt", "max_attempts")
ERROR_SUMMARY_LIMIT = 200


def source_of_row(row: Mapping[str, Any]) -> dict[str, object]:
    """The SOURCE_FIELDS of an outbox row as the statements return it (`id`, `attempts`, ...)."""
    return {"outbox_id": row["id"], "event_id": str(row["event_id"]), "tenant_id": row["tenant_id"],
            "exchange": row["exchange"], "routing_key": row["routing_key"], "ordering_key": row["ordering_key"],
            "message_type": row["message_type"], "attempt": row["attempts"], "max_attempts": row["max_attempts"]}


def transition_fields(transition: Transition, from_status: str, to_status: str, *, owner: str,
                      source: Mapping[str, object], **details: object) -> dict[str, object]:
    """The `extra` of one transition's log line: what happened, who did it (the claimer: a pump instance or a
    writer relaying its own rows; the operator for a replay), the row's source fields, and `details` that
    apply (None values are left out)."""
    fields: dict[str, object] = {"transition": transition, "from_status": from_status, "to_status": to_status,
                                 "owner": owner}
    fields.update((k, source.get(k)) for k in SOURCE_FIELDS)
    fields.update((k, v) for k, v in details.items() if v is not None)
    return fields


# A quoted literal in a contract error is a value taken from the payload ("Invalid enum value 'x'").
_QUOTED_VALUE = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def error_summary(exc: BaseException, limit: int = ERROR_SUMMARY_LIMIT) -> tuple[str, str]:
    """(type, first line of the message) of a failure, bounded: what a log line may carry. The type is the
    underlying cause's when the error wraps one. No payload: publish errors describe the failure, not the body,
    and the values a contract error quotes from the payload are blanked out (its field paths are kept)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(cause, msgspec.ValidationError | msgspec.DecodeError):
        first = _QUOTED_VALUE.sub("'...'", first)
    return type(cause).__name__[:limit], first[:limit]


# ---- operator replay --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReplaySkip:
    id: int
    error_class: FailureKind | None  # None: dead-lettered before failures were classed
    reason: str


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What a replay does with the rows it was asked about."""

    reset: list[int] = field(default_factory=list)
    skipped: list[ReplaySkip] = field(default_factory=list)  # permanent or unclassified dead letters
    not_dead: dict[int, str] = field(default_factory=dict)  # id -> its status
    not_found: list[int] = field(default_factory=list)


def plan_replay(rows: Iterable[Mapping[str, Any]], *, requested: Iterable[int] | None,
                include_permanent: bool) -> ReplayPlan:
    """Which of `rows` (id, status, last_error_class, last_error; the named ids' rows, or every dead letter when
    `requested` is None) a replay resets. Only dead letters are reset, and of those only transient ones unless
    `include_permanent`: replaying a permanent failure publishes nothing new, it fails the same way again. A dead
    letter without a class (written before failures were classed) counts as permanent: fail closed."""
    plan = ReplayPlan()
    seen: set[int] = set()
    for row in sorted(rows, key=lambda r: int(r["id"])):
        outbox_id = int(row["id"])
        seen.add(outbox_id)
        if row["status"] != "dead_letter":
            plan.not_dead[outbox_id] = str(row["status"])
            continue
        error_class = row["last_error_class"] if row["last_error_class"] in FAILURE_KINDS else None
        if error_class == "transient" or include_permanent:
            plan.reset.append(outbox_id)
        else:
            plan.skipped.append(ReplaySkip(outbox_id, error_class, _first_line(row["last_error"])))
    if requested is not None:
        plan.not_found.extend(sorted({int(i) for i in requested} - seen))
    return plan


def _first_line(text: object, limit: int = ERROR_SUMMARY_LIMIT) -> str:
    stripped = str(text or "").strip()
    return stripped.splitlines()[0][:limit] if stripped else ""
