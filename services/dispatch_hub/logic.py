"""Pure decisions of the hub over plain values (no I/O): lease tokens, fencing, generations, routing."""

from __future__ import annotations

import math
import secrets
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from libs.auth import hash_token

LEASE_TOKEN_PREFIX = "lt1"
PREEMPT_REASON = "collect_now_preempt"


def new_lease_token(epoch: int) -> str:
    """Opaque to the client, but it carries the lease epoch it was issued for (fencing)."""
    return f"{LEASE_TOKEN_PREFIX}.{epoch}.{secrets.token_urlsafe(24)}"


def lease_token_epoch(token: str) -> int | None:
    """The epoch a lease token was issued for; None for anything that is not one of our tokens."""
    parts = token.split(".", 2)
    if len(parts) != 3 or parts[0] != LEASE_TOKEN_PREFIX or not parts[1].isdigit() or not parts[2]:
        return None
    return int(parts[1])


class LeaseCheck(Enum):
    OK = "ok"
    NOT_FOUND = "not_found"      # no such task for this client (another client's task looks the same)
    STALE = "stale_lease"        # the lease is no longer this token's: expired, ended or re-leased


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What the database says about an execution, as far as fencing is concerned."""

    target_client_id: uuid.UUID
    status: str
    lease_epoch: int
    lease_token_hash: str | None


def check_lease(state: LeaseState | None, *, caller: uuid.UUID, token: str) -> LeaseCheck:
    """Fencing of DESIGN contract 5: token hash AND epoch AND in_progress AND the caller owns the task."""
    if state is None or state.target_client_id != caller:
        return LeaseCheck.NOT_FOUND
    epoch = lease_token_epoch(token)
    if (state.status != "in_progress" or epoch is None or epoch != state.lease_epoch
            or state.lease_token_hash is None or hash_token(token) != state.lease_token_hash):
        return LeaseCheck.STALE
    return LeaseCheck.OK


def is_stale_generation(callback_generation: int, task_generation: int) -> bool:
    """Seed §10.2: a preempt callback older than the task's current generation is ignored."""
    return callback_generation < task_generation


def announced_heartbeat_interval(seconds: float) -> int:
    """`hello.heartbeat_interval_s` is whole seconds: the hub's interval rounded down, at least 1 (a
    sub-second interval must not be announced as 0, which a client would read as "heartbeat constantly")."""
    return max(1, math.floor(seconds))


def routing_keys_for_client(client_id: uuid.UUID) -> tuple[str, str]:
    """What a hub binds for one connected client: every monitor lane plus control, and publish."""
    return (f"monitor.*.{client_id}", f"publish.{client_id}")


def client_id_from_routing_key(routing_key: str) -> uuid.UUID | None:
    """`monitor.high.<uuid>` / `monitor.control.<uuid>` / `publish.<uuid>` -> the client id."""
    _, _, tail = routing_key.rpartition(".")
    try:
        return uuid.UUID(tail)
    except ValueError:
        return None


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not value:
        return None
    return value


def percentile(values: Iterable[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class RollingWindow:
    """The last `size` observations, for a p95 gauge that follows recent behaviour."""

    def __init__(self, size: int = 500) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def p95(self) -> float | None:
        return percentile(self._values, 95)

    def __len__(self) -> int:
        return len(self._values)
