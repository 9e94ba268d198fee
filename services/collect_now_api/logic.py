"""Pure decisions of collect-now: scope hash, target client choice (docs/architecture.md §10.6), rate limits (§15.3)."""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date

HEALTHY = "healthy"


def scope_hash(*, brand_id: int, keyword_id: int | None, question_ids: Sequence[int] | None,
               ai_platform_ids: Sequence[int] | None, business_date: date) -> str:
    """sha256 of the normalised scope: the same selection in any order hashes the same."""
    canonical = {
        "brand_id": brand_id,
        "keyword_id": keyword_id,
        "question_ids": sorted(set(question_ids)) if question_ids else None,
        "ai_platform_ids": sorted(set(ai_platform_ids)) if ai_platform_ids else None,
        "business_date": business_date.isoformat(),
    }
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ClientCandidate:
    client_id: uuid.UUID
    max_concurrent_monitor: int
    in_progress: int
    attempts_last_minute: int
    aborts_last_minute: int
    heartbeat_age_s: float
    platform_health: Mapping[str, str]

    @property
    def free_capacity(self) -> int:
        return self.max_concurrent_monitor - self.in_progress

    @property
    def abort_rate(self) -> float:
        return self.aborts_last_minute / self.attempts_last_minute if self.attempts_last_minute else 0.0


def any_platform_healthy(health: Mapping[str, str]) -> bool:
    """§10.6 "any platform logged in": a client that reported nothing yet is given the benefit of the doubt."""
    return not health or any(state == HEALTHY for state in health.values())


def is_eligible(candidate: ClientCandidate, heartbeat_timeout_s: float) -> bool:
    return candidate.heartbeat_age_s < heartbeat_timeout_s and any_platform_healthy(candidate.platform_health)


@dataclass(frozen=True, slots=True)
class ClientChoice:
    client_id: uuid.UUID | None
    # "requested" | "best_available" | "requested_unavailable" | "none_online"
    reason: str


def choose_target_client(candidates: Sequence[ClientCandidate], *, requested: uuid.UUID | None,
                         heartbeat_timeout_s: float) -> ClientChoice:
    """The explicit client when it is one of the caller's eligible clients, else the best eligible one:
    most free monitor capacity, then lowest abort rate over the last minute, then freshest heartbeat."""
    eligible = [c for c in candidates if is_eligible(c, heartbeat_timeout_s)]
    if requested is not None:
        for candidate in eligible:
            if candidate.client_id == requested:
                return ClientChoice(candidate.client_id, "requested")
    if not eligible:
        return ClientChoice(None, "requested_unavailable" if requested is not None else "none_online")
    best = min(eligible, key=lambda c: (-c.free_capacity, c.abort_rate, c.heartbeat_age_s, str(c.client_id)))
    return ClientChoice(best.client_id, "requested_unavailable" if requested is not None else "best_available")


@dataclass(frozen=True, slots=True)
class RateLimited:
    code: str
    message: str
    retry_after_s: int


def check_rate_limits(*, active_requests: int, max_active_requests: int, earliest_active_ttl_s: float | None,
                      user_requests_last_hour: int, max_user_requests_per_hour: int,
                      oldest_user_request_age_s: float | None) -> RateLimited | None:
    """§15.3: at most N active requests per tenant (not counting the ones this request supersedes) and
    M requests per user per hour. `retry_after_s` says when trying again can succeed."""
    if active_requests >= max_active_requests:
        wait = earliest_active_ttl_s if earliest_active_ttl_s is not None else 60.0
        return RateLimited("too_many_active_requests",
                           f"the tenant already has {active_requests} active collect-now requests "
                           f"(limit {max_active_requests}); wait for one to finish",
                           max(1, math.ceil(wait)))
    if user_requests_last_hour >= max_user_requests_per_hour:
        age = oldest_user_request_age_s if oldest_user_request_age_s is not None else 0.0
        return RateLimited("too_many_requests",
                           f"{user_requests_last_hour} collect-now requests in the last hour "
                           f"(limit {max_user_requests_per_hour} per user)",
                           max(1, math.ceil(3600 - age)))
    return None


def accept_message(*, client_id: uuid.UUID | None, reason: str, promoted: int, aborted_queued: int,
                   interrupt_requested: int) -> str:
    if client_id is None:
        return (f"{promoted} task(s) promoted to high priority; no desktop client is online, so the request "
                "waits (accepted, unbound) until one connects before the TTL")
    parts = [f"{promoted} task(s) promoted to high priority on client {client_id}"]
    if reason == "requested_unavailable":
        parts.append("the requested client is not available, another online client was chosen")
    if aborted_queued or interrupt_requested:
        parts.append(f"{aborted_queued} queued scheduled task(s) cancelled, "
                     f"{interrupt_requested} running scheduled task(s) asked to yield")
    return "; ".join(parts)
